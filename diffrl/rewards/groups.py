"""Group rewards: a sample's score depends on the other samples of its prompt.

- `rank:SPEC`: the reward SPEC's values ranked within each prompt's group and mapped to [0, 1] (the worst 0, the
  best 1, ties sharing their mean rank; a group of one scores 0.5). Only the order counts, so a reward whose scale
  drifts or saturates keeps giving a signal.
- `pairwise:SPEC` (`pairwise@T:SPEC` for a temperature T, default 1): a preference reward made from a pointwise one.
  Each pair of a group is judged by the Bradley–Terry probability `σ((s_i − s_j) / T)` that sample i is preferred
  to j, and a sample scores its mean preference over the others (0.5 alone, or when all are equal).

A group is every sample of one prompt that the reward is given at once: in a rollout, the trainer scores a prompt's
whole group when its last microgroup lands (`scores_groups`), so scoring still overlaps the other groups'
generation. Advantages stay per prompt. SPEC is any other reward spec (`multi:` included; its terms are not passed
on).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

PREFIXES = ("rank:", "pairwise:", "pairwise@")


def is_group_reward(spec: str) -> bool:
    return spec.startswith(PREFIXES)


def ranks01(values: list[float]) -> list[float]:
    """Each value's rank among `values` mapped to [0, 1]: 0 for the smallest, 1 for the largest, tied values their
    mean rank; 0.5 for a single value."""
    n = len(values)
    if n == 1:
        return [0.5]
    order = sorted(range(n), key=values.__getitem__)
    ranks = [0.0] * n
    start = 0
    while start < n:
        end = start
        while end + 1 < n and values[order[end + 1]] == values[order[start]]:
            end += 1
        for k in range(start, end + 1):
            ranks[order[k]] = (start + end) / 2
        start = end + 1
    return [r / (n - 1) for r in ranks]


def mean_preference(values: list[float], temperature: float) -> list[float]:
    """Each sample's mean Bradley–Terry preference σ((s_i − s_j)/T) over the other samples (0.5 alone)."""
    n = len(values)
    if n == 1:
        return [0.5]

    def sigmoid(x: float) -> float:
        return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))

    return [sum(sigmoid((values[i] - values[j]) / temperature) for j in range(n) if j != i) / (n - 1)
            for i in range(n)]


def group_reward(spec: str, inner: Callable) -> Callable:
    """The group reward of `spec` (`rank:…`, `pairwise:…`, `pairwise@T:…`) over the pointwise reward `inner`."""
    kind, _, _ = spec.partition(":")
    temperature = 1.0
    if kind.startswith("pairwise@"):
        try:
            temperature = float(kind.removeprefix("pairwise@"))
        except ValueError:
            raise ValueError(f"reward {spec!r}: the temperature in pairwise@T: is a number") from None
        if not temperature > 0:
            raise ValueError(f"reward {spec!r}: the temperature in pairwise@T: must be > 0")
    transform = ranks01 if kind == "rank" else (lambda values: mean_preference(values, temperature))

    async def score(images, prompts, metadata=None) -> list[float]:
        values = inner(images, prompts, metadata)
        if inspect.isawaitable(values):
            values = await values
        values = [float(v) for v in values]
        groups: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(prompt, []).append(i)
        out = [0.0] * len(values)
        for members in groups.values():
            for i, value in zip(members, transform([values[i] for i in members]), strict=True):
                out[i] = value
        return out

    score.scores_groups = True
    return score
