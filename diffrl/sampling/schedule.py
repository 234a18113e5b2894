"""Flow-matching sigma schedules.

A schedule for N steps is `N + 1` sigmas running from (near) 1 down to a terminal 0. The unshifted
grid is `linspace(1, 1/N, N)`; families then warp it with a static shift (SD3-style) or a
resolution-dependent dynamic shift (FLUX / Qwen-Image style). The arithmetic follows diffusers'
`FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=...)`, which the tests check against.
"""

from __future__ import annotations

import math
from typing import Literal

import torch


def base_sigmas(num_steps: int) -> torch.Tensor:
    """The unshifted grid `linspace(1, 1/N, N)` (no terminal), float64."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return torch.linspace(1.0, 1.0 / num_steps, num_steps, dtype=torch.float64)


def shift_sigmas(sigmas: torch.Tensor, shift: float) -> torch.Tensor:
    """Static shift `σ' = shift·σ / (1 + (shift − 1)·σ)`; shift > 1 spends more steps at high noise."""
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    return shift * sigmas / (1 + (shift - 1) * sigmas)


def dynamic_shift_sigmas(
    sigmas: torch.Tensor, mu: float, kind: Literal["exponential", "linear"] = "exponential"
) -> torch.Tensor:
    """Resolution-dependent shift: `e^μ / (e^μ + 1/σ − 1)` (exponential) or `μ / (μ + 1/σ − 1)` (linear)."""
    if kind == "exponential":
        return math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
    if kind == "linear":
        return mu / (mu + (1 / sigmas - 1))
    raise ValueError(f"unknown dynamic shift kind {kind!r}; expected 'exponential' or 'linear'")


def resolution_mu(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """μ linear in the number of image tokens (FLUX.1, Qwen-Image, SD3 with dynamic shifting)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * slope + (base_shift - slope * base_seq_len)


def flux2_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """μ fitted on token count and step count (FLUX.2 / FLUX 3 pipelines)."""
    a1, b1 = 8.73809524e-05, 1.89833333
    a2, b2 = 0.00016927, 0.45666666
    if image_seq_len > 4300:
        return float(a2 * image_seq_len + b2)
    mu_200 = a2 * image_seq_len + b2
    mu_10 = a1 * image_seq_len + b1
    slope = (mu_200 - mu_10) / 190.0
    return float(slope * num_steps + (mu_200 - 200.0 * slope))


def make_sigmas(
    num_steps: int,
    *,
    shift: float | None = None,
    mu: float | None = None,
    dynamic_kind: Literal["exponential", "linear"] = "exponential",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The full schedule, float32 `[N + 1]` with terminal 0. Give `shift` or `mu`, not both (or neither)."""
    if shift is not None and mu is not None:
        raise ValueError("give either a static `shift` or a dynamic-shift `mu`, not both")
    sigmas = base_sigmas(num_steps)
    if mu is not None:
        sigmas = dynamic_shift_sigmas(sigmas, mu, dynamic_kind)
    elif shift is not None:
        sigmas = shift_sigmas(sigmas, shift)
    sigmas = torch.cat([sigmas, sigmas.new_zeros(1)])
    return sigmas.to(dtype=torch.float32, device=device)
