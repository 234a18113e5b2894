"""One denoising transition x_σ → x_σ' with its Gaussian log-prob, for the three rollout kinds.

All arithmetic is fp32 whatever the model's dtype. `sigma` and `sigma_next` are tensors of shape
`[B]` (or scalars), so one call can hold samples at different timesteps (training pairs).
`dt = σ' − σ < 0` because sampling runs from noise (σ = 1) to data (σ = 0).

Each kernel either draws the next latent (noise from per-sample generators, see `noise.py`) or,
given `next_latents`, only scores it — the trainer's use: same mean, same std, same log-prob.

- `sde`: Flow-GRPO's SDE with the marginal-preserving drift correction; noise level `a`.
- `cps`: the coefficient-preserving sampler (LTX-2 recipes); log-prob without constants.
- `dance`: DanceGRPO's SDE, a constant noise level `a` (std `a·sqrt(−dt)`) with its score correction.
- `ode`: Euler; deterministic, no log-prob.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffrl.sampling.noise import randn_per_sample

SDE_TYPES = ("sde", "cps", "dance", "ode")


@dataclass
class StepOutput:
    next_latents: torch.Tensor  # x', fp32, same shape as x
    mean: torch.Tensor  # mean of x' given x (fp32)
    std: torch.Tensor  # per-sample standard deviation of x' given x, [B] (0 for ODE)
    log_prob: torch.Tensor | None  # per-sample log-density of x', mean over non-batch dims, [B]


def _per_sample(value: torch.Tensor | float, x: torch.Tensor) -> torch.Tensor:
    """A scalar or `[B]` value as fp32 `[B, 1, ..., 1]`, broadcastable against x."""
    value = torch.as_tensor(value, dtype=torch.float32, device=x.device)
    if value.ndim == 0:
        value = value.expand(x.shape[0])
    return value.reshape(-1, *([1] * (x.ndim - 1)))


def _draw_or_take(
    mean: torch.Tensor,
    std: torch.Tensor,
    generators: Sequence[torch.Generator] | None,
    next_latents: torch.Tensor | None,
) -> torch.Tensor:
    if next_latents is not None:
        return next_latents.float()
    if generators is None:
        raise ValueError("a stochastic step needs per-sample `generators` (or `next_latents` to score)")
    noise = randn_per_sample(mean.shape, generators, device=mean.device)
    return mean + std * noise


def _mean_over_sample(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1).mean(dim=1)


def _gaussian_step(mean: torch.Tensor, std: torch.Tensor, noise_level: float,
                   generators: Sequence[torch.Generator] | None, next_latents: torch.Tensor | None,
                   log_prob_no_const: bool) -> StepOutput:
    """x' ~ N(mean, std²) (drawn, or `next_latents` scored) and its log-density averaged over a sample's elements;
    `log_prob_no_const`: sglang-diffusion's meaning of the wire flag, −mean((x' − mean)²), as the CPS step.
    With `noise_level` 0 the step is the mean, with no log-prob."""
    if noise_level == 0:
        return StepOutput(mean, mean, std.flatten(), None)
    x_next = _draw_or_take(mean, std, generators, next_latents)
    squared_error = (x_next.detach() - mean) ** 2
    if log_prob_no_const:
        return StepOutput(x_next, mean, std.flatten(), -_mean_over_sample(squared_error))
    log_density = -squared_error / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    return StepOutput(x_next, mean, std.flatten(), _mean_over_sample(log_density))


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
    """The forward (noising) process of flow matching, `x_σ = (1 − σ)·x0 + σ·ε`, whose velocity is
    `ε − x0`: where SFT and DiffusionNFT train the model. `sigma` is a scalar or `[B]`."""
    s = _per_sample(sigma, x0)
    return (1 - s) * x0 + s * noise


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next) -> StepOutput:
    """Euler step `x' = x + v·dt`."""
    x, v = x.float(), v.float()
    dt = _per_sample(sigma_next, x) - _per_sample(sigma, x)
    mean = x + v * dt
    return StepOutput(mean, mean, torch.zeros(x.shape[0], device=x.device), None)


def sde_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    *,
    sigma_max: float | torch.Tensor,
    generators: Sequence[torch.Generator] | None = None,
    next_latents: torch.Tensor | None = None,
    log_prob_no_const: bool = False,
) -> StepOutput:
    """Flow-GRPO SDE step.

    `std_t = a·sqrt(σ / (1 − σ̃))` with σ̃ = σ except at σ = 1, where the schedule's next-largest
    sigma `sigma_max` stands in (the formula is singular at 1): a number, or the schedule's element as a
    0-dim tensor, which spares the denoising loop a read of a device tensor.
    `mean = x·(1 + std_t²·dt/(2σ)) + v·(1 + std_t²·(1 − σ)/(2σ))·dt`, `x' = mean + std_t·sqrt(−dt)·ε`.
    With `noise_level = 0` this is exactly the Euler step. log p is the Gaussian log-density, averaged over
    a sample's elements; `log_prob_no_const` gives `−mean((x' − mean)²)` instead (no variance, no constants).
    """
    x, v = x.float(), v.float()
    sig = _per_sample(sigma, x)
    dt = _per_sample(sigma_next, x) - sig
    if isinstance(sigma_max, torch.Tensor):  # the schedule's own element: no read back to the host
        sigma_max = sigma_max.to(dtype=sig.dtype)
    else:
        sigma_max = torch.full_like(sig, sigma_max)
    sig_tilde = torch.where(sig >= 1.0, sigma_max, sig)
    std_t = noise_level * torch.sqrt(sig / (1 - sig_tilde))
    mean = x * (1 + std_t**2 / (2 * sig) * dt) + v * (1 + std_t**2 * (1 - sig) / (2 * sig)) * dt
    std = std_t * torch.sqrt(-dt)
    return _gaussian_step(mean, std, noise_level, generators, next_latents, log_prob_no_const)


def cps_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    *,
    generators: Sequence[torch.Generator] | None = None,
    next_latents: torch.Tensor | None = None,
) -> StepOutput:
    """Coefficient-preserving step: re-noise the predicted x0 with the predicted noise plus fresh noise.

    `std = σ'·sin(aπ/2)`, `mean = (1 − σ')·x0̂ + sqrt(σ'² − std²)·x1̂`, log p = −mean((x' − mean)²).
    """
    x, v = x.float(), v.float()
    sig, sig_next = _per_sample(sigma, x), _per_sample(sigma_next, x)
    std = sig_next * math.sin(noise_level * math.pi / 2)
    x0_hat = x - sig * v
    x1_hat = x + (1 - sig) * v
    mean = (1 - sig_next) * x0_hat + torch.sqrt(sig_next**2 - std**2) * x1_hat
    return _gaussian_step(mean, std, noise_level, generators, next_latents, log_prob_no_const=True)


def dance_step(
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    *,
    generators: Sequence[torch.Generator] | None = None,
    next_latents: torch.Tensor | None = None,
    log_prob_no_const: bool = False,
) -> StepOutput:
    """DanceGRPO's step (arXiv 2505.07818): Euler plus the score term of a constant-diffusion SDE.

    `x0̂ = x − σ·v`, score `s = −(x − (1 − σ)·x0̂)/σ²`, `mean = x + (v − ½a²·s)·dt`,
    `x' = mean + a·sqrt(−dt)·ε`; log p is the Gaussian log-density, averaged over a sample's elements
    (`log_prob_no_const`: `−mean((x' − mean)²)`). With `a = 0` this is the Euler step.
    """
    x, v = x.float(), v.float()
    sig = _per_sample(sigma, x)
    dt = _per_sample(sigma_next, x) - sig
    x0_hat = x - sig * v
    score = -(x - (1 - sig) * x0_hat) / sig**2
    mean = x + (v - 0.5 * noise_level**2 * score) * dt
    std = noise_level * torch.sqrt(-dt)
    return _gaussian_step(mean, std, noise_level, generators, next_latents, log_prob_no_const)


def transition(
    sde_type: str,
    x: torch.Tensor,
    v: torch.Tensor,
    sigma,
    sigma_next,
    noise_level: float,
    *,
    sigma_max: float | torch.Tensor,
    generators: Sequence[torch.Generator] | None = None,
    next_latents: torch.Tensor | None = None,
    log_prob_no_const: bool = False,
) -> StepOutput:
    """Dispatch on the rollout kind (`sde`, `cps`, `dance` or `ode`)."""
    if sde_type == "sde":
        return sde_step(
            x, v, sigma, sigma_next, noise_level, sigma_max=sigma_max, generators=generators,
            next_latents=next_latents, log_prob_no_const=log_prob_no_const,
        )
    if sde_type == "cps":
        return cps_step(x, v, sigma, sigma_next, noise_level, generators=generators, next_latents=next_latents)
    if sde_type == "dance":
        return dance_step(x, v, sigma, sigma_next, noise_level, generators=generators, next_latents=next_latents,
                          log_prob_no_const=log_prob_no_const)
    if sde_type == "ode":
        return ode_step(x, v, sigma, sigma_next)
    raise ValueError(f"unknown sde type {sde_type!r}; expected one of {SDE_TYPES}")
