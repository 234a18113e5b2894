"""Losses of every RL method (`algorithms/methods.py` lists them), as pure functions over tensors.

Inputs are per-sample tensors; every function returns the scalar loss and the statistics the trainer
logs. Each docstring gives the equation it implements (`docs/algorithms.md` has the papers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def per_sample_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean over every dimension but the first: `[B, …] → [B]`."""
    return t.flatten(1).mean(1)


def x_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """x-based KL of two Gaussian steps with one std (Flow-GRPO): `mean((μ_θ − μ_ref)²) / (2σ²)`, per sample."""
    return per_sample_mean((mean - ref_mean) ** 2) / (2 * std**2)


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32 when its dtype is narrower (a bf16 forward's output), else as it is."""
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def v_kl(v: torch.Tensor, v_ref: torch.Tensor) -> torch.Tensor:
    """v-based KL (DanceGRPO, the forward-process methods): `mean((v_θ − v_ref)²)`, per sample."""
    return per_sample_mean((at_least_fp32(v) - at_least_fp32(v_ref)) ** 2)


def adaptive_mse(err: torch.Tensor) -> torch.Tensor:
    """DiffusionNFT's adaptive weighting of a squared error: `mean(err²) / sg(mean|err|).clamp(1e-5)`, per sample."""
    return per_sample_mean(err**2) / per_sample_mean(err.detach().abs()).clamp(min=1e-5)


@dataclass
class ClippedTerms:
    policy_loss: torch.Tensor
    ratio: torch.Tensor  # [B], detached
    clipfrac: torch.Tensor  # fraction of samples whose ratio left [1 − ε, 1 + ε]


def clipped_policy_loss(log_ratio: torch.Tensor, advantages: torch.Tensor, *, clip_range: float,
                        adv_clip_max: float) -> ClippedTerms:
    """PPO's clipped surrogate: `mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)))`, ρ = exp(log_ratio), A clamped to ±c."""
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1 - clip_range, 1 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    with torch.no_grad():
        clipfrac = ((ratio - 1).abs() > clip_range).float().mean()
    return ClippedTerms(policy_loss, ratio.detach(), clipfrac)


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
    kl: torch.Tensor | None = None,
    log_ratio: torch.Tensor | None = None,
) -> GrpoTerms:
    """`L = mean(max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε))) + β·mean(KL)`, ρ = exp(logp − logp_old).

    `kl`: the per-sample KL to the reference (`x_kl` or `v_kl`), needed when `kl_beta > 0`. `log_ratio`: log ρ when
    it is not `logp − logp_old` (GRPO-Guard's normalized ratio, `guard_log_ratio`); approx_kl stays ½·mean(Δlogp²)."""
    delta = log_prob - old_log_prob
    terms = clipped_policy_loss(delta if log_ratio is None else log_ratio, advantages, clip_range=clip_range,
                                adv_clip_max=adv_clip_max)
    policy_loss = terms.policy_loss
    kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if kl_beta > 0:
        if kl is None:
            raise ValueError("kl_beta > 0 needs the per-sample KL to the reference")
        kl_loss = kl.mean()
    loss = policy_loss + kl_beta * kl_loss
    with torch.no_grad():
        approx_kl = 0.5 * (delta**2).mean()
    return GrpoTerms(loss, policy_loss, kl_loss, terms.ratio, approx_kl, terms.clipfrac)


def guard_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, step_std: torch.Tensor, mean: torch.Tensor,
                    old_mean: torch.Tensor, *, ratio_norm: bool = True) -> torch.Tensor:
    """GRPO-Guard's regulated log-ratio of one SDE step (arXiv 2510.22319; Flow-Factory's `grpo-guard`):
    `log ρ̃ = s·(log p − log p_old) + mean((μ_θ − μ_old)²)/(2s)`, s = the step's std (std_t·sqrt(−dt)).

    Scaling by s is TempFlow-GRPO's noise-aware weighting (arXiv 2508.04324): a step contributes in proportion to
    the noise it injects. The second term (`ratio_norm`) removes the negative bias of log ρ, whose expectation
    under the old policy is −mean(Δμ²)/(2s²): with x' = μ_old + s·ε, log ρ̃ = mean(ε·(μ_θ − μ_old)), centered at 0."""
    s = step_std.reshape(-1)
    log_ratio = s * (log_prob - old_log_prob)
    if ratio_norm:
        log_ratio = log_ratio + per_sample_mean((mean - old_mean) ** 2) / (2 * s)
    return log_ratio


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
        return adaptive_mse(err) if adaptive_weighting else per_sample_mean(err**2)

    pos, neg = branch(v_pos), branch(v_neg)
    policy = (adv_clip_max * (r * pos + (1 - r) * neg) / beta).mean()
    kl_loss = torch.zeros((), dtype=policy.dtype, device=policy.device)
    if kl_beta > 0:
        if v_ref is None:
            raise ValueError("kl_beta > 0 needs the reference velocity")
        kl_loss = v_kl(v_theta, v_ref).mean()
    return NftTerms(policy + kl_beta * kl_loss, pos.mean().detach(), neg.mean().detach(), kl_loss)


def sft_loss(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """Flow matching: the velocity of x_t = (1 − t)·x0 + t·ε is ε − x0."""
    return torch.nn.functional.mse_loss(v_pred.float(), (noise - x0).float())


def ema_decay(step: int, *, ramp: float = 0.001, max_decay: float = 0.5, flat: int = 0) -> float:
    """NFT's old-policy decay δ = min(max(k − flat, 0)·ramp, max): θ_old ← δ·θ_old + (1 − δ)·θ."""
    return min(max(step - flat, 0) * ramp, max_decay)


# ---------------------------------------------------------------- forward-process methods
# Each trains on x_t = (1 − t)·x0 + t·ε re-noised from a sample's clean latent x0; the flow-matching target is
# ε − x0, and a model's "error" on a sample is ℓ(v) = mean((v − (ε − x0))²).


def flow_matching_error(v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """ℓ(v) = mean((v − (ε − x0))²) per sample, in float32 at least."""
    return per_sample_mean((at_least_fp32(v) - at_least_fp32(noise - x0)) ** 2)


AWM_WEIGHTINGS = ("uniform", "t", "t2", "huber", "ghuber")
_AWM_EPS = 1e-10


def awm_log_prob(err: torch.Tensor, t: torch.Tensor, weighting: str, ghuber_power: float = 0.25) -> torch.Tensor:
    """AWM's per-sample log-likelihood surrogate from the flow-matching error ℓ at timestep t (arXiv 2509.25050;
    weightings as Flow-Factory's `awm_weighting`): uniform −ℓ, t −t·ℓ, t2 −t²·ℓ, huber −t·(sqrt(ℓ + ε) − sqrt(ε)),
    ghuber −(t/p)·((ℓ + ε)^p − ε^p), ε = 1e-10, p = `ghuber_power`. Computed in float64 (ratios of nearby values)."""
    err, t = err.double(), t.double().reshape(-1)
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -t * err
    if weighting == "t2":
        return -(t**2) * err
    if weighting == "huber":
        return -t * (torch.sqrt(err + _AWM_EPS) - _AWM_EPS**0.5)
    if weighting == "ghuber":
        p = ghuber_power
        return -(t / p) * ((err + _AWM_EPS) ** p - _AWM_EPS**p)
    raise ValueError(f"unknown AWM weighting {weighting!r}; expected one of {AWM_WEIGHTINGS}")


@dataclass
class AwmTerms:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    ratio: torch.Tensor
    clipfrac: torch.Tensor


def awm_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, *, clip_range: float,
             adv_clip_max: float, penalty: torch.Tensor | None = None) -> AwmTerms:
    """Advantage Weighted Matching: PPO's clipped surrogate on ρ = exp(log p_θ − log p_old), log p from
    `awm_log_prob`. Unclipped (ρ = 1 on policy) its gradient is `mean(A·∇w(ℓ))`: the flow-matching loss of each
    sample weighted by its advantage. `penalty`: the KL terms already weighted (added as they are)."""
    terms = clipped_policy_loss((log_prob - old_log_prob).float(), advantages, clip_range=clip_range,
                                adv_clip_max=adv_clip_max)
    loss = terms.policy_loss if penalty is None else terms.policy_loss + penalty
    return AwmTerms(loss, terms.policy_loss, terms.ratio, terms.clipfrac)


@dataclass
class PreferenceTerms:
    loss: torch.Tensor
    implicit_accuracy: torch.Tensor  # fraction of pairs (groups) the model already ranks as the reward does
    margin: torch.Tensor  # mean of the sigmoid's argument


def dpo_loss(err_chosen: torch.Tensor, err_rejected: torch.Tensor, ref_err_chosen: torch.Tensor,
             ref_err_rejected: torch.Tensor, *, beta: float) -> PreferenceTerms:
    """Diffusion-DPO (arXiv 2311.12908, eq. 14) on flow-matching errors, as Flow-Factory's `dpo`:
    `L = −log σ(−β/2·[(ℓ_θ(x_w) − ℓ_ref(x_w)) − (ℓ_θ(x_l) − ℓ_ref(x_l))])` (the paper's T·ω(λ) folded into β)."""
    z = -0.5 * beta * ((err_chosen - ref_err_chosen) - (err_rejected - ref_err_rejected))
    loss = -F.logsigmoid(z).mean()
    return PreferenceTerms(loss, (z.detach() > 0).float().mean(), z.detach().mean())


def dgpo_loss(err: torch.Tensor, ref_err: torch.Tensor, advantages: torch.Tensor, *, beta: float,
              adv_clip_max: float, frozen: torch.Tensor | None = None) -> PreferenceTerms:
    """DGPO (arXiv 2510.08425): a group's samples with positive advantage are preferred to those with negative
    advantage, each weighted by |A|: `L_g = −log σ(−(β/n)·Σ_i A_i·(ℓ_θ(x_i) − ℓ_ref(x_i)))`, averaged over
    groups. `err`, `ref_err`, `advantages`: `[G, n]` (A clamped to ±c). Its gradient is Flow-Factory's
    gradient-equivalent loss `σ(β/n·Σ A·Δℓ)·A·ℓ_θ` times β/n. `frozen` (`[G, n]` bool, `dgpo_clip_mask`): samples
    whose error counts in their group's sum but passes no gradient (the reference code's clipped DSM)."""
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    if frozen is not None:
        err = torch.where(frozen, err.detach(), err)
    z = -(beta / err.shape[1]) * (adv * (err - ref_err)).sum(1)
    loss = -F.logsigmoid(z).mean()
    return PreferenceTerms(loss, (z.detach() > 0).float().mean(), z.detach().mean())


def dgpo_clip_mask(err: torch.Tensor, old_err: torch.Tensor, advantages: torch.Tensor, *, clip_range: float,
                   adv_clip_max: float) -> torch.Tensor:
    """DGPO's PPO-style clip on the flow-matching error (the reference code's `clip_dsm`): with the likelihood ratio
    `ρ = exp(ℓ_old − ℓ_θ)` against the old policy, a sample is clipped (True) once its update has gone far enough in
    the direction its advantage asks: `ρ > 1 + ε` for A > 0, `ρ < 1 − ε` for A ≤ 0. Any shape; no gradient."""
    ratio = torch.exp(old_err.detach() - err.detach())
    adv = advantages.clamp(-adv_clip_max, adv_clip_max)
    return torch.where(adv > 0, ratio > 1 + clip_range, ratio < 1 - clip_range)


CRD_LOSSES = ("mse", "bce")


@dataclass
class CrdTerms:
    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl_loss: torch.Tensor
    implicit_reward: torch.Tensor  # mean of r_θ


def crd_loss(err: torch.Tensor, old_err: torch.Tensor, advantages: torch.Tensor, *, beta: float, adv_clip_max: float,
             kind: str = "mse", kl: torch.Tensor | None = None, kl_beta: float = 0.0,
             reward_adaptive_kl: bool = False) -> CrdTerms:
    """Centered Reward Distillation (arXiv 2603.14128): the model's implicit reward `r_θ = −(ℓ̃_θ − ℓ̃_old)` (ℓ̃:
    `adaptive_mse` of the flow-matching error, against the old policy's) matches the external reward after both are
    centered within their prompt's group, where the prompt's unknown normalizer cancels.

    `r = clamp(clamp(A, ±c)/(2c) + 0.5, 0, 1)` (NFT's weight), `R_c = r − mean_g(r)`, `R_θc = r_θ − mean_g(r_θ)`;
    mse: `mean((β·R_θc − R_c)²)`, bce: `BCE(logits β·R_θc, targets σ(R_c))`; the policy loss is that times c/β.
    KL (`kl`: per sample, `[G, n]`) weighted by `kl_beta`, or with `reward_adaptive_kl` by
    `kl_beta·(m + r·(1 − m))`, m = 1e-4/kl_beta, so that low-reward samples are held less. Inputs `[G, n]`."""
    r = nft_reward_weight(advantages, adv_clip_max)
    r_c = r - r.mean(1, keepdim=True)
    r_theta = -(err - old_err)
    r_theta_c = r_theta - r_theta.mean(1, keepdim=True)
    if kind == "mse":
        distill = ((beta * r_theta_c - r_c) ** 2).mean()
    elif kind == "bce":
        distill = F.binary_cross_entropy_with_logits(beta * r_theta_c, torch.sigmoid(r_c))
    else:
        raise ValueError(f"unknown CRD loss {kind!r}; expected one of {CRD_LOSSES}")
    policy_loss = distill * adv_clip_max / max(beta, 1e-8)
    kl_loss = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    if kl_beta > 0:
        if kl is None:
            raise ValueError("kl_beta > 0 needs the per-sample KL to the reference")
        weight = torch.ones_like(r)
        if reward_adaptive_kl:
            floor = 1e-4 / kl_beta
            weight = floor + r * (1 - floor)
        kl_loss = (weight * kl).mean()
    return CrdTerms(policy_loss + kl_beta * kl_loss, policy_loss, kl_loss, r_theta.detach().mean())


def snapshot_decay(step: int, schedule: tuple[float, float, float, float]) -> float:
    """A snapshot's decay at rollout `step` from (start step, start value, slope, end value): the start value before
    the start step, then `min(start value + (step − start)·slope, end value)` (CRD's old and sampling models)."""
    start, value, slope, end = schedule
    if step < start:
        return value
    return min(value + (step - start) * slope, end)
