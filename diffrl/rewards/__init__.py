"""Rewards: a registry of scorers with one signature, `score(images, prompts, metadata) -> list[float]`.

`images` are `[B, C, H, W]` floats in [0, 1]; a scorer may be sync or async. The model rewards and `ocr`
also take videos `[B, C, F, H, W]` and score each as the mean of its frames' scores (`frames.py`);
`temporal_consistency` and `temporal_clip` score how alike a video's consecutive frames are (`temporal.py`).

Model rewards load a local checkpoint, asked for as `NAME@PATH` (never a hub id). Options follow the
path after commas: `NAME@PATH,processor=DIR` takes the processor (tokenizer and image settings) from DIR
instead of PATH, as PickScore's published setup does (model `PickScore_v1`, processor of
`CLIP-ViT-H-14-laion2B-s32B-b79K`). Inside `multi:` an option stays with its reward and the weight goes
last: `multi:pickscore@/m/PickScore_v1,processor=/m/CLIP-ViT-H-14=1,hpsv2@/m/HPS_v2.1_compressed.pt=0.5`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import diffrl.rewards.jpeg  # registers the jpeg rewards
import diffrl.rewards.ocr  # registers `ocr`; its model is imported on first use
import diffrl.rewards.shapes_edit  # registers `shapes_edit` and `shapes_edit_strict` (the editing world)
import diffrl.rewards.tesseract  # registers `tesseract` (the OCR world's judge); imported on first use likewise
import diffrl.rewards.temporal  # noqa: F401  (registers `temporal_consistency`)
from diffrl.data import shapes as shapes_world
from diffrl.data.shapes.grammar import parse_prompt
from diffrl.data.shapes.verify import BACKGROUND_DELTA_E
from diffrl.rewards import colocate, groups, remote, vlm
from diffrl.rewards.frames import mean_over_frames
from diffrl.rewards.registry import _REWARDS, TermScores, register_reward, weighted_sum  # noqa: F401  (re-exported)
from diffrl.utils.device import check_device
from diffrl.utils.images import to_uint8

# Rewards scored by a model from a local checkpoint, asked for as `NAME@PATH[,OPTION=VALUE]`:
# name → factory(path, device, **options) → scorer.
_MODEL_REWARDS: dict[str, str] = {
    "clipscore": "diffrl.rewards.clip_scores:clipscore",
    "pickscore": "diffrl.rewards.clip_scores:pickscore",
    "aesthetic": "diffrl.rewards.clip_scores:aesthetic",
    "hpsv2": "diffrl.rewards.hps:hpsv2",
    "temporal_clip": "diffrl.rewards.temporal:temporal_clip",
}
# Model rewards that read a whole video (frame to frame); the others score frames and take the mean.
_VIDEO_REWARDS = frozenset({"temporal_clip"})
# One line each for `diffrl rewards` (the registered rewards' lines are their docstrings' or below).
_SUMMARIES = {
    "clipscore": "CLIP image–prompt similarity (a local CLIP checkpoint)",
    "pickscore": "PickScore human-preference model (a local PickScore checkpoint; processor=DIR for its CLIP processor)",
    "aesthetic": "LAION aesthetic predictor on CLIP image features (a local checkpoint)",
    "hpsv2": "HPSv2 human-preference score (a local open_clip checkpoint)",
    "temporal_clip": "video: CLIP similarity of consecutive frames (a local CLIP checkpoint)",
    "jpeg_compressibility": "smaller JPEG files score higher (Flow-GRPO's compressibility reward)",
    "jpeg_incompressibility": "larger JPEG files score higher",
    "ocr": "text rendering: how closely OCR of the image matches the prompt's quoted text (PP-OCR, bundled)",
    "tesseract": "the same score read by Tesseract's LSTM OCR (bundled): the ocr reward's independent judge",
    "temporal_consistency": "video: how little consecutive frames differ",
}
CUSTOM_SIGNATURE = "module:function, called as fn(images, prompts, metadata) -> list of floats"


def reward_catalogue() -> str:
    """What `diffrl rewards` prints: every reward with one line, then the spec forms."""
    def line(name: str, fn=None) -> str:
        text = " ".join((getattr(fn, "__doc__", None) or "").split())
        doc = _SUMMARIES.get(name) or (text.split(". ")[0].rstrip(".") if text else "")
        return f"  {name:<24} {doc}"

    out = ["rewards (diffrl train --reward SPEC; diffrl evaluate/compare --reward SPEC):"]
    out += [line(name, fn) for name, fn in sorted(_REWARDS.items())]
    out.append("model rewards, as NAME@PATH (a local checkpoint):")
    out += [line(name) for name in sorted(_MODEL_REWARDS)]
    out.append("from a server: remote@http://HOST:PORT[,timeout=S,retries=N,batch=N,concurrency=N] (Flow-Factory's "
               "reward-server format; examples/reward_server.py serves any of the above)")
    out.append("a VLM judge: vlm@http://HOST:PORT/v1,model=NAME[,question=TEXT] (an OpenAI-compatible API; the score "
               "is P(Yes) of its answer)")
    out.append("group rewards: rank:SPEC (ranks within a prompt's group, in [0, 1]), pairwise:SPEC or pairwise@T:SPEC "
               "(mean Bradley–Terry preference over the group), diverse:SPEC or diverse@W:SPEC (SPEC plus W times "
               "the sample's colour novelty in its group)")
    out.append("combined: multi:NAME=WEIGHT,NAME=WEIGHT (a weighted sum; e.g. multi:ocr=1,jpeg_compressibility=0.5)")
    out.append(f"custom: {CUSTOM_SIGNATURE}")
    return "\n".join(out)
_MODEL_OPTIONS = ("processor",)
_ENTRY_OPTIONS = _MODEL_OPTIONS + remote.OPTIONS + vlm.OPTIONS  # what may follow an entry's comma inside multi:


def get_reward(name: str, device: str | None = None) -> Callable:
    """A registered reward by name, a model reward `NAME@PATH[,processor=DIR]` (a local checkpoint), a
    weighted sum `multi:NAME=W,NAME=W`, or a custom one given as a Python path `module:function`.

    `device` is where model rewards load and score (`cpu`, `cuda`, `cuda:N`); None: CUDA when available,
    else the CPU. The other rewards ignore it."""
    if groups.is_group_reward(name):
        return groups.group_reward(name, get_reward(name.partition(":")[2], device=device))
    if name.startswith("multi:"):
        return multi_reward(_parse_weights(name.removeprefix("multi:")), device=device)
    model, at, path = name.partition("@")
    if model == "vlm":
        url, _, rest = path.partition(",")
        rest, _, question = rest.partition("question=")  # the question takes the rest, commas included
        options = _spec_options(name, filter(None, rest.rstrip(",").split(",")), vlm.OPTIONS,
                                "model=NAME, concurrency=N, timeout=S, sources=yes|no, rubric=edit|image, question=TEXT (last)")
        return vlm.vlm_judge(url, {**options, **({"question": question} if question else {})})
    if model == "remote":
        url, *option_parts = path.split(",")
        if not url:
            raise ValueError("reward remote scores on a server: --reward remote@http://HOST:PORT")
        options = _spec_options(name, option_parts, remote.OPTIONS, ", ".join(f"{o}=N" for o in remote.OPTIONS))
        return remote.remote_reward(url, options)
    if at or model in _MODEL_REWARDS:
        if model not in _MODEL_REWARDS:
            raise ValueError(f"unknown model reward {model!r}; known: {', '.join(sorted(_MODEL_REWARDS))}")
        path, *option_parts = path.split(",")
        if not path:
            raise ValueError(f"reward {model!r} scores with a local checkpoint: --reward {model}@/path/to/checkpoint")
        options = _spec_options(name, option_parts, _MODEL_OPTIONS, ", ".join(f"{o}=DIR" for o in _MODEL_OPTIONS))
        return _model_reward(model, path, None if device is None else str(device), tuple(sorted(options.items())))
    if ":" in name:
        module_name, _, attr = name.partition(":")
        try:
            scorer = getattr(_import_custom(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ValueError(f"custom reward {name!r} cannot be imported: {err}") from None
        _check_callable(name, scorer)
        return scorer
    try:
        return _REWARDS[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; known: {', '.join(sorted(_REWARDS))}; model rewards "
                         f"{', '.join(f'{m}@PATH' for m in sorted(_MODEL_REWARDS))}; remote@URL (a reward server); "
                         "vlm@URL,model=NAME (a VLM judge); rank:SPEC, pairwise:SPEC and diverse:SPEC (group rewards); "
                         "multi:NAME=W,NAME=W; or a "
                         f"custom one as {CUSTOM_SIGNATURE} (`diffrl rewards` lists them)") from None


def _spec_options(name: str, parts, allowed: tuple[str, ...], known: str) -> dict[str, str]:
    """The `KEY=VALUE` options after a reward spec's first comma, each key one of `allowed`; a ValueError naming the
    part and `known` (the allowed forms) for any other."""
    options = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or key.strip() not in allowed or not value:
            raise ValueError(f"reward {name!r}: {part!r} is not an option; known: {known}")
        options[key.strip()] = value
    return options


def _check_callable(name: str, scorer) -> None:
    """A custom reward is called as `fn(images, prompts, metadata)`: one that cannot be (two parameters, not a
    function) is refused when named, before any model loads, not by a TypeError after the first rollout."""
    import inspect

    if not callable(scorer):
        raise ValueError(f"custom reward {name!r} is not a function (a {type(scorer).__name__})")
    try:
        inspect.signature(scorer).bind(None, None, None)
    except TypeError as err:
        raise ValueError(f"custom reward {name!r} is called as fn(images, prompts, metadata): {err}") from None
    except ValueError:
        pass  # no signature to read (a builtin): called as it is


def _import_custom(module_name: str):
    """A custom reward's module, found on sys.path or else in the current directory: `diffrl` is a console
    script, whose sys.path (unlike `python -m`'s) lacks the directory a user runs it from, beside their
    `myreward.py`. The directory goes last, so it shadows no installed module."""
    import importlib
    import os
    import sys

    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        top = module_name.partition(".")[0]
        if err.name != top or os.getcwd() in sys.path or "" in sys.path:
            raise
    sys.path.append(os.getcwd())
    return importlib.import_module(module_name)


def checked_rewards(values, count: int, reward: str, prompts: Sequence[str]) -> list[float]:
    """A scorer's values for `count` images as floats, or a ValueError naming `reward` and what is wrong: another
    number of values, a value that is not a number, or one that is NaN or infinite (whose advantages would skip
    every optimizer step of the run without a word). `prompts`: the images' prompts, to name the one scored."""
    import math

    try:
        values = list(values)
    except TypeError:
        raise ValueError(f"{reward} returned {type(values).__name__}, not one number per image") from None
    if len(values) != count:
        raise ValueError(f"{reward} returned {len(values)} values for {count} images; a reward returns one number "
                         "per image")
    out = []
    for i, value in enumerate(values):
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = None
        if number is None or not math.isfinite(number):
            raise ValueError(f"{reward} returned {value!r} for image {i} (prompt {prompts[i]!r}); a reward must be a "
                             "finite number")
        out.append(number)
    return out


def check_prompts(spec: str, prompts: Sequence[str], source: str) -> None:
    """Refuse, before any model loads or samples, a prompt that a reward of `spec` cannot score, naming
    `source` and the prompt's number; otherwise the run fails when that prompt is first scored, after a
    held-out evaluation or minutes of rollouts. A reward declares what it needs with a `check_prompt(prompt)`
    attribute that raises ValueError (`ocr`: a quoted text); rewards without one are not asked."""
    names = list(_parse_weights(spec.removeprefix("multi:"))) if spec.startswith("multi:") else [spec]
    for name in names:
        # Registered rewards and custom ones; a model reward (NAME@PATH) is not loaded for this.
        scorer = _REWARDS.get(name) or (get_reward(name) if ":" in name and "@" not in name else None)
        check = getattr(scorer, "check_prompt", None)
        if check is None:
            continue
        for number, prompt in enumerate(prompts, start=1):
            try:
                check(prompt)
            except ValueError as err:
                raise ValueError(f"{source}, prompt {number}: {err}") from None


def default_device(device: str | None = None):
    """`device` as a torch.device; None: CUDA when available, else the CPU."""
    import torch

    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"reward device {device!r}: expected cpu, cuda or cuda:N") from None
    check_device(resolved, f"reward device {device!r} (--reward-device)")
    return resolved


@functools.cache
def _model_reward(model: str, path: str, device: str | None = None, options: tuple = ()) -> Callable:
    """Loaded once per process and device (a worker pool builds its own)."""
    import importlib

    module_name, _, attr = _MODEL_REWARDS[model].partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    scorer = factory(path, default_device(device), **dict(options))
    colocate.track(scorer.modules, default_device(device))  # --reward-colocate moves them off the device
    return scorer if model in _VIDEO_REWARDS else mean_over_frames(scorer)


def model_rewards_in(spec: str) -> list[str]:
    """The model rewards a reward spec names (`pickscore@DIR`, or inside `multi:`), by name."""
    entries = _split_multi(spec.removeprefix("multi:")) if spec.startswith("multi:") else [spec]
    return [name for name in (entry.partition("@")[0].strip() for entry in entries) if name in _MODEL_REWARDS]


# The last batch the verifier judged: (images, their version counter, prompts, verdicts). The terms of a `multi:` sum
# (e.g. `shapes` and `white_background`) are called one after another on the same images tensor and verify each
# image once. Holding the tensor keeps its identity from passing to another batch while the entry lives; its version
# counter makes an in-place change of the images miss. One assignment replaces the entry, so threads need no lock.
_last_verdicts: tuple | None = None


def _shapes_verdicts(images, prompts) -> list:
    """The shapes verifier's verdict on each image; the shapes rewards read one field of it."""
    global _last_verdicts
    import torch

    last, cacheable = _last_verdicts, isinstance(images, torch.Tensor)
    if cacheable and last is not None and last[0] is images and last[1:3] == (images._version, tuple(prompts)):
        return last[3]
    verdicts = [shapes_world.verify(image, prompt) for image, prompt in zip(to_uint8(images), prompts, strict=True)]
    if cacheable:
        _last_verdicts = (images, images._version, tuple(prompts), verdicts)
    return verdicts


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


@register_reward("shapes_crisp")
def shapes_crisp_reward(images, prompts, metadata=None) -> list[float]:
    """Partial credit with each passing shape graded by how clearly it beats the second-best template
    (verify.CRISP_LEAD): shapes that barely pass (a lumpy circle near a diamond) keep a signal to sharpen,
    also in groups where every sample passes; and each stray mark charged (verify.MARK_CREDIT), so every
    strict failure costs credit."""
    return [verdict.crisp_score for verdict in _shapes_verdicts(images, prompts)]


@register_reward("shapes_strict")
def shapes_strict_reward(images, prompts, metadata=None) -> list[float]:
    """1 when the verifier passes the image strictly, else 0 (a sharper signal than partial credit)."""
    return [float(verdict.strict) for verdict in _shapes_verdicts(images, prompts)]


@register_reward("white_background")
def white_background_reward(images, prompts, metadata=None) -> list[float]:
    """1 for a pure white background, falling linearly to 0 at a mean tint of the verifier's ink threshold
    (`Verdict.background_delta_e` / BACKGROUND_DELTA_E): a term to weigh into a `multi:` sum with a shapes reward,
    none of which charges a tint too faint to be ink (DiffusionNFT drifts there: docs/results.md). Alone it is
    maximal for a blank image."""
    return [max(0.0, 1.0 - verdict.background_delta_e / BACKGROUND_DELTA_E) for verdict in _shapes_verdicts(images, prompts)]


def _shapes_prompt(prompt: str) -> None:
    """A prompt set is checked up front (`check_prompts`): the shapes verifier scores only the shapes world's
    prompts. It is the reward a run gets without --reward, so another prompt set failed at its first scoring,
    after the model loaded and a rollout was sampled."""
    try:
        parse_prompt(prompt)
    except ValueError as err:
        raise ValueError(f"{err}; the shapes rewards score only the shapes world's prompts (pass --reward for this "
                         "prompt set)") from None


for _shapes in (shapes_reward, shapes_balanced_reward, shapes_exact_count_reward, shapes_crisp_reward,
                shapes_strict_reward, white_background_reward):
    _shapes.check_prompt = _shapes_prompt
# The rewards the shapes verifier scores text-to-image shapes prompts with, by name: `--world shapes-edit` (whose
# prompts are edits) refuses them (`TaskConfig.check` reads this where it runs; the config tree imports no torch).
SHAPES_TEXT_TO_IMAGE_REWARDS = frozenset(name for name, fn in _REWARDS.items()
                                         if getattr(fn, "check_prompt", None) is _shapes_prompt)


def _split_multi(spec: str) -> list[str]:
    """The entries of a `multi:` spec: commas separate entries, except before a model reward's option."""
    entries: list[str] = []
    for piece in spec.split(","):
        if entries and "@" in entries[-1] and piece.partition("=")[0].strip() in _ENTRY_OPTIONS:
            entries[-1] += "," + piece
        else:
            entries.append(piece)
    return entries


def _parse_weights(spec: str) -> dict[str, float]:
    weights = {}
    for part in filter(None, _split_multi(spec)):
        reward, sep, weight = part.rpartition("=")
        # `…,processor=DIR` without a weight: that `=` belongs to the option.
        if not sep or reward.rpartition(",")[2].strip() in _ENTRY_OPTIONS:
            reward, sep, weight = part, "", ""
        if reward.strip() in weights:  # a dict keeps the last weight only
            raise ValueError(f"reward multi:{spec}: {reward.strip()!r} is named twice; give it one weight")
        try:
            weights[reward.strip()] = float(weight) if sep else 1.0
        except ValueError:
            raise ValueError(f"reward multi:{spec}: weight {weight!r} of {reward!r} is not a number") from None
    if not weights:
        raise ValueError("reward multi: needs at least one NAME=WEIGHT")
    return weights


def multi_weights(spec: str) -> dict[str, float]:
    """The terms of a `multi:NAME=W,…` spec and their weights, by name."""
    return _parse_weights(spec.removeprefix("multi:"))


def multi_reward(weights: dict[str, float], device: str | None = None) -> Callable:
    """Σ w·reward; each part may be sync or async (the sum is async, the rollout manager awaits it)."""
    return weighted_sum([(get_reward(name, device=device), w) for name, w in weights.items()], names=list(weights))
