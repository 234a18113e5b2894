"""Rewards: a registry of scorers with one signature, `score(images, prompts, metadata) -> list[float]`.

`images` are `[B, C, H, W]` floats in [0, 1]; a scorer may be sync or async.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

_REWARDS: dict[str, Callable] = {}


def register_reward(name: str):
    def decorator(fn: Callable) -> Callable:
        if name in _REWARDS:
            raise ValueError(f"reward {name!r} is registered twice")
        _REWARDS[name] = fn
        return fn
    return decorator


# Rewards scored by a model from a local checkpoint, asked for as `NAME@PATH`: name → factory(path) → scorer.
_MODEL_REWARDS: dict[str, str] = {
    "clipscore": "diffrl.rewards.clip_scores:clipscore",
    "pickscore": "diffrl.rewards.clip_scores:pickscore",
    "aesthetic": "diffrl.rewards.clip_scores:aesthetic",
}


def get_reward(name: str) -> Callable:
    """A registered reward by name, a model reward `NAME@PATH` (a local checkpoint), a weighted sum
    `multi:NAME=W,NAME=W`, or a custom one given as a Python path `module:function`."""
    if name.startswith("multi:"):
        return multi_reward(_parse_weights(name.removeprefix("multi:")))
    model, at, path = name.partition("@")
    if at or model in _MODEL_REWARDS:
        if model not in _MODEL_REWARDS:
            raise ValueError(f"unknown model reward {model!r}; known: {', '.join(sorted(_MODEL_REWARDS))}")
        if not path:
            raise ValueError(f"reward {model!r} scores with a local checkpoint: --reward {model}@/path/to/checkpoint")
        return _model_reward(model, path)
    if ":" in name:
        import importlib

        module_name, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"custom reward {name!r} cannot be imported: {err}") from None
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(sorted(_REWARDS))} "
                         "(or a custom one as module:function)") from None


@functools.cache
def _model_reward(model: str, path: str) -> Callable:
    """Loaded once per process (a worker pool builds its own)."""
    import importlib

    module_name, _, attr = _MODEL_REWARDS[model].partition(":")
    return getattr(importlib.import_module(module_name), attr)(path)


def _shapes_verdicts(images, prompts) -> list:
    """The shapes verifier's verdict on each image; the shapes rewards read one field of it."""
    from diffrl.data.shapes import verify
    from diffrl.utils.images import to_uint8

    return [verify(image, prompt) for image, prompt in zip(to_uint8(images), prompts, strict=True)]


@register_reward("shapes")
def shapes_reward(images, prompts, metadata=None) -> list[float]:
    """Partial credit of the shapes verifier (strict pass/fail is for evaluation)."""
    return [verdict.score for verdict in _shapes_verdicts(images, prompts)]


@register_reward("shapes_balanced")
def shapes_balanced_reward(images, prompts, metadata=None) -> list[float]:
    """Partial credit with count, shape, color and relation weighed alike (a wrong count costs half
    of a counting prompt's credit instead of one part in four or five)."""
    return [verdict.balanced_score for verdict in _shapes_verdicts(images, prompts)]


@register_reward("shapes_exact_count")
def shapes_exact_count_reward(images, prompts, metadata=None) -> list[float]:
    """Half for the exact number of objects, half for shapes, colors and relation: under partial
    credit an extra object costs less than one misshapen object, which rewards hedging with extras."""
    return [verdict.exact_count_score for verdict in _shapes_verdicts(images, prompts)]


@register_reward("shapes_strict")
def shapes_strict_reward(images, prompts, metadata=None) -> list[float]:
    """1 when the verifier passes the image strictly, else 0 (a sharper signal than partial credit)."""
    return [float(verdict.strict) for verdict in _shapes_verdicts(images, prompts)]


def _parse_weights(spec: str) -> dict[str, float]:
    weights = {}
    for part in filter(None, spec.split(",")):
        reward, sep, weight = part.partition("=")
        try:
            weights[reward.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"reward multi:{spec}: weight {weight!r} of {reward!r} is not a number") from None
    if not weights:
        raise ValueError("reward multi: needs at least one NAME=WEIGHT")
    return weights


def multi_reward(weights: dict[str, float]) -> Callable:
    """Σ w·reward; each part may be sync or async (the sum is async, the rollout manager awaits it)."""
    import inspect

    parts = [(get_reward(name), w) for name, w in weights.items()]

    async def score(images, prompts, metadata=None) -> list[float]:
        total = [0.0] * len(prompts)
        for fn, w in parts:
            values = fn(images, prompts, metadata)
            if inspect.isawaitable(values):
                values = await values
            total = [t + w * float(v) for t, v in zip(total, values, strict=True)]
        return total

    return score


import diffrl.rewards.jpeg  # noqa: E402, F401  (registers the jpeg rewards)
import diffrl.rewards.ocr  # noqa: E402, F401  (registers `ocr`; its model is imported on first use)
