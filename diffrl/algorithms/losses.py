"""Losses: Flow-GRPO's clipped policy ratio, DiffusionNFT's implicit guidance loss, flow-matching SFT.

Inputs are per-sample tensors; every function returns the scalar loss and the statistics the
trainer logs. Formulas: DESIGN §4.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrpoTerms:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    ratio: torch.Tensor  # [B]
    approx_kl: torch.Tensor  # ½·mean(Δlogp²)
    clipfrac: torch.Tensor  # fraction of samples whose ratio left [1 − ε, 1 + ε]


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    kl_beta: float = 0.0,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std: torch.Tensor | None = None,
) -> GrpoTerms:
    """`L = mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))) + β·mean((μ_θ − μ_ref)²)/(2σ²)`, ρ = exp(logp − logp_old)."""
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    delta = log_prob - old_log_prob
    ratio = torch.exp(delta)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if kl_beta > 0:
        if mean is None or ref_mean is None or std is None:
            raise ValueError("kl_beta > 0 needs the policy mean, the reference mean and the step std")
        per_sample = ((mean - ref_mean) ** 2).flatten(1).mean(1) / (2 * std**2)
        kl_loss = per_sample.mean()
    loss = policy_loss + kl_beta * kl_loss
    with torch.no_grad():
        approx_kl = 0.5 * (delta**2).mean()
        clipfrac = ((ratio - 1).abs() > clip_range).float().mean()
    return GrpoTerms(loss, policy_loss, kl_loss, ratio.detach(), approx_kl, clipfrac)


def nft_reward_weight(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """r = clamp(clamp(A, ±c)/(2c) + 0.5, 0, 1): the probability-like weight of the positive branch."""
    c = adv_clip_max
    return (advantages.clamp(-c, c) / (2 * c) + 0.5).clamp(0, 1)


@dataclass
class NftTerms:
    loss: torch.Tensor
    positive_loss: torch.Tensor
    negative_loss: torch.Tensor
    kl_loss: torch.Tensor


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    *,
    beta: float,
    adv_clip_max: float,
    adaptive_weighting: bool = True,
    kl_beta: float = 0.0,
    v_ref: torch.Tensor | None = None,
) -> NftTerms:
    """DiffusionNFT: implicit positive/negative policies around the old one.

    v⁺ = β·v_θ + (1 − β)·v_old, v⁻ = (1 + β)·v_old − β·v_θ, x̂± = x_t − t·v±,
    ℓ± = mean((x̂± − x0)²) / sg(mean|x̂± − x0|).clamp(1e-5) (adaptive weighting),
    L = c·(r·ℓ⁺ + (1 − r)·ℓ⁻)/β + β_KL·mean((v_θ − v_ref)²).
    """
    shape = (-1,) + (1,) * (x_t.ndim - 1)
    t = t.reshape(shape)
    r = nft_reward_weight(advantages, adv_clip_max)
    v_pos = beta * v_theta + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v_theta

    def branch(v):
        err = x_t - t * v - x0
        sq = (err**2).flatten(1).mean(1)
        if adaptive_weighting:
            sq = sq / err.detach().abs().flatten(1).mean(1).clamp(min=1e-5)
        return sq

    pos, neg = branch(v_pos), branch(v_neg)
    policy = (adv_clip_max * (r * pos + (1 - r) * neg) / beta).mean()
    kl_loss = torch.zeros((), dtype=policy.dtype, device=policy.device)
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs the reference velocity")
        kl_loss = ((v_theta - v_ref) ** 2).mean()
    return NftTerms(policy + kl_beta * kl_loss, pos.mean().detach(), neg.mean().detach(), kl_loss)


def sft_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Flow matching: the velocity of x_t = (1 − t)·x0 + t·ε is ε − x0."""
    return torch.nn.functional.mse_loss(v_pred.float(), (noise - x0).float())


def ema_decay(step: int, *, ramp: float = 0.001, max_decay: float = 0.5, flat: int = 0) -> float:
    """NFT's old-policy decay δ = min(max(k − flat, 0)·ramp, max): θ_old ← δ·θ_old + (1 − δ)·θ."""
    return min(max(step - flat, 0) * ramp, max_decay)
