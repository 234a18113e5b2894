"""Editing world of the "shapes" world: a rendered source scene, an instruction that changes one thing
in it, the ground-truth result, and an exact judge of any output image.

Instructions come in four kinds (`EDIT_KINDS`), over the shapes and colors of the text-to-image world:

- recolor: "make the square green", "make the blue square green"
- move: "move the circle to the left of the triangle" (to the right of / above / below, as in `RELATIONS`)
- remove: "remove the blue diamond"
- add: "add a red circle" (the new object needs a color; it goes anywhere free)

An object is referred to as "the [color] shape": the shape alone is enough when the scene holds one object of
that shape. `parse_edit` checks the syntax and, given a scene, that every reference names exactly one object and
that the edit changes something; it raises ValueError naming what is wrong.

The split is fixed like the prompts' (sha256 of the instruction, `grammar.prompts_by_category`): its unit is
the instruction with every object named by color and shape (`all_edits`), whatever shorter form an example
shows the model. `make_example(instruction, seed)` draws a source scene for an instruction and applies it;
`sample_example(seed, split)` also draws the instruction. Every object other than the edited one keeps its
position, size and color in the target, so the target image differs from the source only where the edit is.

`verify_edit(source_image, output_image, instruction)` detects the objects of both images with the
text-to-image verifier's detector and judges (a) the edit: done to the object named, and (b) preservation:
every other object of the source still there, of the same shape, color, position (within
`POSITION_TOLERANCE_PX`) and size (`SIZE_TOLERANCE`), no extra object, no stray ink, and the background's tint
within `BACKGROUND_SHIFT_DELTA_E` of the source's. Strict pass is both; the score is the mean of the edit term
(0 or 1) and the preservation term (partial credit); the reason names the first failure.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NoReturn

import numpy as np

from .grammar import COLORS, RELATIONS, SHAPES, ObjectSpec, _n_test, _prompt_hash, parse_object_phrase
from .render import BORDER_PX, GAP_PX, SUPERSAMPLE, PlacedObject, _centroid_y, _relation_ok, draw_objects, side_range
from .verify import (
    STRAY_LIMIT,
    STRAY_ZERO_CREDIT,
    DetectedObject,
    _analyze,
    _as_uint8_hwc,
    _relation_holds,
    _shape_ok,
    _stray_failure,
)

EDIT_KINDS: tuple[str, ...] = ("recolor", "move", "remove", "add")
VERBS: dict[str, str] = {"make": "recolor", "move": "move", "remove": "remove", "add": "add"}

# Objects in a drawn source scene, inclusive, per kind. A move needs the object and its reference; a removal
# leaves at least one object (so that a blank output is never right); an addition leaves at most four.
SOURCE_OBJECTS: dict[str, tuple[int, int]] = {"recolor": (1, 3), "move": (2, 3), "remove": (2, 4), "add": (1, 3)}
# A drawn move starts with the relation clearly false: at least this far (pixels at 64x64) from the
# verifier's rule holding, so that an output left unchanged never passes.
MOVE_SLACK_PX = 2.0
# Probability that a drawn example names an object by its shape alone where that shape is unique in the scene.
SHAPE_ONLY_PROBABILITY = 0.5

# ---- the judge (pixels at 64x64, scaled with the image)
# A kept object may shift this far (its detected centroid) and still be in place. Renders of the same object
# in the source and the target agree to < 0.4 px; the renderer leaves >= 3 px between objects, and the smallest
# object is 11 px wide, so a shift by 3 px moves its edge by over a quarter of its side: visible side by side.
POSITION_TOLERANCE_PX = 3.0
# A kept (or moved, or recolored) object's linear size, the root of its detected area, may change by this
# factor either way. Recoloring changes it by up to 9% (in 600 examples: the soft edge classifies differently
# with the hue); a judge sees a change of 25%.
SIZE_TOLERANCE = 1.2
# Matching an output object to one of the source's weighs nearness (1 at its place, 0 from this distance)
# beside agreement in shape and color.
MATCH_RADIUS_PX = 12.0
# The background's mean tint (ΔE76 from white, `Verdict.background_delta_e`) may move this far from the
# source's: the least difference a person sees side by side. Credit fades to 0 at BACKGROUND_ZERO_DELTA_E
# (the verifier's threshold of ink).
BACKGROUND_SHIFT_DELTA_E = 2.0
BACKGROUND_ZERO_DELTA_E = 5.0

_CANDIDATES = 64  # positions tried at once
_PLACE_TRIES = 50  # rounds of candidates for one object before the scene is drawn again
_MAX_RESTARTS = 1000


# --------------------------------------------------------------------------- instructions


def _the(obj: ObjectSpec) -> str:
    return f"the {obj.color} {obj.shape}" if obj.color else f"the {obj.shape}"


def format_edit(kind: str, target: ObjectSpec, color: str | None = None, relation: str | None = None,
                reference: ObjectSpec | None = None) -> str:
    """The instruction of an edit, e.g. format_edit("recolor", ObjectSpec("square", None), "green")."""
    if kind == "recolor":
        return f"make {_the(target)} {color}"
    if kind == "move":
        return f"move {_the(target)} {RELATIONS[relation]} {_the(reference)}"
    if kind == "remove":
        return f"remove {_the(target)}"
    if kind == "add":
        return f"add a {target.color} {target.shape}"
    raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")


@dataclass(frozen=True)
class Edit:
    kind: str  # one of EDIT_KINDS
    instruction: str  # canonical text (references as written)
    # recolor / move / remove: the object referred to (color None: named by its shape alone); add: the new object
    target: ObjectSpec
    color: str | None = None  # recolor: the new color
    relation: str | None = None  # move: where the target goes relative to `reference`
    reference: ObjectSpec | None = None  # move: the object it goes next to

    @property
    def fully_named(self) -> bool:
        """Every object is named by color and shape (the form the split is made of)."""
        return self.target.color is not None and (self.reference is None or self.reference.color is not None)

    def resolve(self, objects: Sequence) -> tuple[int | None, int | None]:
        """Indices of the target and the reference among `objects` (anything with shape, color and
        centroid_xy: placed or detected objects); None where the edit has none (an addition's target, the
        reference but of a move). Raises ValueError when a reference names no object or several, or the edit
        would change nothing."""

        def fail(problem: str) -> NoReturn:
            raise ValueError(f"cannot apply {self.instruction!r} to the scene: {problem}")

        if self.kind == "add":
            return None, None
        target = _find(self.target, objects, fail)
        if self.kind == "recolor" and objects[target].color == self.color:
            fail(f"{_the(self.target)} is already {self.color}")
        if self.kind != "move":
            return target, None
        reference = _find(self.reference, objects, fail)
        if reference == target:
            fail(f"{_the(self.target)} and {_the(self.reference)} are the same object")
        if _relation_holds(self.relation, objects[target], objects[reference]):
            fail(f"{_the(self.target)} is already {RELATIONS[self.relation]} {_the(self.reference)}: nothing to move")
        return target, reference

    def fully_named_in(self, objects: Sequence) -> Edit:
        """This edit with every object it refers to named by color and shape (as resolved in `objects`)."""
        target, reference = self.resolve(objects)
        if self.kind == "add":
            return self
        named = replace(self.target, color=objects[target].color)
        ref = replace(self.reference, color=objects[reference].color) if reference is not None else None
        return Edit(self.kind, format_edit(self.kind, named, self.color, self.relation, ref), named, self.color,
                    self.relation, ref)


def _describe(objects: Sequence) -> str:
    return ", ".join(f"a {obj.color} {obj.shape}" for obj in objects) or "nothing"


def _find(ref: ObjectSpec, objects: Sequence, fail: Callable[[str], NoReturn]) -> int:
    matches = [k for k, obj in enumerate(objects) if obj.shape == ref.shape and ref.color in (None, obj.color)]
    if not matches:
        fail(f"the scene holds no {(ref.color + ' ') if ref.color else ''}{ref.shape} (it holds {_describe(objects)})")
    if len(matches) > 1:
        which = _describe([objects[k] for k in matches])
        if ref.color is None:
            fail(f"{_the(ref)!r} is ambiguous: the scene holds {len(matches)} {ref.shape}s ({which}); name its color")
        fail(f"{_the(ref)!r} is ambiguous: the scene holds {len(matches)} {ref.color} {ref.shape}s")
    return matches[0]


def _parse_reference(words: list[str], i: int, fail: Callable[[str], NoReturn]) -> tuple[ObjectSpec, int]:
    """Parse 'the [color] shape' at words[i]; return the object and the next index."""
    return parse_object_phrase(words, i, fail, article="the",
                               hint=" (objects are referred to as 'the [color] shape')")


def _parse_relation(words: list[str], i: int, fail: Callable[[str], NoReturn]) -> tuple[str, int]:
    for relation, phrase in RELATIONS.items():
        phrase_words = phrase.split()
        if words[i : i + len(phrase_words)] == phrase_words:
            return relation, i + len(phrase_words)
    found = " ".join(words[i : i + 4]) or "nothing"
    fail(f"unknown relation {found!r} (expected one of {', '.join(repr(p) for p in RELATIONS.values())})")


def parse_edit(instruction: str, scene: Sequence | None = None) -> Edit:
    """Parse an edit instruction (case and extra spaces are tolerated; the returned edit holds the canonical
    text). With `scene` (placed or detected objects), also check that it applies there (`Edit.resolve`).
    Raises ValueError naming what is wrong."""

    def fail(problem: str) -> NoReturn:
        raise ValueError(f"cannot parse edit instruction {instruction!r}: {problem}")

    words = instruction.strip().lower().split()
    if not words:
        fail("empty instruction")
    kind = VERBS.get(words[0])
    if kind is None:
        fail(f"unknown verb {words[0]!r} (instructions start with one of {', '.join(VERBS)})")
    color = relation = reference = None
    if kind == "add":
        if len(words) < 2 or words[1] not in ("a", "an"):
            fail("expected 'add a <color> <shape>'")
        rest = words[2:4]
        if rest and rest[0] in SHAPES:
            fail(f"the new {rest[0]} needs a color ('add a red {rest[0]}')")
        if not rest or rest[0] not in COLORS:
            fail(f"unknown color {rest[0]!r}" if rest else "missing color and shape")
        if len(rest) < 2 or rest[1] not in SHAPES:
            fail(f"unknown shape {rest[1]!r}" if len(rest) == 2 else "missing shape")
        target, i = ObjectSpec(rest[1], rest[0]), 4
    else:
        target, i = _parse_reference(words, 1, fail)
        if kind == "recolor":
            if i >= len(words):
                fail(f"missing the new color ('make {_the(target)} green')")
            if words[i] not in COLORS:
                fail(f"unknown color {words[i]!r}")
            color, i = words[i], i + 1
            if target.color == color:
                fail(f"{_the(target)} is already {color}")
        elif kind == "move":
            if i >= len(words):
                fail("missing where to move it (e.g. 'to the left of the triangle')")
            relation, i = _parse_relation(words, i, fail)
            reference, i = _parse_reference(words, i, fail)
            if reference == target:
                fail(f"cannot move {_the(target)} relative to itself")
    if i != len(words):
        fail(f"unexpected trailing words {' '.join(words[i:])!r}")
    edit = Edit(kind, format_edit(kind, target, color, relation, reference), target, color, relation, reference)
    if scene is not None:
        edit.resolve(scene)
    return edit


# --------------------------------------------------------------------------- splits


def all_edits(kind: str) -> list[str]:
    """Every instruction of `kind` with each object named by color and shape, in a fixed order."""
    objects = [ObjectSpec(shape, color) for color in COLORS for shape in SHAPES]
    if kind == "recolor":
        return [format_edit(kind, obj, color) for obj in objects for color in COLORS if color != obj.color]
    if kind == "move":
        return [format_edit(kind, a, relation=relation, reference=b)
                for a, b in itertools.permutations(objects, 2) for relation in RELATIONS]
    if kind in ("remove", "add"):
        return [format_edit(kind, obj) for obj in objects]
    raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")


def edits_by_kind(split: str) -> dict[str, list[str]]:
    """{kind: instructions} for split 'train', 'test' or 'all': per kind, the test split is the instructions
    of smallest sha256, as many as for prompts (`grammar.prompts_by_category`: 20%, at most 16)."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'test' or 'all'")
    return {kind: list(instructions) for kind, instructions in _split(split).items()}


@functools.lru_cache(maxsize=3)
def _split(split: str) -> dict[str, tuple[str, ...]]:
    result = {}
    for kind in EDIT_KINDS:
        instructions = all_edits(kind)
        if split == "all":
            result[kind] = tuple(instructions)
            continue
        test = sorted(instructions, key=_prompt_hash)[: _n_test(len(instructions))]
        test_set = set(test)
        result[kind] = tuple(test if split == "test" else [e for e in instructions if e not in test_set])
    return result


def test_edits() -> list[str]:
    """Held-out instructions, round-robin over kinds so any prefix of >= 4 covers them all."""
    per_kind = list(edits_by_kind("test").values())
    return [e for group in itertools.zip_longest(*per_kind) for e in group if e is not None]


test_edits.__test__ = False  # not a test, though its name starts with "test"


def train_edits() -> list[str]:
    return [e for instructions in edits_by_kind("train").values() for e in instructions]



# --------------------------------------------------------------------------- examples


@dataclass(frozen=True)
class EditExample:
    instruction: str  # as shown to the model (an object may be named by its shape alone)
    canonical: str  # every object named by color and shape: the unit of the train/test split
    edit: Edit  # the parsed `instruction`
    source: tuple[PlacedObject, ...]
    target: tuple[PlacedObject, ...]  # the edit applied; every other object as in `source`
    size: int = 64

    def source_image(self) -> np.ndarray:
        return draw_objects(self.source, self.size)

    def target_image(self) -> np.ndarray:
        return draw_objects(self.target, self.size)


def _margins(size: int) -> tuple[float, int]:
    """Gap between objects and border margin, in supersampled pixels (as the renderer's)."""
    scale = max(size / 64, 1.0) * SUPERSAMPLE
    return GAP_PX * scale, round(BORDER_PX * scale)


def _separated(xy: np.ndarray, side: int, others: Sequence[PlacedObject], gap: float) -> np.ndarray:
    ok = np.ones(xy.shape[1], dtype=bool)
    for obj in others:
        sep_x = np.maximum(xy[0] - (obj.x + obj.side), obj.x - (xy[0] + side))
        sep_y = np.maximum(xy[1] - (obj.y + obj.side), obj.y - (xy[1] + side))
        ok &= np.maximum(sep_x, sep_y) >= gap
    return ok


def _centroids(shape: str, xy: np.ndarray, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Centroids (supersampled pixels) of `shape` drawn at the candidate corners `xy`."""
    return xy[0] + side / 2, xy[1] + side * _centroid_y(shape)


def _relation_slack(relation: str, c0x, c0y, c1x, c1y):
    """How far (as c0 - c1 distances) object 0 stands inside the verifier's rule for `relation` of object 1:
    >= 0 where the rule holds (along > 0 and along >= |across|)."""
    dx, dy = c1x - c0x, c1y - c0y
    along, across = {"left": (dx, dy), "right": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[relation]
    return np.minimum(along, along - np.abs(across))


def _place_one(shape: str, side: int, others: Sequence[PlacedObject], size: int, rng: np.random.Generator,
               accept: Callable[[np.ndarray], np.ndarray] | None = None) -> tuple[int, int] | None:
    """A top-left corner for a new object clear of `others` (and passing `accept`), or None."""
    gap, border = _margins(size)
    canvas = size * SUPERSAMPLE
    for _ in range(_PLACE_TRIES):
        xy = rng.integers(border, canvas - border - side + 1, size=(2, _CANDIDATES))
        ok = _separated(xy, side, others, gap)
        if accept is not None:
            ok &= accept(xy)
        if ok.any():
            j = int(np.argmax(ok))
            return int(xy[0, j]), int(xy[1, j])
    return None


def _move_accept(edit: Edit, target: PlacedObject, reference: PlacedObject) -> Callable[[np.ndarray], np.ndarray]:
    """Candidate corners where the moved target stands clearly `edit.relation` of the reference (the renderer's
    rule for position prompts)."""
    r = reference
    (r_cx, r_cy) = (c * SUPERSAMPLE for c in r.centroid_xy)

    def accept(xy: np.ndarray) -> np.ndarray:
        c0x, c0y = _centroids(target.shape, xy, target.side)
        return _relation_ok(edit.relation, c0x, c0y, r_cx, r_cy, max(target.side, r.side) / 2)

    return accept


def _apply(objects: tuple[PlacedObject, ...], edit: Edit, rng: np.random.Generator,
           size: int) -> tuple[PlacedObject, ...] | None:
    t, r = edit.resolve(objects)
    if edit.kind == "recolor":
        return tuple(replace(obj, color=edit.color) if k == t else obj for k, obj in enumerate(objects))
    if edit.kind == "remove":
        return tuple(obj for k, obj in enumerate(objects) if k != t)
    if edit.kind == "move":
        others = [obj for k, obj in enumerate(objects) if k != t]
        corner = _place_one(objects[t].shape, objects[t].side, others, size, rng,
                            _move_accept(edit, objects[t], objects[r]))
        if corner is None:
            return None
        return tuple(replace(obj, x=corner[0], y=corner[1]) if k == t else obj for k, obj in enumerate(objects))
    lo, hi = side_range(len(objects) + 1, size)
    side = int(rng.integers(lo, hi + 1))
    corner = _place_one(edit.target.shape, side, objects, size, rng)
    if corner is None:
        return None
    return (*objects, PlacedObject(edit.target.shape, edit.target.color, corner[0], corner[1], side))


def apply_edit(objects: Sequence[PlacedObject], edit: Edit | str, rng: np.random.Generator,
               size: int = 64) -> tuple[PlacedObject, ...]:
    """The scene with `edit` applied: a recolored object keeps its place and size, a moved one its shape, color
    and size, placed at random (from `rng`) where the relation holds clearly and clear of the others; an added
    one is drawn at the scene's size range anywhere free. Every other object is unchanged. Raises ValueError if
    the edit does not apply to the scene, RuntimeError if there is no room."""
    edit = parse_edit(edit) if isinstance(edit, str) else edit
    result = _apply(tuple(objects), edit, rng, size)
    if result is None:
        raise RuntimeError(f"no room to apply {edit.instruction!r} to the scene")
    return result


def _source_scene(edit: Edit, rng: np.random.Generator, size: int) -> tuple[PlacedObject, ...] | None:
    """One random source scene for a fully named edit, or None at a dead end (draw again)."""
    lo, hi = SOURCE_OBJECTS[edit.kind]
    n = int(rng.integers(lo, hi + 1))
    required = [edit.target] if edit.kind != "add" else []
    if edit.reference is not None:
        required.append(edit.reference)
    # Objects are unique by color and shape, in the source and in the result, so every one can be named.
    taken = set(required)
    if edit.kind == "recolor":
        taken.add(ObjectSpec(edit.target.shape, edit.color))
    if edit.kind == "add":
        taken.add(edit.target)
    pool = [ObjectSpec(shape, color) for color in COLORS for shape in SHAPES if ObjectSpec(shape, color) not in taken]
    extra = [pool[k] for k in rng.choice(len(pool), size=n - len(required), replace=False)]
    specs = [(required + extra)[k] for k in rng.permutation(n)]
    side_lo, side_hi = side_range(n + (edit.kind == "add"), size)
    sides = [int(s) for s in rng.integers(side_lo, side_hi + 1, size=n)]
    placed: list[PlacedObject] = []
    slack = MOVE_SLACK_PX * SUPERSAMPLE * size / 64
    for spec, side in zip(specs, sides, strict=True):
        accept = None
        if edit.kind == "move" and spec in (edit.target, edit.reference):
            other = edit.reference if spec == edit.target else edit.target
            placed_other = next((obj for obj in placed if ObjectSpec(obj.shape, obj.color) == other), None)
            if placed_other is not None:
                accept = _source_move_accept(edit, spec, side, placed_other, slack)
        corner = _place_one(spec.shape, side, placed, size, rng, accept)
        if corner is None:
            return None
        placed.append(PlacedObject(spec.shape, spec.color, corner[0], corner[1], side))
    return tuple(placed)


def _source_move_accept(edit: Edit, spec: ObjectSpec, side: int, placed_other: PlacedObject, slack: float):
    """Candidates where the relation of the move's target to its reference is clearly false (by `slack`)."""
    ox, oy = (c * SUPERSAMPLE for c in placed_other.centroid_xy)

    def accept(xy: np.ndarray) -> np.ndarray:
        cx, cy = _centroids(spec.shape, xy, side)
        if spec == edit.target:
            return _relation_slack(edit.relation, cx, cy, ox, oy) <= -slack
        return _relation_slack(edit.relation, ox, oy, cx, cy) <= -slack

    return accept


def _shortened(edit: Edit, objects: Sequence[PlacedObject], rng: np.random.Generator) -> Edit:
    """The edit with each reference whose shape is unique in the scene named by its shape alone, at random."""
    if edit.kind == "add":
        return edit

    def maybe_short(ref: ObjectSpec) -> ObjectSpec:
        unique = sum(obj.shape == ref.shape for obj in objects) == 1
        return ObjectSpec(ref.shape, None) if unique and rng.random() < SHAPE_ONLY_PROBABILITY else ref

    target = maybe_short(edit.target)
    reference = maybe_short(edit.reference) if edit.reference is not None else None
    text = format_edit(edit.kind, target, edit.color, edit.relation, reference)
    return parse_edit(text, objects)


def make_example(instruction: str, seed: int, size: int = 64) -> EditExample:
    """A random (source scene, instruction, target scene) for a fully named instruction (one of `all_edits`),
    reproducible from `seed`. The source holds the objects the instruction names and a few others (all unique
    by color and shape); a move's relation is clearly false in it. The instruction shown may name an object
    whose shape is unique in the scene by its shape alone."""
    edit = parse_edit(instruction)
    if not edit.fully_named:
        raise ValueError(f"examples are drawn for instructions that name every object by color and shape, "
                         f"e.g. 'make the red square green'; got {instruction!r}")
    rng = np.random.default_rng(seed)
    for _ in range(_MAX_RESTARTS):
        source = _source_scene(edit, rng, size)
        if source is None:
            continue
        target = _apply(source, edit, rng, size)
        if target is None:
            continue
        shown = _shortened(edit, source, rng)
        return EditExample(shown.instruction, edit.instruction, shown, source, target, size)
    raise RuntimeError(f"could not draw a scene for {instruction!r}")


def sample_example(seed: int, split: str = "train", kind: str | None = None, size: int = 64) -> EditExample:
    """A random example of `split` ('train', 'test' or 'all'), reproducible from `seed`: the kind (uniform over
    EDIT_KINDS unless given), then an instruction of that kind uniformly, then its scene."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'test' or 'all'")
    by_kind = _split(split)
    rng = np.random.default_rng((seed, 1))  # a stream apart from the scene's (make_example uses `seed` itself)
    kind = kind if kind is not None else EDIT_KINDS[int(rng.integers(len(EDIT_KINDS)))]
    if kind not in by_kind:
        raise ValueError(f"unknown edit kind {kind!r}; expected one of {EDIT_KINDS}")
    instructions = by_kind[kind]
    return make_example(instructions[int(rng.integers(len(instructions)))], seed, size)


# --------------------------------------------------------------------------- verification


@dataclass(frozen=True)
class EditVerdict:
    score: float  # partial credit in [0, 1]: the mean of the edit term (0 or 1) and `preserve_score`
    strict: bool  # the edit done and everything else preserved
    # "ok", or the first failure, starting with edit / background / stray / missing / shape / color / position /
    # size / extra
    reason: str
    edit_done: bool
    # Mean over the objects to keep of the share of their checks (shape, color, position, size) that hold,
    # times n_kept / (n_kept + n_extra), times the verifier's stray-ink fade, times the background tint's fade
    preserve_score: float
    failures: tuple[str, ...] = ()  # every failure, in the order of `reason`
    background_shift: float = 0.0  # the output's mean background tint minus the source's (ΔE76)


@dataclass(frozen=True)
class _Slot:
    """An object the output should hold: as in the source, or as the edit makes it."""

    shape: str
    color: str
    name: str  # "the red circle", as in the source
    role: str  # "keep", or the edit's kind for its target
    anchor: tuple[float, float] | None  # where it should be (None: anywhere)
    area: int | None  # its detected area in the source (None: any size)


def _distance(a: tuple[float, float], b: tuple[float, float]) -> float:
    return float(np.hypot(a[0] - b[0], a[1] - b[1]))


def _match(slots: list[_Slot], found: list[DetectedObject], radius: float) -> dict[int, int]:
    """Output object matched to each slot: most shape and color agreements plus nearness to the slot's
    anchor (1 at the spot, 0 from `radius`), over all one-to-one assignments; a pair agreeing in nothing
    and not within radius / 2 is no match."""
    if not slots or not found:
        return {}
    weight = np.zeros((len(slots), len(found)))
    for (i, slot), (j, obj) in itertools.product(enumerate(slots), enumerate(found)):
        weight[i, j] = (obj.shape == slot.shape) + (obj.color == slot.color)
        if slot.anchor is not None:
            weight[i, j] += max(0.0, 1 - _distance(obj.centroid_xy, slot.anchor) / radius)
    from scipy.optimize import linear_sum_assignment  # lazy: scipy.optimize takes ~0.5 s to import

    rows, cols = linear_sum_assignment(weight, maximize=True)
    return {int(i): int(j) for i, j in zip(rows, cols, strict=True) if weight[i, j] >= 0.5}


def verify_edit(source_image, output_image, instruction_or_edit: str | Edit) -> EditVerdict:
    """Judge `output_image` as the result of applying an edit to `source_image` (uint8 HWC arrays or [3, H, W]
    float tensors in [0, 1], of one size). The edit's references are resolved among the objects detected in the
    source (ValueError if they do not apply there, as in `parse_edit`).

    (a) The edit: recolor, the object at the target's place has the new color; move, the target (matched by
    shape and color) stands in the relation to the reference, by the text-to-image verifier's rule; remove, no
    object of the target's shape and color is left beyond the objects kept; add, an object of the new shape
    (a clean one) and color is there. (b) Preservation: each other object of the source is there, of its shape
    (a clean one) and color, within POSITION_TOLERANCE_PX of its place and SIZE_TOLERANCE of its size (a recolored
    target keeps all but its color, a moved one all but its place); no other object; no stray ink or dirty
    background (as in `verify`); the background's tint within BACKGROUND_SHIFT_DELTA_E of the source's.
    """
    source, output = _as_uint8_hwc(source_image), _as_uint8_hwc(output_image)
    if source.shape != output.shape:
        raise ValueError(f"source and output images differ in shape: {source.shape} and {output.shape}")
    edit = parse_edit(instruction_or_edit) if isinstance(instruction_or_edit, str) else instruction_or_edit
    before, after = _analyze(source), _analyze(output)
    t, r = edit.resolve(before.objects)
    scale = source.shape[0] / 64
    tolerance = POSITION_TOLERANCE_PX * scale

    slots: list[_Slot] = []
    for k, obj in enumerate(before.objects):
        name = f"the {obj.color} {obj.shape}"
        if k != t:
            slots.append(_Slot(obj.shape, obj.color, name, "keep", obj.centroid_xy, obj.area))
        elif edit.kind == "recolor":
            slots.append(_Slot(obj.shape, edit.color, name, "recolor", obj.centroid_xy, obj.area))
        elif edit.kind == "move":
            slots.append(_Slot(obj.shape, obj.color, name, "move", None, obj.area))
    if edit.kind == "add":
        slots.append(_Slot(edit.target.shape, edit.target.color, f"a {edit.target.color} {edit.target.shape}", "add",
                           None, None))
    found = after.objects
    match = _match(slots, found, MATCH_RADIUS_PX * scale)
    unmatched = [j for j in range(len(found)) if j not in match.values()]

    # (a) the edit
    edit_failure = None
    target_slot = next((i for i, slot in enumerate(slots) if slot.role != "keep"), None)
    got = found[match[target_slot]] if target_slot in match else None
    if edit.kind == "recolor":
        name = slots[target_slot].name
        if got is None:
            edit_failure = f"edit: {name} is gone"
        elif got.color != edit.color:
            edit_failure = f"edit: {name} is {got.color}, not {edit.color}"
    elif edit.kind == "move":
        name = slots[target_slot].name
        # a move keeps a slot for every object of the source, in its order: the reference's is r
        ref = found[match[r]] if r in match else None
        where = f"{RELATIONS[edit.relation]} {slots[r].name}"
        if got is None:
            edit_failure = f"edit: {name} is gone"
        elif ref is None:
            edit_failure = f"edit: {name} cannot be {where}: {slots[r].name} is gone"
        elif not _relation_holds(edit.relation, got, ref):
            edit_failure = f"edit: {name} is not {where}"
    elif edit.kind == "remove":
        removed = before.objects[t]
        left = [j for j in unmatched if (found[j].shape, found[j].color) == (removed.shape, removed.color)]
        if left:
            edit_failure = f"edit: the {removed.color} {removed.shape} is still there"
            unmatched.remove(left[0])  # the object not removed; it is no extra object
    else:
        want = ObjectSpec(edit.target.shape, edit.target.color)
        if got is None:
            edit_failure = f"edit: no {want.color} {want.shape} was added"
        elif not (_shape_ok(got, want) and got.color == want.color):
            edit_failure = f"edit: the object added is {got.description()}, not a {want.color} {want.shape}"

    # (b) preservation
    failures = [] if edit_failure is None else [edit_failure]
    if (stray := _stray_failure(after)) is not None:
        failures.append(stray)
    shift = after.background_delta_e - before.background_delta_e
    if abs(shift) > BACKGROUND_SHIFT_DELTA_E:
        failures.append(f"background: its tint moved by ΔE {shift:+.1f} from the source's "
                        f"(> {BACKGROUND_SHIFT_DELTA_E:g})")
    kept = []  # per slot to keep, the share of its checks that hold
    for i, slot in enumerate(slots):
        if slot.role == "add":
            continue
        obj = found[match[i]] if i in match else None
        if obj is None:
            if slot.role == "keep":
                failures.append(f"missing: {slot.name} is gone")
            kept.append(0.0)
            continue
        checks = {"shape": _shape_ok(obj, ObjectSpec(slot.shape, None))}
        if slot.role != "recolor":
            checks["color"] = obj.color == slot.color
        if slot.anchor is not None:
            checks["position"] = _distance(obj.centroid_xy, slot.anchor) <= tolerance
        growth = float(np.sqrt(obj.area / slot.area))
        checks["size"] = 1 / SIZE_TOLERANCE <= growth <= SIZE_TOLERANCE
        for check, ok in checks.items():
            if ok:
                continue
            if check == "shape":
                failures.append(f"shape: {slot.name} became {obj.description()}")
            elif check == "color":
                failures.append(f"color: {slot.name} turned {obj.color}")
            elif check == "position":
                failures.append(f"position: {slot.name} moved by {_distance(obj.centroid_xy, slot.anchor):.1f} px "
                                f"(tolerance {tolerance:g})")
            else:
                failures.append(f"size: {slot.name} changed size by {growth:.2f}x (tolerance {SIZE_TOLERANCE:g}x)")
        kept.append(float(np.mean(list(checks.values()))))
    for j in unmatched:
        failures.append(f"extra: {found[j].description()} that the source does not hold")

    n_kept = len(kept)
    clean = min(1.0, max(0.0, (STRAY_ZERO_CREDIT - after.stray_fraction) / (STRAY_ZERO_CREDIT - STRAY_LIMIT)))
    tint_span = BACKGROUND_ZERO_DELTA_E - BACKGROUND_SHIFT_DELTA_E
    tint = min(1.0, max(0.0, (BACKGROUND_ZERO_DELTA_E - abs(shift)) / tint_span))
    preserve = (float(np.mean(kept)) if kept else 1.0) * max(n_kept, 1) / (max(n_kept, 1) + len(unmatched))
    preserve *= clean * tint
    done = edit_failure is None
    return EditVerdict(
        score=0.5 * done + 0.5 * preserve,
        strict=not failures,
        reason=failures[0] if failures else "ok",
        edit_done=done,
        preserve_score=preserve,
        failures=tuple(failures),
        background_shift=shift,
    )
