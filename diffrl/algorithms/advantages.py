"""Group-relative advantages.

Rewards of one rollout, one per sample, with the prompt of each. Samples sharing a prompt form a
group (pooled across groups when a prompt repeats, as flow_grpo's per-prompt tracker does).
`A = (R − mean) / (std + 1e-4)`: mean per prompt (or over the batch with `globalize_reward_mean`),
std per prompt (or over the batch with `globalize_reward_std`), population std (ddof 0). With one
sample per prompt, std normalization is off. Groups whose rewards are all equal carry no signal:
they are counted (`zero_std_ratio`) and, optionally, masked out.
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


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    prompts: Sequence[str],
    *,
    globalize_reward_mean: bool = False,
    globalize_reward_std: bool = False,
    drop_zero_std_groups: bool = False,
) -> Advantages:
    rewards = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(prompts) != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards for {len(prompts)} prompts")
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
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
    return Advantages(values, keep, zero_std / len(groups))
