"""Renderer of the "shapes" world: draws a `SceneSpec` as a small RGB image.

Shapes are drawn filled, without outlines, on a white background at `SUPERSAMPLE`x the
output resolution and box-downsampled, so edges are mildly antialiased like a generated
image. Placement is rejection-sampled: objects never touch each other or the border, and
for position prompts the relation holds clearly (see `_relation_ok`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from .grammar import BACKGROUND, COLORS, SceneSpec, parse_prompt

SUPERSAMPLE = 4
# Pixel sizes at image size 64; they scale with the image size (the margins never shrink).
GAP_PX = 3  # min free pixels between two objects' bounding boxes
BORDER_PX = 2  # min free pixels between an object and the image border
SIZE_FEW_PX = (14, 22)  # bbox side range for scenes of one or two objects
SIZE_MANY_PX = (11, 15)  # ... and for three or four objects
# Position scenes: the offset across the relation axis must stay below this fraction of the
# offset along it, leaving margin for the verifier's rule (across < along).
MAX_ACROSS_RATIO = 0.75

_CANDIDATES = 64  # positions tried at once per object
_MAX_RESTARTS = 1000

_COLOR_NAMES = tuple(COLORS)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[float, float, float, float], fill) -> None:
    """Fill `shape` inscribed in the inclusive pixel box (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":  # upright: apex at the top middle, base along the bottom
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    elif shape == "diamond":  # vertices at the middles of the box edges
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
    else:
        raise ValueError(f"unknown shape {shape!r}")


def _centroid_y(shape: str) -> float:
    """Height of the filled area's centroid below the bbox top, as a fraction of the side."""
    # A triangle's centroid sits at 2/3 of its height from the apex.
    return 2 / 3 if shape == "triangle" else 1 / 2


def _relation_ok(relation: str, c0x, c0y, c1x, c1y, min_along: float) -> np.ndarray:
    """Does object 0 (centroid c0) stand clearly `relation` of object 1 (centroid c1)?"""
    dx, dy = c1x - c0x, c1y - c0y
    along, across = {
        "left": (dx, np.abs(dy)),
        "right": (-dx, np.abs(dy)),
        "above": (dy, np.abs(dx)),
        "below": (-dy, np.abs(dx)),
    }[relation]
    return (along >= min_along) & (across <= MAX_ACROSS_RATIO * along)


def _place(spec: SceneSpec, sides: list[int], size: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Top-left corners (supersampled px) for objects of the given sides, by rejection sampling."""
    canvas = size * SUPERSAMPLE
    # Margins grow with the image but never shrink below their pixel counts at size 64.
    scale = max(size / 64, 1.0) * SUPERSAMPLE
    gap, border = GAP_PX * scale, round(BORDER_PX * scale)
    for _ in range(_MAX_RESTARTS):
        corners: list[tuple[int, int]] = []
        for i, side in enumerate(sides):
            xy = rng.integers(border, canvas - border - side + 1, size=(2, _CANDIDATES))
            ok = np.ones(_CANDIDATES, dtype=bool)
            for (px, py), pside in zip(corners, sides[:i], strict=True):
                # Separated if a gap >= `gap` exists along x or along y.
                sep_x = np.maximum(xy[0] - (px + pside), px - (xy[0] + side))
                sep_y = np.maximum(xy[1] - (py + pside), py - (xy[1] + side))
                ok &= np.maximum(sep_x, sep_y) >= gap
            if spec.relation is not None and i == 1:
                (px, py), pside = corners[0], sides[0]
                shape0, shape1 = spec.objects[0].shape, spec.objects[1].shape
                c0x, c0y = px + pside / 2, py + pside * _centroid_y(shape0)
                c1x, c1y = xy[0] + side / 2, xy[1] + side * _centroid_y(shape1)
                ok &= _relation_ok(spec.relation, c0x, c0y, c1x, c1y, max(pside, side) / 2)
            if not ok.any():
                break  # dead end: start the scene over
            j = int(np.argmax(ok))
            corners.append((int(xy[0, j]), int(xy[1, j])))
        else:
            return corners
    raise RuntimeError(f"could not place the objects of {spec.prompt!r}")


@dataclass(frozen=True)
class PlacedObject:
    """One object of a laid-out scene: its shape, palette color and bounding box, a square whose
    top-left corner (x, y) and side are in supersampled pixels (SUPERSAMPLE x the image size)."""

    shape: str
    color: str
    x: int
    y: int
    side: int

    @property
    def centroid_xy(self) -> tuple[float, float]:
        """Centroid of the filled area in image pixels, pixel i spanning [i, i + 1) as in the detector's."""
        cx = self.x + self.side / 2
        cy = self.y + self.side * _centroid_y(self.shape)
        return cx / SUPERSAMPLE, cy / SUPERSAMPLE


def side_range(n_objects: int, size: int = 64) -> tuple[int, int]:
    """Inclusive range of bbox sides (supersampled pixels) for a scene of `n_objects` at `size`."""
    lo, hi = SIZE_FEW_PX if n_objects <= 2 else SIZE_MANY_PX
    unit = SUPERSAMPLE * size / 64
    return round(lo * unit), round(hi * unit)


def layout_scene(spec: SceneSpec, rng: np.random.Generator, size: int = 64) -> tuple[PlacedObject, ...]:
    """One random layout of `spec`: sizes, positions and (where the prompt leaves them open) colors."""
    lo, hi = side_range(len(spec.objects), size)
    sides = [int(s) for s in rng.integers(lo, hi + 1, size=len(spec.objects))]
    corners = _place(spec, sides, size, rng)
    placed = []
    for obj, side, (x, y) in zip(spec.objects, sides, corners, strict=True):
        color = obj.color if obj.color is not None else _COLOR_NAMES[rng.integers(len(_COLOR_NAMES))]
        placed.append(PlacedObject(obj.shape, color, x, y, side))
    return tuple(placed)


def draw_objects(objects, size: int = 64) -> np.ndarray:
    """Draw placed objects (in order) on the white background as a uint8 [size, size, 3] RGB image."""
    image = Image.new("RGB", (size * SUPERSAMPLE, size * SUPERSAMPLE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    for obj in objects:
        draw_shape(draw, obj.shape, (obj.x, obj.y, obj.x + obj.side - 1, obj.y + obj.side - 1), COLORS[obj.color])
    return np.array(image.resize((size, size), Image.BOX))


def render_scene(spec: SceneSpec, rng: np.random.Generator, size: int = 64) -> np.ndarray:
    """Render `spec` as a uint8 [size, size, 3] RGB image."""
    return draw_objects(layout_scene(spec, rng, size), size)


def render_prompt(prompt: str, seed: int, size: int = 64) -> np.ndarray:
    """Render one random scene of `prompt`, reproducible from `seed`."""
    return render_scene(parse_prompt(prompt), np.random.default_rng(seed), size)
