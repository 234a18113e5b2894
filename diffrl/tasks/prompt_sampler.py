"""Which train prompts a rollout draws: the category of each group, then a prompt within it.

`uniform`: categories take turns across groups (group j of rollout k draws from category
(k·B + j) mod C), so every rollout has the same mix when B is a multiple of C and the reward curve
is not shaken by the mix.

`adaptive`: groups are shared out in proportion to `floor + (1 − r̄_c)`, where r̄_c is an
exponential average of category c's mean training reward (rewards in [0, 1]). Categories the model
already solves (r̄ near 1: every sample scores alike, so their groups carry little advantage
signal) get fewer groups, but every category keeps at least one group per rollout when there are
as many groups as categories, so its r̄ stays current and a relapse is seen. Only training rewards
drive it.

What counts as "far from solved" is `difficulty`: `reward` = 1 − r̄_c as above; `unsolved` = the
exponential average of the fraction of category c's samples scoring below `solved_reward` (default
1, the top score). A partial-credit reward can sit near 1 for a category that still fails often (the
shapes counting prompts: mean reward 0.9 while fewer than 6 in 10 samples are exactly right), and
`unsolved` gives such a category the groups its failures call for.

The prompt within a category is random. Everything is a function of (seed, rollout index, the
sampler's state), and the state is checkpointed, so a resumed run draws the same prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

Mode = Literal["uniform", "adaptive"]
Difficulty = Literal["reward", "unsolved"]


class CategorySampler:
    def __init__(self, prompts_by_category: dict[str, list[str]], *, mode: Mode = "uniform", floor: float = 0.05,
                 smoothing: float = 0.8, seed: int = 0, difficulty: Difficulty = "reward", solved_reward: float = 1.0):
        if mode not in ("uniform", "adaptive"):
            raise ValueError(f"--category-sampling must be 'uniform' or 'adaptive', got {mode!r}")
        if floor <= 0:
            raise ValueError(f"--category-sampling-floor must be > 0, got {floor}")
        if not 0 <= smoothing < 1:
            raise ValueError(f"--category-reward-smoothing must be in [0, 1), got {smoothing}")
        if difficulty not in ("reward", "unsolved"):
            raise ValueError(f"--category-difficulty must be 'reward' or 'unsolved', got {difficulty!r}")
        self.categories = [c for c, prompts in prompts_by_category.items() if prompts]
        self._prompts = {c: list(prompts_by_category[c]) for c in self.categories}
        self.mode, self.floor, self.smoothing, self.seed = mode, floor, smoothing, seed
        self.difficulty, self.solved_reward = difficulty, solved_reward
        self.mean_reward: dict[str, float] = {}  # r̄_c, from the categories seen so far
        self.unsolved: dict[str, float] = {}  # smoothed fraction of samples below solved_reward

    @property
    def _adapting(self) -> bool:
        """Adaptive, and every category has its difficulty (until then, categories take turns; a
        state saved before `unsolved` existed starts over)."""
        seen = self.unsolved if self.difficulty == "unsolved" else self.mean_reward
        return self.mode == "adaptive" and len(seen) == len(self.categories)

    def weights(self) -> dict[str, float]:
        """Each category's share of the groups."""
        if not self._adapting:
            return {c: 1 / len(self.categories) for c in self.categories}
        if self.difficulty == "unsolved":
            raw = {c: self.floor + self.unsolved[c] for c in self.categories}
        else:
            raw = {c: self.floor + max(0.0, 1.0 - self.mean_reward[c]) for c in self.categories}
        total = sum(raw.values())
        return {c: w / total for c, w in raw.items()}

    def draw(self, k: int, batch: int) -> tuple[list[str], list[str]]:
        """Rollout k's `batch` prompts and the category of each."""
        rng = np.random.default_rng([self.seed, k])
        if not self._adapting:
            cats = [self.categories[(k * batch + j) % len(self.categories)] for j in range(batch)]
        else:
            counts = _allocate(list(self.weights().values()), batch)
            cats = [c for c, n in zip(self.categories, counts, strict=True) for _ in range(n)]
            rng.shuffle(cats)  # ranks take contiguous shares: spread the categories over them
        prompts = [self._prompts[c][rng.integers(len(self._prompts[c]))] for c in cats]
        return prompts, cats

    def observe(self, categories: Sequence[str], group_rewards: Sequence[Sequence[float]]) -> dict[str, float]:
        """Fold one rollout's rewards (one sequence of sample rewards per group) into the smoothed
        statistics; returns this rollout's mean reward per category."""
        seen: dict[str, list[float]] = {}
        for c, rs in zip(categories, group_rewards, strict=True):
            seen.setdefault(c, []).extend(float(r) for r in rs)
        means = {c: float(np.mean(rs)) for c, rs in seen.items()}
        for c, rs in seen.items():
            self.mean_reward[c] = self._smoothed(self.mean_reward.get(c), means[c])
            self.unsolved[c] = self._smoothed(self.unsolved.get(c), float(np.mean(np.array(rs) < self.solved_reward)))
        return means

    def _smoothed(self, old: float | None, new: float) -> float:
        return new if old is None else self.smoothing * old + (1 - self.smoothing) * new

    def state_dict(self) -> dict:
        return {"mean_reward": dict(self.mean_reward), "unsolved": dict(self.unsolved)}

    def load_state_dict(self, state: dict) -> None:
        self.mean_reward = {c: float(v) for c, v in state.get("mean_reward", {}).items()}
        self.unsolved = {c: float(v) for c, v in state.get("unsolved", {}).items()}


def _allocate(weights: list[float], total: int) -> list[int]:
    """Integer counts summing to `total`: one each first when `total` allows, the rest proportional
    to `weights` by largest remainder (Hamilton's method, ties by order)."""
    base = 1 if total >= len(weights) else 0
    rest = total - base * len(weights)
    quotas = [w * rest for w in weights]
    counts = [int(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: rest - sum(counts)]:
        counts[i] += 1
    return [base + c for c in counts]
