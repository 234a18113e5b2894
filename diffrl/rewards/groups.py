"""Group rewards: a sample's score depends on the other samples of its prompt.

- `rank:SPEC`: the reward SPEC's values ranked within each prompt's group and mapped to [0, 1] (the worst 0, the
  best 1, ties sharing their mean rank; a group of one scores 0.5). Only the order counts, so a reward whose scale
  drifts or saturates keeps giving a signal.
- `pairwise:SPEC` (`pairwise@T:SPEC` for a temperature T, default 1): a preference reward made from a pointwise one.
  Each pair of a group is judged by the Bradley–Terry probability `σ((s_i − s_j) / T)` that sample i is preferred
  to j, and a sample scores its mean preference over the others (0.5 alone, or when all are equal).
- `diverse@W:SPEC` (`diverse:SPEC`: W = 4, the weight that held the OCR world's palette on the CPU where 0.25 and 1
  did not, docs/ocr-world.md): SPEC's value plus W times the sample's colour novelty in its group,
  against the collapse of every image onto one palette that a reward blind to colour lets RL make (the OCR world's
  runs: light text on saturated magenta for every prompt). Novelty is the mean, over the group's other samples, of
  the angle between the two images' average hues (CIELAB a*b*, `utils/colour.py`) over π, each pair weighted by
  how coloured both are (`c / (c + 5)` of each chroma c), so a grey image's ill-defined hue earns little: 0 when
  the whole group shares one hue, up to about 1 for one sample opposite the others.

A group is every sample of one prompt that the reward is given at once: in a rollout, the trainer scores a prompt's
whole group when its last microgroup lands (`scores_groups`), so scoring still overlaps the other groups'
generation. Advantages stay per prompt. SPEC is any other reward spec (`multi:` included; its terms are not passed
on).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable

import numpy as np

from diffrl.utils.colour import mean_ab

PREFIXES = ("rank:", "pairwise:", "pairwise@", "diverse:", "diverse@")
DIVERSE_WEIGHT = 4.0
_CHROMA_HALF = 5.0  # the chroma (a*b* units) at which an image's hue counts half in `colour_novelty`


def is_group_reward(spec: str) -> bool:
    return spec.startswith(PREFIXES)


def pointwise_spec(spec: str) -> str:
    """The pointwise reward a group reward wraps (`rank:ocr` → `ocr`), or `spec` itself. What a held-out evaluation
    scores: ranks or novelty among one model's own seeds say nothing of its quality."""
    while is_group_reward(spec):
        spec = spec.partition(":")[2]
    return spec


def colour_novelty(ab: np.ndarray) -> list[float]:
    """Each image's mean chroma-weighted hue distance to the others (`diverse@`), from their average a*b* `[N, 2]`;
    0 alone."""
    n = len(ab)
    if n == 1:
        return [0.0]
    hue = np.arctan2(ab[:, 1], ab[:, 0])
    chroma = np.hypot(ab[:, 0], ab[:, 1])
    colourful = chroma / (chroma + _CHROMA_HALF)
    apart = np.abs(np.angle(np.exp(1j * (hue[:, None] - hue[None, :])))) / np.pi  # [N, N] in [0, 1]
    weighted = apart * colourful[:, None] * colourful[None, :]
    return [float(v) for v in weighted.sum(axis=1) / (n - 1)]


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


def _parameter(spec: str, kind: str, what: str, letter: str, default: float) -> float:
    """The number after `@` in a group reward's prefix (`pairwise@2:…`), or `default` without one; `what` and
    `letter` name it in errors (`the temperature in pairwise@T:`)."""
    if "@" not in kind:
        return default
    prefix, _, number = kind.partition("@")
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"reward {spec!r}: the {what} in {prefix}@{letter}: is a number") from None
    if not value > 0:
        raise ValueError(f"reward {spec!r}: the {what} in {prefix}@{letter}: must be > 0")
    return value


def group_reward(spec: str, inner: Callable) -> Callable:
    """The group reward of `spec` (`rank:…`, `pairwise[@T]:…`, `diverse[@W]:…`) over the pointwise reward `inner`."""
    kind, _, _ = spec.partition(":")
    if kind.startswith("pairwise"):
        temperature = _parameter(spec, kind, "temperature", "T", 1.0)
        transform = lambda values, images: mean_preference(values, temperature)  # noqa: E731
    elif kind.startswith("diverse"):
        weight = _parameter(spec, kind, "weight", "W", DIVERSE_WEIGHT)
        transform = lambda values, images: [v + weight * n for v, n in  # noqa: E731
                                            zip(values, colour_novelty(mean_ab(images)), strict=True)]
    else:
        transform = lambda values, images: ranks01(values)  # noqa: E731

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
            scored = transform([values[i] for i in members], [images[i] for i in members])
            for i, value in zip(members, scored, strict=True):
                out[i] = value
        return out

    score.scores_groups = True
    return score
