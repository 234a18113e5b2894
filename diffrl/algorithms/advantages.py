"""Group-relative advantages.

Rewards of one rollout, one per sample, with the prompt of each. Samples sharing a prompt form a
group (pooled across groups when a prompt repeats, as flow_grpo's per-prompt tracker does).
`A = (R − mean) / (std + 1e-4)`: mean per prompt (or over the batch with `globalize_reward_mean`),
std per prompt (or over the batch with `globalize_reward_std`), population std (ddof 0). With one
sample per prompt, std normalization is off. Groups whose rewards are all equal carry no signal:
they are counted (`zero_std_ratio`) and, optionally, masked out.

GDPO (arXiv 2601.05242) normalizes each term of a multi-reward on its own before combining them, so that a term
with a wide spread does not drown the others: `A = BN(Σ_k w_k·(R_k − mean_g R_k)/max(std_g R_k, 1e-6))`, the
mean and std per prompt group, BN the batch-wide standardization `(x − mean)/(std + 1e-4)` (`gdpo_values`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

STD_EPS = 1e-4


@dataclass
class Advantages:
    values: torch.Tensor  # [N] float64
    keep: torch.Tensor  # [N] bool: False for samples of dropped zero-std groups
    zero_std_ratio: float  # fraction of prompt groups whose rewards are all equal


def _groups(prompts: Sequence[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    return groups


GDPO_STD_FLOOR = 1e-6


def gdpo_values(terms: torch.Tensor, weights: Sequence[float], prompts: Sequence[str]) -> torch.Tensor:
    """GDPO's advantages from `terms` `[N, K]` (each reward term's values per sample) and the terms' weights."""
    terms = torch.as_tensor(terms, dtype=torch.float64)
    if terms.ndim != 2 or terms.shape[0] != len(prompts) or terms.shape[1] != len(weights):
        raise ValueError(f"GDPO needs [samples, terms] values: got {tuple(terms.shape)} for {len(prompts)} samples "
                         f"and {len(weights)} weights")
    normalized = torch.empty_like(terms)
    for idx in _groups(prompts).values():
        r = terms[idx]
        normalized[idx] = (r - r.mean(0)) / r.std(0, correction=0).clamp(min=GDPO_STD_FLOOR)
    combined = normalized @ torch.as_tensor(weights, dtype=torch.float64)
    return (combined - combined.mean()) / (combined.std(correction=0) + STD_EPS)


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    prompts: Sequence[str],
    *,
    globalize_reward_mean: bool = False,
    globalize_reward_std: bool = False,
    drop_zero_std_groups: bool = False,
    reward_terms: torch.Tensor | None = None,
    term_weights: Sequence[float] | None = None,
) -> Advantages:
    """`reward_terms` `[N, K]` with `term_weights`: GDPO's advantages (`gdpo_values`) in place of the summed
    reward's; zero-std groups are still those whose summed rewards are all equal."""
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(prompts) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards for {len(prompts)} prompts")
    groups = _groups(prompts)
    single_sample = all(len(idx) == 1 for idx in groups.values())
    values = torch.empty_like(rewards)
    keep = torch.ones_like(rewards, dtype=torch.bool)
    zero_std = 0
    for idx in groups.values():
        r = rewards[idx]
        mean = rewards.mean() if globalize_reward_mean else r.mean()
        std = rewards.std(correction=0) if globalize_reward_std else r.std(correction=0)
        if bool((r == r[0]).all()):
            zero_std += 1
            if drop_zero_std_groups and len(idx) > 1:
                keep[idx] = False
        values[idx] = r - mean if single_sample else (r - mean) / (std + STD_EPS)
    if reward_terms is not None:
        values = gdpo_values(reward_terms, term_weights, prompts)
    return Advantages(values, keep, zero_std / len(groups))
