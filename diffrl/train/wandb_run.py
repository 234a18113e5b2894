"""Weights & Biases logging of a run, when asked (`--use-wandb`): the records `metrics.jsonl` gets, at the
rollout as step, and evaluation images. `wandb` is optional: asked for without it installed, the run is
refused before anything loads.

A run folder keeps its W&B run id (`wandb_id`), so `--resume` continues the same W&B run. W&B cannot take
back what it was sent: the rollouts a killed run logged after its last checkpoint keep their first values
there (`metrics.jsonl` and TensorBoard are rewritten to the resumed run's).
"""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path

import torch


def require_wandb():
    """The `wandb` module, or a one-line error saying how to get it."""
    try:
        return importlib.import_module("wandb")
    except ImportError:
        raise ValueError("--use-wandb: the wandb package is not installed (pip install wandb)") from None


class WandbRun:
    def __init__(self, run_dir: Path, settings, config: dict):
        """`settings`: the run's CheckpointConfig (project, group, name, mode); `config`: the flat settings."""
        wandb = require_wandb()
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        self._wandb = wandb
        self._run = wandb.init(project=settings.wandb_project, group=settings.wandb_group,
                               name=settings.wandb_run_name or run_dir.name, config=config, dir=str(run_dir),
                               mode=settings.wandb_mode, id=run_id, resume="allow")

    def log(self, step: int, record: dict) -> None:
        self._run.log(record, step=step)

    def log_images(self, tag: str, images: torch.Tensor, step: int, captions: list[str] | None = None) -> None:
        """[N, C, H, W] images in [0, 1]."""
        pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        captions = captions or [None] * len(pixels)
        self._run.log({tag: [self._wandb.Image(p, caption=c) for p, c in zip(pixels, captions)]}, step=step)

    def finish(self) -> None:
        self._run.finish()
