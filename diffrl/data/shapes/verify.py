"""Exact verifier of the "shapes" world: detects the colored shapes of an image and checks
them against a prompt, giving a partial-credit score and a strict pass/fail.

Detection: every pixel takes the nearest palette color (or the white background) unless it
is farther than `MAX_COLOR_DIST` from all of them; each color's connected components are
objects, and an object's shape is the template with the highest (soft) IoU with the object's
coverage map. Templates are rasterized, antialiased, at the box size and position implied by
the object's centroid and second moments.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from .grammar import BACKGROUND, COLORS, RELATIONS, SHAPES, ObjectSpec, SceneSpec, noun_phrase, parse_prompt

# Palette blends with white stay >= ~110 RGB units from any other palette color (see
# grammar.COLORS), so this threshold keeps antialiased edges from changing color.
MAX_COLOR_DIST = 80.0
MIN_AREA_PX = 10  # at 64x64, scaled with the image area; smaller components are noise
MAX_MATCHED = 8  # only the largest detections take part in the assignment search
# Pixels near no palette color nor the background: antialiased edges make up <= 3.2% of a render
# (max over 900 renders), the shipped model's samples <= 2.3%. Above CLEAN_LIMIT an image fails
# strictly, and partial credit fades to 0 at NOISE_ZERO_CREDIT: otherwise RL learns to paint the
# background with colors the detector ignores (seen in a long NFT run: 70% grey noise, full credit).
CLEAN_LIMIT = 0.05
NOISE_ZERO_CREDIT = 0.20

_COLOR_NAMES = tuple(COLORS)
_PALETTE = np.array([*COLORS.values(), BACKGROUND], dtype=np.float32)  # background last
_PALETTE_SQ = (_PALETTE**2).sum(1)
_PALETTE_TIMES_MINUS_2 = -2 * _PALETTE.T
_BACKGROUND_INDEX = len(COLORS)
_WHITE = np.array(BACKGROUND, dtype=np.float32)
# Variance of each filled shape along x and y as a fraction of its box width^2 and height^2.
_VARIANCE_FRACTION = {
    "circle": (1 / 16, 1 / 16),
    "square": (1 / 12, 1 / 12),
    "triangle": (1 / 24, 1 / 18),
    "diamond": (1 / 24, 1 / 24),
}
_MIN_VARIANCE = 0.05
_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)


@dataclass(frozen=True)
class DetectedObject:
    shape: str
    color: str
    centroid_xy: tuple[float, float]  # pixels, y grows downward
    area: int  # pixels
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 with x1, y1 exclusive
    confidence: float  # soft IoU of the object with the chosen shape's template


@dataclass(frozen=True)
class Verdict:
    score: float  # partial credit in [0, 1]
    strict: bool  # every requirement met
    reason: str  # "ok", or the first failure, starting with count/shape/color/relation
    # Partial credit with each kind of requirement (count, shape, color, relation) weighed alike,
    # however many objects the prompt names: a wrong count costs half of "three circles", not a quarter.
    balanced_score: float
    # Half for the exact number of objects, half for the mean of the other components. Under `score`
    # an extra object costs less than one wrong shape ("three triangles" drawn as four scores 0.92,
    # three with one misshapen 0.75), so RL learns to hedge with extra objects; here the exact count
    # comes first (0.5 and 0.83).
    exact_count_score: float


# --------------------------------------------------------------------------- detection


def _as_uint8_hwc(image) -> np.ndarray:
    """uint8 [H, W, 3] numpy array from a uint8 HWC array or a [3, H, W] tensor in [0, 1]."""
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected a uint8 [H, W, 3] array, got {image.dtype} {image.shape}")
        return image
    if hasattr(image, "detach"):  # a torch tensor; torch itself is not needed here
        tensor = image.detach().cpu()
        if tensor.ndim != 3 or tensor.shape[0] != 3:
            raise ValueError(f"expected a [3, H, W] tensor, got shape {tuple(tensor.shape)}")
        if tensor.is_floating_point():
            tensor = tensor.float().clamp(0, 1).mul(255).round()
        return tensor.byte().permute(1, 2, 0).contiguous().numpy()
    raise TypeError(f"expected a numpy array or a torch tensor, got {type(image).__name__}")


def _classify_pixels(image: np.ndarray) -> np.ndarray:
    """[H, W] palette index per pixel (len(COLORS) = background, -1 = no color is close)."""
    pixels = image.reshape(-1, 3).astype(np.float32)
    # |p - c|^2 = |p|^2 - 2 p.c + |c|^2; |p|^2 does not change the argmin, so add it last.
    partial = pixels @ _PALETTE_TIMES_MINUS_2 + _PALETTE_SQ
    index = partial.argmin(1)
    nearest_sq = partial[np.arange(len(index)), index] + (pixels * pixels).sum(1)
    index[nearest_sq > MAX_COLOR_DIST**2] = -1
    return index.reshape(image.shape[:2])


def _coverage(patch: np.ndarray, color: np.ndarray) -> np.ndarray:
    """Per pixel, the fraction of `color` in a blend of `color` and the white background."""
    towards_color = _WHITE - color
    fraction = (_WHITE - patch) @ towards_color / (towards_color @ towards_color)
    return np.minimum(np.maximum(fraction, 0.0), 1.0)


def _box_size(shape: str, var_x: float, var_y: float) -> tuple[float, float]:
    """Width and height of the box of a `shape` whose area has these variances along x and y."""
    fraction_x, fraction_y = _VARIANCE_FRACTION[shape]
    return np.sqrt(var_x / fraction_x), np.sqrt(var_y / fraction_y)


def _signed_distance(shape: str, x: np.ndarray, y: np.ndarray, width: float, height: float) -> np.ndarray:
    """Approximate signed distance (px, negative inside) to `shape` of the given box size,
    whose centroid is at x = y = 0."""
    a, b = width / 2, height / 2
    if shape == "circle":
        return (np.hypot(x / a, y / b) - 1) * min(a, b)
    if shape == "square":
        return np.maximum(np.abs(x) - a, np.abs(y) - b)
    if shape == "diamond":
        return (np.abs(x) / a + np.abs(y) / b - 1) * (a * b / np.hypot(a, b))
    if shape == "triangle":
        depth = y + 2 * height / 3  # below the apex; the centroid lies 2/3 of the way down
        return np.maximum(depth - height, (np.abs(x) - a * depth / height) * (height / np.hypot(height, a)))
    raise ValueError(f"unknown shape {shape!r}")


def _match_shapes(alpha: np.ndarray) -> tuple[np.ndarray, tuple[float, float]]:
    """Soft IoU of `alpha` (an object's coverage map) with each shape of SHAPES, and the
    object's centroid in patch coordinates.

    Each template is sized from alpha's second moments rather than the mask's bounding box:
    the sharp vertices of diamonds and triangles fall below half coverage, so the bounding box
    of the mask is too small for them and small diamonds would pass for circles.
    """
    height, width = alpha.shape
    xs, ys = np.arange(width) + 0.5, np.arange(height) + 0.5
    col, row = alpha.sum(0), alpha.sum(1)
    mass = col.sum()
    cx, cy = col @ xs / mass, row @ ys / mass
    # Box-averaging into pixels adds 1/12 px^2 of variance; floor at a sliver's variance.
    var_x = max(col @ (xs - cx) ** 2 / mass - 1 / 12, _MIN_VARIANCE)
    var_y = max(row @ (ys - cy) ** 2 / mass - 1 / 12, _MIN_VARIANCE)
    x, y = (xs - cx)[None, :], (ys - cy)[:, None]
    distances = np.stack([_signed_distance(shape, x, y, *_box_size(shape, var_x, var_y)) for shape in SHAPES])
    templates = np.minimum(np.maximum(0.5 - distances, 0.0), 1.0)  # ~ pixel coverage at that distance
    ious = np.minimum(templates, alpha).sum((1, 2)) / np.maximum(templates, alpha).sum((1, 2))
    return ious, (cx, cy)


def _describe_component(
    image: np.ndarray, classes: np.ndarray, labels: np.ndarray, label: int, box: tuple[slice, slice], color_index: int
) -> DetectedObject:
    mask = labels[box] == label
    # One pixel of margin takes in the faint edge pixels that the mask leaves out.
    top, left = max(box[0].start - 1, 0), max(box[1].start - 1, 0)
    pad = (slice(top, box[0].stop + 1), slice(left, box[1].stop + 1))
    owned = (labels[pad] == label) | (classes[pad] == _BACKGROUND_INDEX) | (classes[pad] < 0)
    alpha = _coverage(image[pad].astype(np.float32), _PALETTE[color_index]) * owned
    ious, (cx, cy) = _match_shapes(alpha)
    best = int(ious.argmax())
    return DetectedObject(
        shape=SHAPES[best],
        color=_COLOR_NAMES[color_index],
        centroid_xy=(left + float(cx), top + float(cy)),
        area=int(mask.sum()),
        bbox=(box[1].start, box[0].start, box[1].stop, box[0].stop),
        confidence=float(ious[best]),
    )


def detect_objects(image) -> list[DetectedObject]:
    """Colored shapes in `image` (uint8 HWC array or [3, H, W] float tensor), largest first."""
    image = _as_uint8_hwc(image)
    return _detect(image, _classify_pixels(image))


def _detect(image: np.ndarray, classes: np.ndarray) -> list[DetectedObject]:
    min_area = max(3, round(MIN_AREA_PX * classes.size / 64**2))
    counts = np.bincount(classes[classes >= 0].ravel(), minlength=len(_PALETTE))
    objects = []
    for color_index in np.flatnonzero(counts[: len(_COLOR_NAMES)] >= min_area):
        labels, _ = ndimage.label(classes == color_index, structure=_EIGHT_CONNECTED)
        areas = np.bincount(labels.ravel())
        for label, box in enumerate(ndimage.find_objects(labels), start=1):
            if areas[label] >= min_area:
                objects.append(_describe_component(image, classes, labels, label, box, int(color_index)))
    return sorted(objects, key=lambda obj: -obj.area)


# --------------------------------------------------------------------------- verification


def _relation_holds(relation: str, first: DetectedObject, second: DetectedObject) -> bool:
    """`first` is `relation` of `second`: right side of the axis, and that axis dominates."""
    dx = second.centroid_xy[0] - first.centroid_xy[0]
    dy = second.centroid_xy[1] - first.centroid_xy[1]
    along, across = {"left": (dx, dy), "right": (-dx, dy), "above": (dy, dx), "below": (-dy, dx)}[relation]
    return along > 0 and along >= abs(across)


@functools.lru_cache(maxsize=64)
def _permutations(n_slots: int, n_required: int) -> np.ndarray:
    return np.array(list(itertools.permutations(range(n_slots), n_required)), dtype=np.intp).reshape(-1, n_required)


def _assign(spec: SceneSpec, found: list[DetectedObject]) -> list[DetectedObject | None]:
    """Detection matched to each required object (None: missing), maximizing satisfied
    attributes (shape, color, relation) over all assignments; ties favor larger objects."""
    required = spec.objects
    n_slots = max(len(found), len(required))  # slots past len(found) stand for "missing"
    satisfied = np.zeros((len(required), n_slots))
    for i, want in enumerate(required):
        for j, obj in enumerate(found):
            satisfied[i, j] = (obj.shape == want.shape) + (want.color is not None and obj.color == want.color)
    perms = _permutations(n_slots, len(required))
    total = satisfied[np.arange(len(required)), perms].sum(1)
    if spec.relation is not None:
        relation_ok = np.zeros((n_slots, n_slots))
        for (a, obj_a), (b, obj_b) in itertools.permutations(enumerate(found), 2):
            relation_ok[a, b] = _relation_holds(spec.relation, obj_a, obj_b)
        total += relation_ok[perms[:, 0], perms[:, 1]]
    best = perms[int(total.argmax())]  # argmax takes the first maximum: lowest indices, i.e. largest objects
    return [found[j] if j < len(found) else None for j in best]


def _the(obj: ObjectSpec) -> str:
    return "the " + noun_phrase(obj)[2:]


def verify(image, prompt_or_spec: str | SceneSpec) -> Verdict:
    """Check `image` (uint8 HWC array or [3, H, W] float tensor in [0, 1]) against a prompt.

    The score is the mean of: a count component, per required object a shape component and,
    if a color is required, a color component, and for position prompts a relation component;
    the balanced score first averages the components of each kind, then the kinds; the exact-count
    score is half [the count is exact] and half the mean of the other components; all are
    times a cleanliness factor that is 1 up to CLEAN_LIMIT of unexplained pixels and 0 from
    NOISE_ZERO_CREDIT. The reason names the first failure among count, then each object's shape
    and color, then the relation, then noise, and starts with that word.
    """
    spec = parse_prompt(prompt_or_spec) if isinstance(prompt_or_spec, str) else prompt_or_spec
    image = _as_uint8_hwc(image)
    classes = _classify_pixels(image)
    detected = _detect(image, classes)
    noise = float((classes < 0).mean())
    matched = _assign(spec, detected[:MAX_MATCHED])

    n_required, n_found = len(spec.objects), len(detected)
    components = {"count": [1.0 if n_found == n_required else max(0.0, 1 - abs(n_found - n_required) / n_required)]}
    failures = []
    if n_found != n_required:
        noun = "object" if n_required == 1 else "objects"
        failures.append(f"count: expected {n_required} {noun}, found {n_found}")

    for i, (want, got) in enumerate(zip(spec.objects, matched, strict=True), start=1):
        found_text = f"a {got.color} {got.shape}" if got else "nothing"
        checks = [("shape", got is not None and got.shape == want.shape)]
        if want.color is not None:
            checks.append(("color", got is not None and got.color == want.color))
        for kind, ok in checks:
            components.setdefault(kind, []).append(float(ok))
            if not ok:
                failures.append(f"{kind}: object {i} expected {noun_phrase(want)}, found {found_text}")

    if spec.relation is not None:
        first, second = matched
        ok = first is not None and second is not None and _relation_holds(spec.relation, first, second)
        components["relation"] = [float(ok)]
        if not ok:
            want0, want1 = spec.objects
            failures.append(f"relation: {_the(want0)} is not {RELATIONS[spec.relation]} {_the(want1)}")

    if noise > CLEAN_LIMIT:
        failures.append(f"noise: {noise:.0%} of the image is neither a palette color nor background")
    clean = min(1.0, max(0.0, (NOISE_ZERO_CREDIT - noise) / (NOISE_ZERO_CREDIT - CLEAN_LIMIT)))
    every_component = [value for values in components.values() for value in values]
    not_count = [value for kind, values in components.items() if kind != "count" for value in values]
    return Verdict(
        score=float(np.mean(every_component)) * clean,
        strict=not failures,
        reason=failures[0] if failures else "ok",
        balanced_score=float(np.mean([np.mean(values) for values in components.values()])) * clean,
        exact_count_score=(0.5 * (n_found == n_required) + 0.5 * float(np.mean(not_count))) * clean,
    )
