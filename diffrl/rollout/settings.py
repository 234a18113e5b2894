"""The rollout section of the training configuration: how many groups and samples a rollout makes, how each group is
split into engine requests, the seeds, and the sampler's settings (steps, guidance, SDE steps).

It lives in the rollout layer so that the rollout manager takes this section itself; the training configuration
(`diffrl/train/config.py`) holds it as its `rollout` section, and every field is a flag of `diffrl train`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class RolloutSettings:
    num_rollout: int = 12
    """Rollouts (sample, score, train) in the run."""
    rollout_batch_size: int = 8
    """Prompt groups per rollout."""
    n_samples_per_prompt: int = 8
    """Samples per prompt group (the group whose rewards are normalized against each other)."""
    rollout_microgroup_size: int = 8
    """Samples of one group sent to an engine in one request (a group is split into requests of this many)."""
    rollout_seed: int = 0
    """Seed of the rollouts' noise (with the group index it fixes each sample)."""
    diffusion_num_steps: int = 10
    """Denoising steps of each rollout sample."""
    diffusion_guidance_scale: float = 1.0
    """CFG scale of rollouts and (unless --eval-guidance-scale) held-out evaluation; 1: no CFG (one forward
    per step)."""
    diffusion_guidance_scale_2: float | None = None
    """CFG scale of the second (low-noise) expert of two-expert families (wan2_2), in rollouts and in the
    trainer's replay alike; None: --diffusion-guidance-scale for both experts."""
    diffusion_noise_level: float = 0.7
    """Noise level a of the SDE steps (their std, see --diffusion-sde-type)."""
    diffusion_sde_type: Literal["sde", "cps", "dance"] = "sde"
    """The SDE steps' kind: sde = Flow-GRPO's (std a·sqrt(σ/(1 − σ))), cps = coefficient-preserving (LTX-2.3's
    recipe), dance = DanceGRPO's constant noise (std a·sqrt(−dt); e.g. --diffusion-noise-level 0.3)."""
    diffusion_sde_window_range: tuple[int, int] | None = None
    """SDE steps are --diffusion-num-sde-steps steps inside [lo, hi) (default: all steps), picked as
    --diffusion-sde-step-strategy says. The published spelling `3,5` is accepted as well as `3 5`."""
    diffusion_num_sde_steps: int = 2
    """SDE (trained) steps per rollout, inside --diffusion-sde-window-range; the other steps are ODE."""
    diffusion_sde_step_strategy: Literal["window", "random", "sliding"] = "window"
    """How each rollout picks its --diffusion-num-sde-steps SDE steps inside --diffusion-sde-window-range:
    window = consecutive steps at a random start (Flow-GRPO-Fast); random = distinct steps drawn uniformly, not
    necessarily adjacent (as the published LTX-2.3 runs), each seeded by the run seed and the rollout index;
    sliding = MixGRPO's window, which starts at the range's first step and moves
    --diffusion-sde-window-stride steps later every --diffusion-sde-window-shift-interval rollouts, then stays
    at the range's end."""
    diffusion_sde_window_shift_interval: int = 25
    """--diffusion-sde-step-strategy sliding: rollouts before the window moves (MixGRPO's shift interval)."""
    diffusion_sde_window_stride: int = 1
    """--diffusion-sde-step-strategy sliding: steps the window moves each time (MixGRPO's window stride)."""
    negative_prompt: str = ""
    """The unconditional prompt of CFG in rollouts and evaluation."""

    def sde_window_range(self) -> tuple[int, int]:
        return self.diffusion_sde_window_range or (0, self.diffusion_num_steps)

    def check(self) -> None:
        for name in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt", "diffusion_num_steps",
                     "rollout_microgroup_size", "diffusion_sde_window_shift_interval", "diffusion_sde_window_stride"):
            _require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        g, g2 = self.diffusion_guidance_scale, self.diffusion_guidance_scale_2
        for flag, value in (("--diffusion-guidance-scale", g), ("--diffusion-guidance-scale-2", g2),
                            ("--diffusion-noise-level", self.diffusion_noise_level)):
            _require(value is None or value >= 0, f"{flag} must be >= 0, got {value}")
        _require(g2 is None or g2 <= 1 or g > 1, f"--diffusion-guidance-scale-2 {g2} needs CFG, which runs only when "
                                                 f"--diffusion-guidance-scale > 1 (got {g})")
