"""The table of named rewards and how rewards are summed: what every reward module needs, below them all.

A reward module registers its scorers here (`register_reward`); `diffrl.rewards` imports the built-in modules
and looks names up. `weighted_sum` is the `multi:` sum, kept here because `frames.on_frames` takes sums apart.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

_REWARDS: dict[str, Callable] = {}


def register_reward(name: str):
    def decorator(fn: Callable) -> Callable:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        _REWARDS[name] = fn
        return fn
    return decorator


class TermScores(list):
    """A `multi:` reward's values: the weighted sum per image (the list itself) and each term's own, unweighted
    values (`terms`: name → one value per image), which GDPO's per-reward normalization reads."""

    def __init__(self, total, terms: dict[str, list[float]]):
        super().__init__(total)
        self.terms = terms


def weighted_sum(parts: list[tuple[Callable, float]], names: list[str] | None = None) -> Callable:
    """Σ w·fn over (fn, w) parts; the parts stay readable (`weighted_parts`, `part_names`) for `frames.on_frames`.
    With `names` the sum comes back as `TermScores`, each part's own values by its name."""
    async def score(images, prompts, metadata=None) -> list[float]:
        total = [0.0] * len(prompts)
        terms = {}
        for i, (fn, w) in enumerate(parts):
            values = fn(images, prompts, metadata)
            if inspect.isawaitable(values):
                values = await values
            values = [float(v) for v in values]
            total = [t + w * v for t, v in zip(total, values, strict=True)]
            if names is not None:
                terms[names[i]] = values
        return total if names is None else TermScores(total, terms)

    score.weighted_parts = parts
    score.part_names = names
    return score
