"""Prompt grammar of the "shapes" world: a GenEval-like set of prompts whose scenes can be
rendered and verified exactly.

Every prompt belongs to one of six categories (`CATEGORIES`); `format_prompt` turns a
`SceneSpec` into its prompt and `parse_prompt` is its exact inverse. The train/test split
is fixed (sha256 of the prompt), so it is identical across processes and machines.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")

# Saturated colors whose hues (around the grey axis) are >= 26 degrees apart, so that a blend
# with the white background or a darker shade keeps its color (the verifier classifies by hue).
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 40),
    "green": (25, 160, 55),
    "blue": (30, 70, 225),
    "yellow": (255, 225, 0),
    "purple": (135, 35, 175),
    "orange": (245, 115, 0),
}
BACKGROUND: tuple[int, int, int] = (255, 255, 255)

NUMBERS: dict[str, int] = {"two": 2, "three": 3, "four": 4}
# relation key -> the words between the two noun phrases of a position prompt
RELATIONS: dict[str, str] = {
    "left": "to the left of",
    "right": "to the right of",
    "above": "above",
    "below": "below",
}

CATEGORIES: tuple[str, ...] = (
    "single_object",
    "two_object",
    "counting",
    "colors",
    "position",
    "color_attr",
)

TEST_FRACTION = 0.2
MAX_TEST_PER_CATEGORY = 16


@dataclass(frozen=True)
class ObjectSpec:
    shape: str
    color: str | None  # None: any palette color


@dataclass(frozen=True)
class SceneSpec:
    category: str
    prompt: str
    objects: tuple[ObjectSpec, ...]
    relation: str | None = None  # position only: where objects[0] is relative to objects[1]


# --------------------------------------------------------------------------- generation


def noun_phrase(obj: ObjectSpec) -> str:
    """'a red circle' / 'a circle'."""
    return f"a {obj.color} {obj.shape}" if obj.color else f"a {obj.shape}"


def format_prompt(category: str, objects: tuple[ObjectSpec, ...], relation: str | None = None) -> str:
    if category == "counting":
        number = next(word for word, n in NUMBERS.items() if n == len(objects))
        return f"{number} {objects[0].shape}s"
    if category == "position":
        return f"{noun_phrase(objects[0])} {RELATIONS[relation]} {noun_phrase(objects[1])}"
    return " and ".join(noun_phrase(obj) for obj in objects)


def _scene(category: str, objects: tuple[ObjectSpec, ...], relation: str | None = None) -> SceneSpec:
    return SceneSpec(category, format_prompt(category, objects, relation), objects, relation)


def _all_scenes(category: str) -> list[SceneSpec]:
    colored = [ObjectSpec(s, c) for c in COLORS for s in SHAPES]
    plain = [ObjectSpec(s, None) for s in SHAPES]
    if category == "single_object":
        return [_scene(category, (o,)) for o in plain]
    if category == "two_object":
        return [_scene(category, (a, b)) for a, b in itertools.permutations(plain, 2) if a.shape != b.shape]
    if category == "counting":
        return [_scene(category, (o,) * n) for n in NUMBERS.values() for o in plain]
    if category == "colors":
        return [_scene(category, (o,)) for o in colored]
    if category == "position":
        return [
            _scene(category, (a, b), rel)
            for a, b in itertools.permutations(colored, 2)
            if a.color != b.color
            for rel in RELATIONS
        ]
    if category == "color_attr":
        return [
            _scene(category, (a, b))
            for a, b in itertools.permutations(colored, 2)
            if a.color != b.color and a.shape != b.shape
        ]
    raise ValueError(f"unknown category {category!r}; expected one of {CATEGORIES}")


def all_prompts(category: str) -> list[str]:
    """Every prompt of `category`, in a fixed order."""
    return [scene.prompt for scene in _all_scenes(category)]


# --------------------------------------------------------------------------- parsing


def parse_object_phrase(words: list[str], i: int, fail: Callable[[str], NoReturn], article: str = "a",
                        hint: str = "") -> tuple[ObjectSpec, int]:
    """Parse '<article> [color] shape' starting at words[i] ('a …' in prompts, 'the …' in edit instructions); return
    the object and the next index. `hint` follows the message when the article is missing."""
    if i >= len(words):
        fail("missing object at the end")
    if words[i] != article:
        fail(f"expected {article!r} at word {i + 1}, got {words[i]!r}{hint}")
    rest = words[i + 1 : i + 3]
    if rest and rest[0] in SHAPES:
        return ObjectSpec(rest[0], None), i + 2
    if rest and rest[0] in COLORS:
        if len(rest) < 2 or rest[1] not in SHAPES:
            fail(f"unknown shape {rest[1]!r}" if len(rest) == 2 else "missing shape")
        return ObjectSpec(rest[1], rest[0]), i + 3
    if len(rest) == 2 and rest[1] in SHAPES:
        fail(f"unknown color {rest[0]!r}")
    fail(f"unknown shape {rest[0]!r}" if rest else "missing shape")


def _parse_connective(words: list[str], i: int, fail: Callable[[str], NoReturn]) -> tuple[str | None, int]:
    """'and' (relation None) or a relation phrase at words[i]; return it and the next index."""
    if words[i] == "and":
        return None, i + 1
    for relation, phrase in RELATIONS.items():
        phrase_words = phrase.split()
        if words[i : i + len(phrase_words)] == phrase_words:
            return relation, i + len(phrase_words)
    fail(f"unknown connective {' '.join(words[i : i + 4])!r} (expected 'and' or a relation)")


def parse_prompt(prompt: str) -> SceneSpec:
    """Inverse of the prompt generator (case and extra spaces are tolerated; the returned
    spec holds the canonical prompt). Raises ValueError naming what is wrong."""

    def fail(problem: str) -> NoReturn:
        raise ValueError(f"cannot parse prompt {prompt!r}: {problem}")

    words = prompt.strip().lower().split()
    if not words:
        fail("empty prompt")

    if words[0] in NUMBERS:
        if len(words) != 2:
            fail("counting prompts have the form '<number> <shape>s'")
        if not words[1].endswith("s") or words[1][:-1] not in SHAPES:
            fail(f"unknown plural shape {words[1]!r}")
        return _scene("counting", (ObjectSpec(words[1][:-1], None),) * NUMBERS[words[0]])
    if words[0] != "a":
        fail(f"unknown word {words[0]!r} (prompts start with 'a' or one of {list(NUMBERS)})")

    first, i = parse_object_phrase(words, 0, fail)
    if i == len(words):
        return _scene("colors" if first.color else "single_object", (first,))

    relation, i = _parse_connective(words, i, fail)
    second, i = parse_object_phrase(words, i, fail)
    if i != len(words):
        fail(f"unexpected trailing words {' '.join(words[i:])!r}")

    if (first.color is None) != (second.color is None):
        fail("either both objects or neither must have a color")
    if relation is not None:
        if first.color is None:
            fail("position prompts need a color on both objects")
        if first.color == second.color:
            fail("position prompts need two different colors")
        return _scene("position", (first, second), relation)
    if first.shape == second.shape:
        fail("'and' prompts need two different shapes")
    if first.color is None:
        return _scene("two_object", (first, second))
    if first.color == second.color:
        fail("color_attr prompts need two different colors")
    return _scene("color_attr", (first, second))


def category_of(prompt: str) -> str:
    return parse_prompt(prompt).category


# --------------------------------------------------------------------------- splits


def _prompt_hash(prompt: str) -> str:
    return hashlib.sha256(prompt.encode("utf-8")).hexdigest()


def _n_test(n_prompts: int) -> int:
    return min(MAX_TEST_PER_CATEGORY, max(1, round(TEST_FRACTION * n_prompts)))


def prompts_by_category(split: str) -> dict[str, list[str]]:
    """{category: prompts} for split 'train', 'test' or 'all'.

    Test prompts are the ones with the smallest sha256 hash, so the split does not depend
    on Python's hash seed or on the order prompts are generated in.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'test' or 'all'")
    result = {}
    for category in CATEGORIES:
        prompts = all_prompts(category)
        if split == "all":
            result[category] = prompts
            continue
        test = sorted(prompts, key=_prompt_hash)[: _n_test(len(prompts))]
        if split == "test":
            result[category] = test
        else:
            test_set = set(test)
            result[category] = [p for p in prompts if p not in test_set]
    return result


def test_prompts() -> list[str]:
    """Test prompts, round-robin over categories so any prefix of >= 6 covers them all."""
    per_category = list(prompts_by_category("test").values())
    return [prompt for group in itertools.zip_longest(*per_category) for prompt in group if prompt is not None]


# The name starts with "test": keep pytest from collecting it when a test module imports it.
test_prompts.__test__ = False


def train_prompts() -> list[str]:
    return [p for prompts in prompts_by_category("train").values() for p in prompts]
