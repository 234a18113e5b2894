"""The task seam: what the training loop asks of a source of prompts and a way of judging a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from diffrl.data.prompts import PromptRecord


@dataclass(frozen=True)
class EvalSettings:
    """How held-out images are sampled: ODE at fixed seeds, the rollout's size and CFG unless overridden."""

    num_steps: int
    guidance_scale: float
    guidance_scale_2: float | None = None
    """The second (low-noise) expert's CFG scale (Wan2.2); None: guidance_scale."""
    resolution: int | None = None
    """The square shorthand of height × width (as --resolution); None: height/width, else the family's."""
    height: int | None = None
    width: int | None = None
    num_frames: int | None = None
    negative_prompt: str = ""
    reward_frames: int | None = None
    """Video: the frames of each video a reward sees (as --reward-frames); None: every frame."""

    @classmethod
    def from_config(cls, cfg) -> EvalSettings:
        e, r = cfg.eval, cfg.rollout
        rollout_cfg = e.eval_guidance_scale is None  # the rollouts' CFG, both experts' scales; else the override's
        return cls(num_steps=e.eval_num_steps or r.diffusion_num_steps,
                   guidance_scale=r.diffusion_guidance_scale if rollout_cfg else e.eval_guidance_scale,
                   guidance_scale_2=(e.eval_guidance_scale_2 if e.eval_guidance_scale_2 is not None
                                     else r.diffusion_guidance_scale_2 if rollout_cfg else None),
                   **eval_size(cfg),
                   num_frames=cfg.model.num_frames if e.eval_num_frames is None else e.eval_num_frames,
                   negative_prompt=r.negative_prompt,
                   reward_frames=cfg.task.reward_frames)

    def size(self) -> dict:
        """The size keywords of the evaluation functions."""
        return {"resolution": self.resolution, "height": self.height, "width": self.width}


def eval_size(cfg) -> dict:
    """The held-out samples' size keywords: --eval-resolution / --eval-height and --eval-width, else the rollouts'."""
    e, m = cfg.eval, cfg.model
    if e.eval_resolution is None and e.eval_height is None:
        return {"resolution": m.resolution, "height": m.height, "width": m.width}
    return {"resolution": e.eval_resolution, "height": e.eval_height, "width": e.eval_width}


@dataclass
class EvalOutcome:
    metrics: dict[str, float] = field(default_factory=dict)
    """Logged as they are (`eval/…` on held-out prompts, `val/…` on a validation subset)."""
    images: torch.Tensor | None = None
    """A few evaluated images (first ones, [N, C, H, W] in [0, 1]) for TensorBoard."""
    captions: list[str] = field(default_factory=list)


class Task(Protocol):
    name: str
    selection_metric: str | None
    """A metric of `evaluate` that picks `checkpoints/best` (higher is better), or None. It must not
    come from the held-out prompts."""
    evaluates: bool
    """Whether `evaluate` does anything (a run with no evaluation swaps no weights for it)."""

    def draw(self, k: int, batch: int) -> list[PromptRecord]:
        """Rollout k's `batch` prompts (one per group), with the metadata the reward sees."""

    def observe(self, prompts: Sequence[PromptRecord], group_rewards: Sequence[Sequence[float]]) -> dict[str, float]:
        """Fold one rollout's rewards in; returns metrics to log (`rollout/…`)."""

    def evaluate(self, family, k: int, out_dir) -> EvalOutcome:
        """Judge the model the engine's `family` holds now; files go under `out_dir` (the run's eval/)."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def check_family(self, family) -> None:
        """Refuse, up front, a family this task cannot evaluate (e.g. video for an image verifier)."""
