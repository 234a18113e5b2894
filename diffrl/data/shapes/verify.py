"""Exact verifier of the "shapes" world: detects the colored shapes of an image and checks
them against a prompt, giving a partial-credit score and a strict pass/fail.

The verifier is also the RL reward, so it is written to reject what an honest judge rejects:

- Ink: a pixel is ink when it is more than `BACKGROUND_DELTA_E` (CIELAB ΔE76) from white. Ink
  that belongs to no object (or its soft rim) is stray: a dirty background, specks, marks,
  ghost shapes. Stray ink fails the image and fades the partial credit. Faint ink near an object
  (`HALO_PX`, `HALO_DELTA_E`, in a `JPEG_BLOCK_PX` tile that holds an object) is its halo, JPEG rings there,
  unless it is a solid blot (`BLOT_PX`) or darker than JPEG's ringing gets (`HALO_LIGHTNESS`: a grey speck).
- Color: a pixel's hue is the direction of its RGB color around the grey axis. Blending with
  white and shading darker or lighter keep that direction, so shading within one hue does not
  split an object. A core pixel has at least `CORE_CHROMA` of its nearest palette hue's chroma;
  each hue's connected core pixels are one object, or a speck (stray ink) when smaller than
  `MIN_OBJECT_PX`. An object whose mean hue is off its palette color's by more than
  `HUE_TOLERANCE_DEG`, or whose pixels do not reach its color's saturation (`FULL_CHROMA`: brown is
  no orange, pink no red), has no palette color (it still counts for colorless prompts).
- Shape: from the object's coverage map, its second moments, then soft IoU with each shape's
  template at that size and position (a triangle's also turned, up to `MAX_TRIANGLE_TILT_DEG`). An object that is
  stretched (`MAX_ASPECT`, `MAX_SKEW`), a "circle" that is oval (`MAX_CIRCLE_ELONGATION`: two merged disks)
  or concave (`MAX_CONCAVITY`), whose best template overlaps less than `MIN_IOU`, or leads the
  second best by less than `MIN_MARGIN`, or a "circle" whose outline has corners (a k-fold ripple
  of its radius, `MAX_CIRCLE_TILT`: a polygon, a turned square), or a "triangle" whose top is no
  apex (`MAX_APEX_WIDTH`: a trapezoid, two overlapping triangles), or that has a hole of background
  (`MAX_HOLE_PX`), is malformed: it counts as an object but matches no shape, and the reason says why.
- Texture: a flat fill, its blend into white and a fill shaded in two tones change monotonically
  along rows and columns, so for three pixels in a line inside the object (adjacent, or up to 4 px
  apart) the CIELAB distance through the middle one is about that between the outer two. A dither,
  a checkerboard or a mottled fill zig-zags; an object whose mean excess per step is over
  `TEXTURE_DELTA_E` is dithered: it counts as an object but matches no shape. At strides of 3-4 px chroma
  weighs less (`WIDE_CHROMA_WEIGHT`), and only objects `MIN_PATTERN_CELLS` strides wide: JPEG's chroma.
- Every failure is named: the reason starts with background, stray, count, texture, shape, color
  or relation.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np

from .grammar import BACKGROUND, COLORS, RELATIONS, SHAPES, ObjectSpec, SceneSpec, noun_phrase, parse_prompt


def _ndimage():
    """scipy.ndimage, imported on first use (lazy: scipy takes ~0.5 s to import, which a process that imports the
    rewards without verifying a shapes image, as most of a run's do, need not pay)."""
    from scipy import ndimage

    return ndimage


# ---- pixels
# ΔE76 from white above which a pixel is ink. The shipped model's backgrounds stay below ~4
# (99.9% of their pixels); Gaussian grain of sigma 8 RGB puts ~24% of a white image above 5.
BACKGROUND_DELTA_E = 5.0
# Palette hues (around the grey axis) are >= 26 degrees apart (orange to yellow); core pixels
# take the nearest one, and an object whose mean hue is farther than this from its color's hue
# has an off-palette color (magenta between red and purple, 36 degrees from each).
HUE_TOLERANCE_DEG = 20.0
# A core pixel carries at least this fraction of its palette color's chroma: an edge pixel at
# half coverage or a fill shaded to half its brightness still counts, a pale tint does not.
CORE_CHROMA = 0.5
# The palette's colors are saturated: at least MIN_FULL_FRACTION of an object's core pixels carry
# FULL_CHROMA of its color's chroma. A muted tone of the same hue is another color to a judge (orange
# darkened to brown, yellow to olive, red paled to pink or salmon, blue to navy or sky blue): none of
# its pixels reach it. Softened renders keep >= 0.75 of their core pixels there, a triangle shaded in
# two tones (a part 0.6-0.85 as bright) >= 0.29, the DiffusionNFT checkpoint's objects >= 0.68 (99%).
FULL_CHROMA = 0.75
MIN_FULL_FRACTION = 0.2
# ---- objects (pixel counts at 64x64, scaled with the image area)
MIN_OBJECT_PX = 20  # the smallest rendered shape has ~60 px; fewer core pixels are a speck
# Soft edges: ink within this many pixels of an object's core belongs to it (the shipped model
# leaves faint echo lines of an edge 3 px out).
RIM_PX = 3
# ... unless it lies within OTHER_EDGE_PX of another object's core: the neighbour's soft edge. Two shapes 2 px
# apart saved as JPEG (quality 75-90) read as concave in a third of the images with it counted.
OTHER_EDGE_PX = 1
MAX_MATCHED = 8  # only the largest detections take part in the assignment search
# ---- stray ink (outside every object's rim)
# A mark is a stray connected blob with MARK_PX pixels above MARK_DELTA_E, or FAINT_MARK_PX pixels
# in all. The shipped model leaves faint isolated grain (ΔE 5-8) and the odd 1-2 px dot.
MARK_DELTA_E = 12.0
MARK_PX = 4
FAINT_MARK_PX = 24
# Stray ink outside marks above this fraction of the image is a dirty background: 61 px at 64x64;
# the shipped model's samples reach 46 px of isolated grain, sigma 4 RGB grain ~110 px.
STRAY_LIMIT = 0.015
# So is stray ink over this fraction, marks or not (a dither merges into image-wide blobs); 25
# specks of 3x3 px, blurred, cover ~13%.
BACKGROUND_LIMIT = 0.20
# JPEG (quality 75-90, chroma at half resolution in 16 px blocks) rings around an object's edges: past its
# rim, faint ink (median ΔE 6, 99% under 13, at most ~20) up to 15 px out, 60 px an image of four objects.
# Ink within HALO_PX of an object and at most HALO_DELTA_E from white is its halo, not stray. Grey marks of
# ΔE >= 19 (200 grey), palette ghosts at 25% opacity (>= 21) and the far parts of pale blobs still are.
# ... unless it is a blot: a faint smudge beside an object (6-10 px of ΔE 12-16, 4-6 px out) is no ringing.
# Stray ink that fills 3x3 squares over at least BLOT_PX pixels (at 64x64) stays stray.
# ... nor is ink darker than white by over HALO_LIGHTNESS (L*): JPEG rings in chroma, its lightness stays within
# 11 of white (600 images, quality 75-90), while a grey speck of 2x2 px at ΔE 14-18 beside an object, a mark
# anywhere else, passed there 97% of the time.
# JPEG rings only inside the blocks an edge crosses (chroma in JPEG_BLOCK_PX tiles from the top left, at 4:2:0):
# of 13,284 halo pixels of 300 JPEG-compressed renders, 4 lay in a tile holding none of the objects' ink or rims,
# while a pale tint speck 5-12 px from an object but in another tile passed as halo (2x2 px, ΔE 18: 0.96 -> 0.68).
HALO_PX = 12
BLOT_PX = 24
JPEG_BLOCK_PX = 16
HALO_DELTA_E = 18.0
HALO_LIGHTNESS = 12.0
STRAY_ZERO_CREDIT = 0.10  # partial credit fades from STRAY_LIMIT to 0 here
# In the crisp score, each mark keeps this share of the credit: a mark fails the image strictly, but one too
# small to move the stray fraction (a 33 px mark is 0.8% of 64x64) leaves the partial credit whole. The partial
# credit itself does not charge marks: on the CPU demo (4 steps) charging them took the held-out gain of
# `make demo` from 0.429 -> 0.588 to none (JOURNAL.md).
MARK_CREDIT = 0.8
# ---- shapes
# Softened renders score >= 0.90 with a lead of >= 0.08; the shipped model's fair shapes score
# >= ~0.80 with leads >= ~0.03; an inverted triangle ~0.66; a diamond with rounded vertices is
# a diamond or between a diamond and a circle (lead < 0.03), never a clean circle.
MIN_IOU = 0.78  # the best template's soft IoU with the object
# Coverage under COVERAGE_FLOOR is left out of the template fit (moments and overlaps): so faint a fringe is no
# part of the outline a judge sees, yet it lowers every template's overlap alike. JPEG's half-resolution chroma
# spreads a small (11-15 px) yellow or orange shape 1-2 px out at 0.05-0.2 coverage; with that fringe counted, 2%
# of JPEG-compressed counting renders (quality 75-90) fell between a circle and a square or a diamond.
COVERAGE_FLOOR = 0.1
MIN_MARGIN = 0.03  # ... and its lead over the second-best template
# ... unless a diamond leads a circle with less, yet its outline has a diamond's four corners on the axes (a 4-fold
# ripple over MAX_CIRCLE_TILT, which no circle may have): a small diamond whose vertices JPEG's half-resolution
# chroma rounds (11-15 px, yellow or orange). Diamonds with rounded vertices pass as diamonds as often as before
# (95% of 240); a circle prompt still fails them.
# The crisp score (`Verdict.crisp_score`, reward `shapes_crisp`) grades a passing shape by its lead: full credit
# from the renders' lead of CRISP_LEAD, CRISP_FLOOR at none, so that RL keeps sharpening shapes that barely pass.
CRISP_LEAD = 0.08
CRISP_FLOOR = 0.9
# A triangle may stand tilted: its template is also tried turned about the centroid, in steps of TILT_STEP_DEG
# either way while the overlap grows, up to MAX_TRIANGLE_TILT_DEG; so softened renders tilted by up to 32 degrees
# pass (35: 0.29). An inverted triangle (180 degrees) fails, and so does one turned by up to 22 degrees; turned 27
# or more (w = h), it stands on a vertex under 30 degrees off the vertical, as a triangle tilted that far does.
TILT_STEP_DEG = 5.0
MAX_TRIANGLE_TILT_DEG = 25.0
# Width / height (either way) fitted for the best template: a 4:3 box still passes for a square
# (the model's are up to ~1.25; a circle must also be round, see MAX_CIRCLE_ELONGATION), a tall or flat
# triangle is still a triangle.
MAX_ASPECT = 1.3
MAX_TRIANGLE_ASPECT = 1.5
# A circle is round: the root of the ratio of its principal second moments (at any turn, unlike the aspect)
# stays under this. Softened and JPEG-compressed renders stay under 1.06, the DiffusionNFT checkpoint's
# passing circles under 1.13 (99%, 1.16 at most); two disks of one color merged into
# one blob (a peanut, a snowman: the smaller's diameter 40-80% inside the larger, radii 0.7-1 apart) score
# >= 1.16 even at 80% overlap. Over this a "circle" is an oval.
MAX_CIRCLE_ELONGATION = 1.15
MAX_SKEW = 0.2  # |correlation| of x and y over the object: a tilted, stretched blob
# Missing pixels well inside the object's convex hull over its area, at twice the resolution:
# softened renders stay under ~0.03 (99%), the shipped model's circles, squares and diamonds
# under 0.05; a plus with arms 1/4 of its span or wider scores >= 0.064, an L, a star or a ring
# more. A triangle's apex is a pixel or two wide, so its ragged sides leave more (the model's
# reach 0.09); a concave blob that best fits a triangle still fails on overlap.
MAX_CONCAVITY = 0.05
MAX_TRIANGLE_CONCAVITY = 0.12
# A circle's outline has no corners. Its radius by direction (from the area in each of
# `_OUTLINE_BINS` sectors about the centroid), as a Fourier series: a k-fold ripple of relative
# amplitude a tilts the outline off the circle's tangent by up to a * k radians. Over k = 3..8
# (k = 2 is the aspect's) and ripples of at least MIN_RIPPLE_PX (the pixel grid's own ripple on
# renders of 11-15 px circles reaches ~0.22 px at k = 7, tilt 0.25), renders stay under ~0.15 and
# the DiffusionNFT checkpoint's roundish circles under 0.2; a regular pentagon scores >= 0.29, a
# hexagon >= 0.23 (but for the smallest), a square turned 15-30 degrees >= 0.5 (each matches the
# circle template best). Over this a "circle" is cornered: a polygon, a turned square, a squircle,
# a teardrop.
MAX_CIRCLE_TILT = 0.2
MIN_RIPPLE_PX = 0.25
# A triangle's apex is sharp. Its top APEX_MASS of coverage (whole rows from the top, the template's apex
# end; coverage under APEX_FLOOR left out, so that a faint halo does not widen it) spreads across a
# triangle's width at that depth, sqrt(APEX_MASS) ~ 0.24 of the base, less the apex's blur (APEX_BLUR_PX2,
# px^2 at 64x64: a bar about 4 px wide counts as a point); as a fraction of the fitted base: renders
# (crisp and softened, 11-22 px at 64, and at 128) stay under 0.1, two-tone triangles under 0.15, the
# kept DiffusionNFT checkpoint's triangles under 0.14 (a model's small triangle with a rounded tip, 0.22,
# still passes); a trapezoid whose flat top is 30% of its base scores >= 0.33, a triangle cut 30% down
# >= 0.25, two triangles side by side overlapping 70% (an M-shaped top) >= 0.47. Over this a "triangle"
# is blunt: it has no apex. A triangle fitted turned is measured in rows of its template's turned frame, and a
# step (TILT_STEP_DEG) either way, the widest: softened renders tilted 0-33 degrees stay under 0.19, trapezoids
# and cut triangles turned 0-30 degrees score >= 0.30 (99%), fitted a step off their own turn or not.
APEX_MASS = 0.06
APEX_FLOOR = 0.35
APEX_BLUR_PX2 = 1.25
MAX_APEX_WIDTH = 0.24
# No palette shape has a hole. A pocket that an object's core pixels enclose, as much coverage as it lacks
# (px at 64x64, scaled with the image area: a white pixel 1, a pale one less, a dark shade none), is a hole
# over this: a 2x2 white hole in a fill scores >= 2.7 softened, 3x3 >= 7, 4x4 >= 13 (often under
# MAX_CONCAVITY: it passed); renders enclose none, DiffusionNFT checkpoints' and the shipped model's objects
# none over 1.2 (of 2,505 images). Pockets up to TEXTURE_HOLE_PX also count as fill for the texture check.
MAX_HOLE_PX = 2.0
# ---- texture (over the object's interior: its core, small holes filled, less a 1-pixel edge per 64 px)
# Mean zig-zag of a fill in ΔE76 per step (see `_zigzag`); a checkerboard of two shades ΔE apart
# with cells of 1-4 px scores about ΔE. Softened renders and two-tone triangles stay under 2; of
# 4,463 objects drawn by the shipped model and three DiffusionNFT checkpoints, 99% score under 4.5
# and 6 over 7 (small mottled blotches); of 3,143 drawn by two Flow-GRPO checkpoints, whose fills
# are dithered, half score over 18 and 95% over 8.3 (under 7: small triangles, a few windows each).
TEXTURE_DELTA_E = 7.0
# JPEG's half-resolution chroma ripples inside a fill near its edges with a period of ~8 px: ΔE up to 13 at
# strides 3-4, as chroma alone (lightness stays under 3). At those strides chroma weighs WIDE_CHROMA_WEIGHT,
# and a stride counts only where the interior spans MIN_PATTERN_CELLS cells of it (a pattern, not shading):
# JPEG-compressed renders then score under 5.5, checkerboard fills of 12-24 ΔE over 9.
WIDE_STRIDE = 3
WIDE_CHROMA_WEIGHT = 0.7
MIN_PATTERN_CELLS = 4
# Pockets of non-core pixels inside an object up to this size (at 64x64) are part of its fill:
# dither pixels too light or off its hue to be core. A ring's hole (>= ~30 px) is no fill.
TEXTURE_HOLE_PX = 12
# Objects with fewer windows are judged as if the missing ones were flat: a tiny object's one or
# two windows (its noise, an edge pixel) cannot fail it alone, a dithered one still fails.
TEXTURE_MIN_WINDOWS = 8

_COLOR_NAMES = tuple(COLORS)
_PALETTE = np.array(list(COLORS.values()), dtype=np.float32)
_WHITE = np.array(BACKGROUND, dtype=np.float32)
# Orthonormal basis of the plane perpendicular to the grey axis: a color's chroma lives there.
# Being orthogonal to grey, it maps a color and the color minus its grey part alike.
_CHROMA_BASIS = np.ascontiguousarray(
    (np.array([[1, -1, 0], [1, 1, -2]]) / np.array([[np.sqrt(2)], [np.sqrt(6)]])).T, dtype=np.float32)
_PALETTE_CHROMA = _PALETTE @ _CHROMA_BASIS
_PALETTE_CHROMA_NORM = np.linalg.norm(_PALETTE_CHROMA, axis=1)
_PALETTE_HUE = _PALETTE_CHROMA / _PALETTE_CHROMA_NORM[:, None]  # unit vectors
_CHROMA_BASIS_T = np.ascontiguousarray(_CHROMA_BASIS.T)
# Nearest palette hue per bin of hue angle (a lookup is much cheaper than an argmax per pixel).
_HUE_BINS = 1440
_BIN_ANGLES = (np.arange(_HUE_BINS) + 0.5) * (2 * np.pi / _HUE_BINS) - np.pi
_HUE_LUT = np.argmax(np.stack([np.cos(_BIN_ANGLES), np.sin(_BIN_ANGLES)], 1) @ _PALETTE_HUE.T, axis=1)
_CORE_CHROMA_SQ = (CORE_CHROMA * _PALETTE_CHROMA_NORM) ** 2
_FULL_CHROMA_SQ = (FULL_CHROMA * _PALETTE_CHROMA_NORM) ** 2
_COS_TOLERANCE = float(np.cos(np.radians(HUE_TOLERANCE_DEG)))
# sRGB -> linear light, per 8-bit value; then linear RGB -> CIE XYZ relative to the D65 white.
_SRGB_LINEAR = np.array(
    [v / 12.92 if v <= 0.04045 else ((v + 0.055) / 1.055) ** 2.4 for v in np.arange(256) / 255], dtype=np.float32
)
_RGB_TO_XYZ_WHITE = (
    np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]], dtype=np.float32)
    / np.array([0.4124 + 0.3576 + 0.1805, 1.0, 0.0193 + 0.1192 + 0.9505], dtype=np.float32)[:, None]
).T
# Variance of each filled shape along x and y as a fraction of its box width^2 and height^2.
_VARIANCE_FRACTION = {
    "circle": (1 / 16, 1 / 16),
    "square": (1 / 12, 1 / 12),
    "triangle": (1 / 24, 1 / 18),
    "diamond": (1 / 24, 1 / 24),
}
_MIN_VARIANCE = 0.05
_TRIANGLE = SHAPES.index("triangle")
_EIGHT_CONNECTED = np.ones((3, 3), dtype=bool)
_OUTLINE_BINS = 48
_OUTLINE_HARMONICS = np.arange(3, 9)
_OUTLINE_SUBSAMPLE = 4  # samples per pixel side for the sector areas
_OUTLINE_OFFSETS = ((np.arange(_OUTLINE_SUBSAMPLE) + 0.5) / _OUTLINE_SUBSAMPLE).astype(np.float32)
_OUTLINE_ANGLES = (np.arange(_OUTLINE_BINS) + 0.5) * (2 * np.pi / _OUTLINE_BINS) - np.pi
_AXIS_COS4, _AXIS_SIN4 = np.cos(4 * _OUTLINE_ANGLES), np.sin(4 * _OUTLINE_ANGLES)
_ZIGZAG_STRIDES = (1, 2, 3, 4)  # pixels between the samples of a texture window: cells of 1-4 px
_ZIGZAG_OFFSETS = tuple(sorted(set(_ZIGZAG_STRIDES) | {2 * k for k in _ZIGZAG_STRIDES}))
_ZIGZAG_ONCE = [_ZIGZAG_OFFSETS.index(k) for k in _ZIGZAG_STRIDES]  # rows of offsets k and 2k
_ZIGZAG_TWICE = [_ZIGZAG_OFFSETS.index(2 * k) for k in _ZIGZAG_STRIDES]
# (f(X), f(Y), f(Z)) -> (L* + 16, a*, b*)
_F_TO_LAB = np.array([[0, 500, 0], [116, -500, 200], [0, 0, -200]], dtype=np.float32)


@dataclass(frozen=True)
class DetectedObject:
    shape: str  # the best template (see `flaw`: a malformed object matches no shape)
    color: str
    centroid_xy: tuple[float, float]  # pixels, y grows downward
    area: int  # core pixels
    bbox: tuple[int, int, int, int]  # x0, y0, x1, y1 with x1, y1 exclusive
    confidence: float  # soft IoU of the object with the chosen shape's template
    lead: float = 0.0  # how far that overlap leads the second-best template's
    flaw: str | None = None  # why the object is no clean shape, e.g. "concave shape (concavity 0.21)"
    zigzag: float = 0.0  # texture of the fill: mean ΔE per pixel step off a monotone path (see `_zigzag`)

    @property
    def dithered(self) -> bool:
        return self.zigzag > TEXTURE_DELTA_E

    def description(self) -> str:
        found = f"a {self.color} {self.flaw}" if self.flaw else f"a {self.color} {self.shape}"
        return f"{found} with a dithered fill" if self.dithered else found


@dataclass(frozen=True)
class Verdict:
    score: float  # partial credit in [0, 1]
    strict: bool  # every requirement met
    # "ok", or the first failure, starting with background/stray/count/texture/shape/color/relation
    reason: str
    # Partial credit with each kind of requirement (count, shape, color, relation) weighed alike,
    # however many objects the prompt names: a wrong count costs half of "three circles", not a quarter.
    balanced_score: float
    # Half for the exact number of objects, half for the mean of the other components. Under `score`
    # an extra object costs less than one wrong shape ("three triangles" drawn as four scores 0.92,
    # three with one misshapen 0.75), so RL learns to hedge with extra objects; here the exact count
    # comes first (0.5 and 0.83).
    exact_count_score: float
    # As `score`, with each passing shape graded by how clearly it leads the second-best template (CRISP_LEAD),
    # and each stray mark charged (MARK_CREDIT)
    crisp_score: float
    # Mean ΔE76 from white of the background (outside every object's rim, not ink): a tint too faint to be ink
    # (renders 0; a faint grey or tint ~2, the least a person sees side by side) that no score charges.
    background_delta_e: float = 0.0


@dataclass(frozen=True)
class _Scene:
    objects: list[DetectedObject]  # largest first
    stray_fraction: float  # stray ink pixels over all pixels
    dirt_fraction: float  # stray ink outside marks over all pixels
    marks: list[int]  # areas of the marks (stray blobs, see MARK_PX), largest first
    background_delta_e: float  # mean ΔE76 from white of the background pixels that are not ink


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


def _lab_f(t: np.ndarray) -> np.ndarray:
    return np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)


def _delta_e_from_white(image: np.ndarray) -> np.ndarray:
    """CIELAB ΔE76 from the white background of each pixel of a uint8 [..., 3] array."""
    xyz = _SRGB_LINEAR[image] @ _RGB_TO_XYZ_WHITE  # relative to white: white is (1, 1, 1)
    fx, fy, fz = np.moveaxis(_lab_f(xyz), -1, 0)
    # White has L* = 100, a* = b* = 0, i.e. f = 1 on every axis.
    return np.sqrt((116 * (fy - 1)) ** 2 + (500 * (fx - fy)) ** 2 + (200 * (fy - fz)) ** 2)


def _lightness_below_white(image: np.ndarray) -> np.ndarray:
    """100 - L* (CIELAB) of each pixel of a uint8 [..., 3] array."""
    return 116 * (1 - _lab_f(_SRGB_LINEAR[image] @ _RGB_TO_XYZ_WHITE[:, 1]))


def _lab(image: np.ndarray) -> np.ndarray:
    """CIELAB (L*, a*, b*) of each pixel of a uint8 [..., 3] array, as float32 [..., 3]."""
    f = _lab_f(_SRGB_LINEAR[image] @ _RGB_TO_XYZ_WHITE)
    return f @ _F_TO_LAB  # L* + 16 in place of L*: only differences are taken


def _zigzag(patch: np.ndarray, inside: np.ndarray, min_windows: int) -> float:
    """How far the fill of an RGB patch is from changing monotonically along rows and columns: over
    the windows of three pixels k apart (x, x + k, x + 2k) lying in `inside`, the mean of (ΔE from
    the first to the second + ΔE from the second to the third - ΔE from the first to the third) / 2,
    at least `min_windows` windows counted; the worst over k = 1..4. 0 for a flat fill, a blend or
    a step between two shades (two-tone shading), about the ΔE between alternating shades for a
    dither or checkerboard whose cells are k pixels wide."""
    rows, cols = np.flatnonzero(inside.any(1)), np.flatnonzero(inside.any(0))
    if not len(rows):
        return 0.0
    crop = slice(rows[0], rows[-1] + 1), slice(cols[0], cols[-1] + 1)
    inside, lab = inside[crop], _lab(patch[crop])
    # The rows, then the columns, as one sequence; an outside pixel closes each line, so that no
    # valid window spans two, and an outside tail leaves room for the widest window.
    height, width = inside.shape
    n_rows, n_cols = height * (width + 1), width * (height + 1)
    size = n_rows + n_cols + _ZIGZAG_OFFSETS[-1] + _ZIGZAG_STRIDES[-1]
    line = np.zeros((3, size), dtype=np.float32)  # channels first: contiguous per channel
    line[:, :n_rows].reshape(3, height, width + 1)[:, :, :width] = lab.transpose(2, 0, 1)
    line[:, n_rows : n_rows + n_cols].reshape(3, width, height + 1)[:, :, :height] = lab.transpose(2, 1, 0)
    in_line = np.zeros(size, dtype=bool)
    in_line[:n_rows].reshape(height, width + 1)[:, :width] = inside
    in_line[n_rows : n_rows + n_cols].reshape(width, height + 1)[:, :height] = inside.T
    outside = np.zeros(size + 1, dtype=np.int32)  # outside pixels before each position
    np.cumsum(~in_line, out=outside[1:])
    n = size - _ZIGZAG_OFFSETS[-1]
    diff = np.empty((len(_ZIGZAG_OFFSETS), 3, n), dtype=np.float32)
    for j, offset in enumerate(_ZIGZAG_OFFSETS):
        np.subtract(line[:, offset : offset + n], line[:, :n], out=diff[j])
    squared = diff * diff
    lightness, chroma = squared[:, 0], squared[:, 1] + squared[:, 2]
    # ΔE to the pixel `offset` further on; for the wide strides, with chroma weighed by WIDE_CHROMA_WEIGHT
    apart = np.sqrt(lightness + chroma)
    apart_wide = np.sqrt(lightness + WIDE_CHROMA_WEIGHT**2 * chroma)
    n -= _ZIGZAG_STRIDES[-1]
    # Per stride k, at each start x: ΔE x -> x + k, x + k -> x + 2k and x -> x + 2k, and whether no
    # outside pixel lies from x to x + 2k.
    apart_of = [apart_wide if k >= WIDE_STRIDE else apart for k in _ZIGZAG_STRIDES]
    first = np.stack([a[i, :n] for a, i in zip(apart_of, _ZIGZAG_ONCE, strict=True)])
    second = np.stack([a[i, k : k + n] for a, i, k in zip(apart_of, _ZIGZAG_ONCE, _ZIGZAG_STRIDES, strict=True)])
    twice = np.stack([a[i, :n] for a, i in zip(apart_of, _ZIGZAG_TWICE, strict=True)])
    valid = np.stack([outside[2 * k + 1 : 2 * k + 1 + n] for k in _ZIGZAG_STRIDES]) == outside[:n]
    excess = np.einsum("kn,kn->k", first + second - twice, valid.astype(np.float32))
    # A stride counts where the interior spans MIN_PATTERN_CELLS cells of it: fewer are shading, not a pattern.
    excess *= MIN_PATTERN_CELLS * np.array(_ZIGZAG_STRIDES) <= max(height, width)
    return float((excess / (2 * np.maximum(np.count_nonzero(valid, axis=1), min_windows))).max())


def _surely_white() -> int:
    """The least channel value m such that every color with all channels >= m is within
    BACKGROUND_DELTA_E of white: such pixels need no Lab conversion."""
    m = 255
    while m > 0:
        values = np.arange(m - 1, 256, dtype=np.uint8)
        cube = np.stack(np.meshgrid(values, values, values, indexing="ij"), -1).reshape(-1, 3)
        if _delta_e_from_white(cube).max() > BACKGROUND_DELTA_E:
            return m
        m -= 1
    return m


_SURELY_WHITE = _surely_white()
# ΔE76 from white of every color with all channels >= _SURELY_WHITE, indexed by (channel - _SURELY_WHITE):
# the background's tint without a Lab conversion per pixel.
_NEAR_WHITE = np.arange(_SURELY_WHITE, 256, dtype=np.uint8)
_NEAR_WHITE_DELTA_E = _delta_e_from_white(
    np.stack(np.meshgrid(_NEAR_WHITE, _NEAR_WHITE, _NEAR_WHITE, indexing="ij"), -1)).astype(np.float32)


def _square_window(mask: np.ndarray, radius: int, fold) -> np.ndarray:
    """`fold` (np.logical_or or np.logical_and) of `mask` over each pixel's square window of `radius`,
    pixels outside the image counting as False: separable, a row pass then a column pass."""
    height, width = mask.shape
    padded = np.pad(mask, radius)
    rows = padded[:, :width].copy()
    for dx in range(1, 2 * radius + 1):
        fold(rows, padded[:, dx : dx + width], out=rows)
    folded = rows[:height].copy()
    for dy in range(1, 2 * radius + 1):
        fold(folded, rows[dy : dy + height], out=folded)
    return folded


def _dilate(mask: np.ndarray, radius: int) -> np.ndarray:
    """`mask` grown by `radius` pixels in every direction, diagonals included (a square window)."""
    return _square_window(mask, radius, np.logical_or)


def _erode(mask: np.ndarray, radius: int) -> np.ndarray:
    """The pixels of `mask` whose square window of `radius` lies in `mask` (outside it is not)."""
    return _square_window(mask, radius, np.logical_and)


def _blocks_holding(mask: np.ndarray, block: int) -> np.ndarray:
    """The pixels of the `block` x `block` tiles (from the image's top left) that hold any pixel of `mask`."""
    height, width = mask.shape
    rows, cols = -(-height // block), -(-width // block)
    padded = np.zeros((rows * block, cols * block), dtype=bool)
    padded[:height, :width] = mask
    tiles = padded.reshape(rows, block, cols, block).any((1, 3))
    return np.repeat(np.repeat(tiles, block, 0), block, 1)[:height, :width]


def _euler_number(mask: np.ndarray) -> int:
    """Components (8-connected) minus holes (4-connected) of `mask`, from its 2x2 neighborhoods."""
    padded = np.zeros((mask.shape[0] + 2, mask.shape[1] + 2), dtype=np.uint8)
    padded[1:-1, 1:-1] = mask
    quads = padded[:-1, :-1] + padded[1:, :-1] + padded[:-1, 1:] + padded[1:, 1:]
    diagonal = (quads == 2) & (padded[:-1, :-1] == padded[1:, 1:])
    return (np.count_nonzero(quads == 1) - np.count_nonzero(quads == 3) - 2 * np.count_nonzero(diagonal)) // 4


def _holes(objects: np.ndarray, n_objects: int, max_px: int) -> np.ndarray | None:
    """Pockets of at most `max_px` pixels that `objects` encloses (4-connected), None if none."""
    if _euler_number(objects) >= n_objects:  # at most n_objects components, so no hole at all
        return None
    pockets, n = _ndimage().label(~objects)
    small = np.bincount(pockets.ravel(), minlength=n + 1) <= max_px
    for border in (pockets[0], pockets[-1], pockets[:, 0], pockets[:, -1]):
        small[border] = False
    small[0] = False
    return small[pockets]


def _classify_pixels(image: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[H, W] index of the nearest palette hue of each core pixel (-1 elsewhere: background, soft
    edges, pale or grey ink), and the [2, H, W] chroma vectors of all pixels."""
    chroma = _CHROMA_BASIS_T @ image.reshape(-1, 3).astype(np.float32).T  # [2, N]
    angle = np.arctan2(chroma[1], chroma[0])
    index = _HUE_LUT[np.minimum(((angle + np.pi) * (_HUE_BINS / (2 * np.pi))).astype(np.intp), _HUE_BINS - 1)]
    core = chroma[0] * chroma[0] + chroma[1] * chroma[1] >= _CORE_CHROMA_SQ[index]
    return np.where(core, index, -1).reshape(image.shape[:2]), chroma.reshape(2, *image.shape[:2])


def _color_name(core_chroma: np.ndarray, color_index: int) -> str:
    """The palette color of an object whose core pixels have these [2, N] chroma vectors; when their
    mean hue is off the palette's by more than HUE_TOLERANCE_DEG, the two nearest names ("red-purple");
    when too few of them reach FULL_CHROMA of the color's chroma, "muted red" (brown, olive, pink...)."""
    mean_chroma = core_chroma.mean(1)
    cosines = _PALETTE_HUE @ mean_chroma / max(float(np.linalg.norm(mean_chroma)), 1e-6)
    if cosines[color_index] < _COS_TOLERANCE:
        first, second = np.argsort(-cosines)[:2]
        return f"{_COLOR_NAMES[first]}-{_COLOR_NAMES[second]}"
    full = np.einsum("cn,cn->n", core_chroma, core_chroma) >= _FULL_CHROMA_SQ[color_index]
    if np.count_nonzero(full) < MIN_FULL_FRACTION * full.size:
        return f"muted {_COLOR_NAMES[color_index]}"
    return _COLOR_NAMES[color_index]


def _coverage(patch: np.ndarray, color: np.ndarray) -> np.ndarray:
    """Per pixel, the fraction of `color` in a blend of `color` and the white background."""
    towards_color = _WHITE - color
    fraction = (_WHITE - patch) @ towards_color / (towards_color @ towards_color)
    return np.minimum(np.maximum(fraction, 0.0), 1.0)


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


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def _hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Convex hull (Andrew's monotone chain) of (x, y) points: vertices in the order that puts the
    interior on the positive side of cross(edge, point - edge start)."""
    points = sorted(set(points))
    if len(points) <= 2:
        return points
    lower, upper = [], []
    for p in points:
        while len(lower) >= 2 and _cross(lower[-2], lower[-1], p) <= 0:
            lower.pop()
        lower.append(p)
    for p in reversed(points):
        while len(upper) >= 2 and _cross(upper[-2], upper[-1], p) <= 0:
            upper.pop()
        upper.append(p)
    return lower[:-1] + upper[:-1]


def _chain_candidates(rows: np.ndarray, ends: np.ndarray, extreme) -> list[tuple[float, float]]:
    """The row ends (x, y) that can be vertices of the hull's left (extreme=np.minimum) or right
    (np.maximum) side: from the top row down to the extreme, and from the bottom row up to it, a
    hull vertex always sets a new record. Fewer points make the hull cheap."""
    from_top = np.empty(len(ends), dtype=bool)
    from_top[0] = True
    from_top[1:] = extreme(ends[1:], extreme.accumulate(ends)[:-1]) != extreme.accumulate(ends)[:-1]
    from_bottom = np.empty(len(ends), dtype=bool)
    from_bottom[-1] = True
    reversed_record = extreme.accumulate(ends[::-1])[::-1]
    from_bottom[:-1] = extreme(ends[:-1], reversed_record[1:]) != reversed_record[1:]
    keep = from_top | from_bottom
    return list(zip(ends[keep].astype(float).tolist(), rows[keep].astype(float).tolist()))


def _concavity(mask: np.ndarray) -> float:
    """Pixels missing from `mask` at least one pixel inside its convex hull, over its area: ~0 for
    a convex shape however blurred (its ragged edge stays within a pixel of the hull); large for
    a ring, a plus, an L or a star."""
    height, width = mask.shape
    rows = np.flatnonzero(mask.any(1))
    if len(rows) < 3:
        return 0.0
    sub = mask[rows]
    left = sub.argmax(1)
    right = width - 1 - sub[:, ::-1].argmax(1)
    hull = _hull(_chain_candidates(rows, left, np.minimum) + _chain_candidates(rows, right, np.maximum))
    if len(hull) < 3:
        return 0.0
    # Pixel centers (x, y) at least one pixel inside every hull edge (x0, y0) + t (dx, dy):
    # dx (y - y0) - dy (x - x0) >= |edge|. Per row y that bounds x from below (edges with dy < 0),
    # from above (dy > 0), or keeps or drops the whole row (dy = 0).
    start = np.array(hull)
    dx, dy = (np.roll(start, -1, axis=0) - start).T
    ys = np.arange(height, dtype=np.float64)
    rest = np.outer(dx, ys) + (dy * start[:, 0] - dx * start[:, 1] - np.hypot(dx, dy))[:, None]
    up, down, flat = dy < 0, dy > 0, dy == 0
    if not up.any() or not down.any():
        return 0.0
    lo = np.ceil((rest[up] / dy[up, None]).max(0)).clip(0, width).astype(np.intp)
    hi = np.floor((rest[down] / dy[down, None]).min(0)).clip(-1, width - 1).astype(np.intp)
    valid = (hi >= lo) & (rest[flat] >= 0).all(0)
    missing = np.zeros((height, width + 1))
    np.cumsum(~mask, axis=1, out=missing[:, 1:])
    rows_in = np.flatnonzero(valid)
    count = (missing[rows_in, hi[rows_in] + 1] - missing[rows_in, lo[rows_in]]).sum()
    return float(count / max(mask.sum(), 1))


def _upsample2(alpha: np.ndarray) -> np.ndarray:
    """`alpha` at twice the resolution, each new pixel the mean of the 2x2 nearest samples."""
    doubled = np.pad(alpha.repeat(2, 0).repeat(2, 1), 1, mode="edge")
    return (doubled[:-1, :-1] + doubled[1:, :-1] + doubled[:-1, 1:] + doubled[1:, 1:]) / 4


@dataclass(frozen=True)
class _ShapeFit:
    ious: np.ndarray  # soft IoU with each shape of SHAPES
    aspect: float  # fitted width / height of the best template, >= 1
    elongation: float  # the root of the ratio of the principal second moments, >= 1: 1 for a disk at any turn
    skew: float  # |correlation| of x and y over the object
    concavity: float
    centroid: tuple[float, float]  # patch coordinates
    # circle fits only: the outline's largest tilt off a circle (radians, see MAX_CIRCLE_TILT) and its fold k
    outline_tilt: float = 0.0
    outline_fold: int = 0
    # a diamond's fit whose lead over the circle is small: whether its outline has a diamond's corners
    diamond_corners: bool = False
    # triangle fits only: the width of its top over its base (see MAX_APEX_WIDTH)
    apex_width: float = 0.0
    hole_px: float = 0.0  # the largest hole's missing coverage, at 64x64 (see MAX_HOLE_PX)

    def best(self) -> tuple[int, int]:
        order = np.argsort(-self.ious)
        return int(order[0]), int(order[1])

    def flaw(self) -> str | None:
        """Why this is no clean shape, or None."""
        best, second = self.best()
        if self.aspect > (MAX_TRIANGLE_ASPECT if SHAPES[best] == "triangle" else MAX_ASPECT):
            return f"stretched shape (aspect {self.aspect:.2f})"
        if self.skew > MAX_SKEW:
            return f"slanted shape (x-y correlation {self.skew:.2f})"
        if SHAPES[best] == "circle" and self.elongation > MAX_CIRCLE_ELONGATION:
            return f"oval shape (its axes {self.elongation:.2f}:1, not round)"
        if self.concavity > (MAX_TRIANGLE_CONCAVITY if SHAPES[best] == "triangle" else MAX_CONCAVITY):
            return f"concave shape (concavity {self.concavity:.2f})"
        if self.hole_px > MAX_HOLE_PX:
            return f"holed shape (a hole of {self.hole_px:.0f} px)"
        if self.ious[best] < MIN_IOU:
            return f"shape like no template (best {SHAPES[best]}, overlap {self.ious[best]:.2f})"
        if self.ious[best] - self.ious[second] < MIN_MARGIN and not self.diamond_corners:
            return (f"shape between a {SHAPES[best]} and a {SHAPES[second]} "
                    f"(overlap {self.ious[best]:.2f} vs {self.ious[second]:.2f})")
        if self.outline_tilt > MAX_CIRCLE_TILT:
            return f"cornered shape ({self.outline_fold}-fold outline, tilt {self.outline_tilt:.2f} rad off a circle)"
        if self.apex_width > MAX_APEX_WIDTH:
            return f"blunt shape (its top {self.apex_width:.2f} of its base wide, not an apex)"
        return None


def _elongation(var_x: float, var_y: float, cov_xy: float) -> float:
    """sqrt(largest / smallest principal variance) of a covariance [[var_x, cov_xy], [cov_xy, var_y]]."""
    mean, spread = (var_x + var_y) / 2, float(np.hypot((var_x - var_y) / 2, cov_xy))
    return float(np.sqrt((mean + spread) / max(mean - spread, 1e-9)))


def _triangle_fit(alpha: np.ndarray, x: np.ndarray, y: np.ndarray, var_x: float, var_y: float, cov_xy: float,
                  degrees: float) -> tuple[float, float, float]:
    """The soft IoU of `alpha` with the triangle template turned by `degrees` about the centroid (x, y: pixel
    centers relative to it), sized from the variances in the turned frame; and its squared width and height."""
    cos, sin = float(np.cos(np.radians(degrees))), float(np.sin(np.radians(degrees)))
    fraction_x, fraction_y = _VARIANCE_FRACTION["triangle"]
    width_sq = max(cos * cos * var_x + 2 * cos * sin * cov_xy + sin * sin * var_y, _MIN_VARIANCE) / fraction_x
    height_sq = max(sin * sin * var_x - 2 * cos * sin * cov_xy + cos * cos * var_y, _MIN_VARIANCE) / fraction_y
    distance = _signed_distance("triangle", cos * x + sin * y, cos * y - sin * x, np.sqrt(width_sq), np.sqrt(height_sq))
    template = np.minimum(np.maximum(0.5 - distance, 0.0), 1.0)
    return float(np.minimum(template, alpha).sum() / np.maximum(template, alpha).sum()), width_sq, height_sq


def _tilted_triangle_fit(alpha: np.ndarray, x: np.ndarray, y: np.ndarray, var_x: float, var_y: float,
                         cov_xy: float, upright: float) -> tuple[float, float, float, float]:
    """The triangle template's best turn by a hill climb from upright (whose IoU is `upright`): TILT_STEP_DEG
    either way, then on in the better direction while the IoU grows, up to MAX_TRIANGLE_TILT_DEG. Returns
    (IoU, degrees, squared width, squared height); degrees 0.0 (and no sides) if no turn beats upright."""
    best = (upright, 0.0, 0.0, 0.0)
    for direction in (1.0, -1.0):
        degrees = direction * TILT_STEP_DEG
        while abs(degrees) <= MAX_TRIANGLE_TILT_DEG:
            iou, width_sq, height_sq = _triangle_fit(alpha, x, y, var_x, var_y, cov_xy, degrees)
            if iou <= best[0]:
                break
            best = (iou, degrees, width_sq, height_sq)
            degrees += direction * TILT_STEP_DEG
        if best[1] != 0.0:  # the overlap grew this way, so it falls the other way
            break
    return best


def _fit_shape(alpha: np.ndarray, scale: float = 1.0, core: np.ndarray | None = None) -> _ShapeFit:
    """Template overlaps and form measures of a coverage map.

    Templates are sized from alpha's second moments rather than the mask's bounding box: the
    sharp vertices of diamonds and triangles fall below half coverage, so the bounding box of
    the mask is too small for them. Width and height are fitted apart, so that a slightly tall
    square stays nearer the square than the circle; the aspect is then checked on its own.
    `scale` is the image's side over 64 px (the apex's blur grows with it); `core`, the object's core
    pixels (one 8-connected component), whose holes are measured.
    """
    height, width = alpha.shape
    xs, ys = np.arange(width) + 0.5, np.arange(height) + 0.5
    # The templates are fitted without the faint fringe (JPEG's blurred chroma), see COVERAGE_FLOOR.
    solid = np.where(alpha >= COVERAGE_FLOOR, alpha, 0.0) if COVERAGE_FLOOR else alpha
    col, row = solid.sum(0), solid.sum(1)
    mass = col.sum()
    cx, cy = col @ xs / mass, row @ ys / mass
    dx, dy = xs - cx, ys - cy
    # Box-averaging into pixels adds 1/12 px^2 of variance; floor at a sliver's variance.
    var_x = max(col @ dx**2 / mass - 1 / 12, _MIN_VARIANCE)
    var_y = max(row @ dy**2 / mass - 1 / 12, _MIN_VARIANCE)
    cov_xy = float(dy @ solid @ dx / mass)
    x, y = dx[None, :], dy[:, None]
    squared_sides, distances = [], []
    for shape in SHAPES:
        fraction_x, fraction_y = _VARIANCE_FRACTION[shape]
        width_sq, height_sq = var_x / fraction_x, var_y / fraction_y
        squared_sides.append((width_sq, height_sq))
        distances.append(_signed_distance(shape, x, y, np.sqrt(width_sq), np.sqrt(height_sq)))
    templates = np.minimum(np.maximum(0.5 - np.stack(distances), 0.0), 1.0)  # ~ pixel coverage at that distance
    ious = np.minimum(templates, solid).sum((1, 2)) / np.maximum(templates, solid).sum((1, 2))
    turn = 0.0  # the triangle template's, degrees
    if ious.argmax() == _TRIANGLE or ious.max() < MIN_IOU:  # a triangle, perhaps tilted
        tilted, turn, width_sq, height_sq = _tilted_triangle_fit(solid, x, y, var_x, var_y, cov_xy, ious[_TRIANGLE])
        if turn:
            ious[_TRIANGLE], squared_sides[_TRIANGLE] = tilted, (width_sq, height_sq)
    width_sq, height_sq = squared_sides[int(ious.argmax())]
    best = SHAPES[int(ious.argmax())]
    tilt, fold = _outline_tilt(alpha, float(cx), float(cy)) if best == "circle" else (0.0, 0)
    order = np.argsort(-ious)
    cornered = (best == "diamond" and SHAPES[int(order[1])] == "circle" and ious[order[0]] - ious[order[1]] < MIN_MARGIN
                and _diamond_corners(alpha, float(cx), float(cy)))
    apex = 0.0
    if best == "triangle":
        if not turn:
            apex = _apex_width(alpha, APEX_BLUR_PX2 * scale**2) / np.sqrt(width_sq)
        else:  # in the template's frame, and a step either way, the widest: a flat top a step off still shows
            apex = max(_turned_apex_width(alpha, np.cos(a) * x + np.sin(a) * y, np.cos(a) * y - np.sin(a) * x,
                                          APEX_BLUR_PX2 * scale**2)
                       for a in np.radians(turn + TILT_STEP_DEG * np.array([-1.0, 0.0, 1.0]))) / np.sqrt(width_sq)
    return _ShapeFit(
        ious=ious,
        aspect=float(np.sqrt(max(width_sq, height_sq) / min(width_sq, height_sq))),
        elongation=_elongation(var_x, var_y, cov_xy),
        skew=float(abs(cov_xy) / np.sqrt(var_x * var_y)),
        # At twice the resolution (bilinear), a small plus's notches keep pixels a step inside its hull.
        concavity=_concavity(_upsample2(alpha) >= 0.5),
        centroid=(float(cx), float(cy)),
        outline_tilt=tilt,
        outline_fold=fold,
        diamond_corners=cornered,
        apex_width=float(apex),
        hole_px=0.0 if core is None else _hole_px(core, alpha) / scale**2,
    )


def _hole_px(core: np.ndarray, alpha: np.ndarray) -> float:
    """The largest missing coverage (px, the sum of 1 - alpha) of a pocket (4-connected) that `core`, one
    8-connected component, encloses; 0.0 if it encloses none."""
    if _euler_number(core) >= 1:  # one component less its holes
        return 0.0
    pockets, n = _ndimage().label(~core)
    missing = np.bincount(pockets.ravel(), weights=(1 - alpha).ravel(), minlength=n + 1)
    for border in (pockets[0], pockets[-1], pockets[:, 0], pockets[:, -1]):
        missing[border] = 0.0
    missing[0] = 0.0
    return float(missing.max())


def _apex_width(alpha: np.ndarray, blur_var: float) -> float:
    """The width (px) of the top APEX_MASS of a coverage map's mass (coverage under APEX_FLOOR left out;
    whole rows from the top, the last one in part), as a triangle's width from its variance across, after
    taking off `blur_var` (px^2): the width of a triangle's base at that depth, sqrt(APEX_MASS) of it, less
    the blur; about as wide as its flat top for a trapezoid, as the two tips' distance for two triangles
    side by side."""
    kept = np.where(alpha >= APEX_FLOOR, alpha, 0.0)
    row = kept.sum(1)
    cumulative = np.cumsum(row)
    need = APEX_MASS * cumulative[-1]
    k = int(np.searchsorted(cumulative, need))
    weights = np.ones(k + 1)
    weights[k] = (need - (cumulative[k - 1] if k else 0.0)) / row[k]
    col = weights @ kept[: k + 1]
    xs = np.arange(alpha.shape[1]) + 0.5
    mass = col.sum()
    mean = col @ xs / mass
    return float(np.sqrt(24 * max(col @ (xs - mean) ** 2 / mass - blur_var, 0.0)))


def _turned_apex_width(alpha: np.ndarray, across: np.ndarray, depth: np.ndarray, blur_var: float) -> float:
    """As `_apex_width` in a turned frame (`across` and `depth`: each pixel's coordinates in it, depth growing
    away from the apex): whole rows of that frame (bands of depth 1 px wide) from the top, the last one in part."""
    kept = np.where(alpha >= APEX_FLOOR, alpha, 0.0).ravel()
    inside = kept > 0
    mass = kept[inside]
    depth = np.broadcast_to(depth, alpha.shape).ravel()[inside]
    across = np.broadcast_to(across, alpha.shape).ravel()[inside]
    band = (depth - depth.min()).astype(np.intp)
    row = np.bincount(band, weights=mass)
    cumulative = np.cumsum(row)
    need = APEX_MASS * cumulative[-1]
    k = int(np.searchsorted(cumulative, need))
    weights = np.where(band <= k, mass, 0.0)
    weights[band == k] *= (need - (cumulative[k - 1] if k else 0.0)) / row[k]
    mean = weights @ across / need
    return float(np.sqrt(24 * max(weights @ (across - mean) ** 2 / need - blur_var, 0.0)))


def _outline_radius(alpha: np.ndarray, cx: float, cy: float) -> np.ndarray:
    """The radius of a coverage map about (cx, cy) in each of `_OUTLINE_BINS` directions (from -pi), as the
    root of the area in its sector, sampled `_OUTLINE_SUBSAMPLE` times per pixel side."""
    rows, cols = np.nonzero(alpha)
    dy, dx = (v.ravel() for v in np.meshgrid(_OUTLINE_OFFSETS, _OUTLINE_OFFSETS, indexing="ij"))
    angle = np.arctan2((rows - cy).astype(np.float32)[:, None] + dy, (cols - cx).astype(np.float32)[:, None] + dx)
    sector = ((angle + np.pi) * (_OUTLINE_BINS / (2 * np.pi))).astype(np.intp) % _OUTLINE_BINS
    weight = np.repeat(alpha[rows, cols].astype(np.float64), len(dx))
    return np.sqrt(np.bincount(sector.ravel(), weights=weight, minlength=_OUTLINE_BINS))


def _diamond_corners(alpha: np.ndarray, cx: float, cy: float) -> bool:
    """Whether the outline of a coverage map has a diamond's four corners: a 4-fold ripple of its radius that
    tilts it more than MAX_CIRCLE_TILT off a circle (a circle has none) and peaks within 11 degrees of the axes
    (a square's peaks lie between them)."""
    radius = _outline_radius(alpha, cx, cy)
    tilt, fold = _outline_tilt(alpha, cx, cy)
    along, across = radius @ _AXIS_COS4, radius @ _AXIS_SIN4
    return fold == 4 and tilt > MAX_CIRCLE_TILT and along > abs(across)


def _outline_tilt(alpha: np.ndarray, cx: float, cy: float) -> tuple[float, int]:
    """The largest tilt (radians) of a k-fold ripple (k = 3..8) of the outline of a coverage map off
    a circle about (cx, cy), and its k: the radius by direction is the root of the area in each
    sector, sampled `_OUTLINE_SUBSAMPLE` times per pixel side; a ripple r = R (1 + a cos k theta)
    tilts the outline by up to a * k. Ripples under MIN_RIPPLE_PX count as none (0.0, 3)."""
    spectrum = np.abs(np.fft.rfft(_outline_radius(alpha, cx, cy)))
    ripple = 2 * spectrum[_OUTLINE_HARMONICS] / max(spectrum[0], 1e-9)  # relative amplitude per k
    # Ripples under MIN_RIPPLE_PX (px, about the mean radius) are the pixel grid's, not the shape's.
    visible = ripple * np.sqrt(alpha.sum() / np.pi) >= MIN_RIPPLE_PX
    tilt = np.where(visible, ripple * _OUTLINE_HARMONICS, 0.0)
    k = int(tilt.argmax())
    return float(tilt[k]), int(_OUTLINE_HARMONICS[k])


def _describe_component(image: np.ndarray, chroma: np.ndarray, objects: np.ndarray, labels: np.ndarray,
                        label: int, box: tuple[slice, slice], color_index: int, rim: int,
                        holes: np.ndarray | None, edge: int, min_windows: int) -> DetectedObject:
    mask = labels[box] == label
    interior = _erode(mask if holes is None else mask | holes[box], edge)
    # A margin of `rim` pixels takes in the soft edge pixels that the core leaves out.
    top, left = max(box[0].start - rim, 0), max(box[1].start - rim, 0)
    pad = (slice(top, box[0].stop + rim), slice(left, box[1].stop + rim))
    own = labels[pad] == label
    owned = own | ~objects[pad]  # other objects' pixels are not ours
    if OTHER_EDGE_PX:  # nor their soft edges (a neighbour's edge within our rim reads as a sliver of ours)
        top1, left1 = max(top - OTHER_EDGE_PX, 0), max(left - OTHER_EDGE_PX, 0)
        grown = (slice(top1, pad[0].stop + OTHER_EDGE_PX), slice(left1, pad[1].stop + OTHER_EDGE_PX))
        other = objects[grown] & (labels[grown] != label)
        if other.any():
            near_other = _dilate(other, OTHER_EDGE_PX)[top - top1 :, left - left1 :][: own.shape[0], : own.shape[1]]
            owned &= own | ~near_other
    alpha = _coverage(image[pad].astype(np.float32), _PALETTE[color_index]) * owned
    alpha[own] = 1.0  # shaded core pixels are full coverage whatever their lightness
    fit = _fit_shape(alpha, image.shape[0] / 64, own)
    best, second = fit.best()
    cx, cy = fit.centroid
    return DetectedObject(
        shape=SHAPES[best],
        color=_color_name(chroma[:, box[0], box[1]][:, mask], color_index),
        centroid_xy=(left + cx, top + cy),
        area=int(mask.sum()),
        bbox=(box[1].start, box[0].start, box[1].stop, box[0].stop),
        confidence=float(fit.ious[best]),
        lead=float(fit.ious[best] - fit.ious[second]),
        flaw=fit.flaw(),
        zigzag=_zigzag(image[box], interior, min_windows),
    )


def _analyze(image: np.ndarray) -> _Scene:
    scale = image.shape[0] * image.shape[1] / 64**2
    min_area = max(3, round(MIN_OBJECT_PX * scale))
    rim = max(RIM_PX, round(RIM_PX * image.shape[0] / 64))  # softness grows with the image
    edge = max(1, round(image.shape[0] / 64))
    min_windows = max(1, round(TEXTURE_MIN_WINDOWS * scale))
    classes, chroma = _classify_pixels(image)
    counts = np.bincount(classes[classes >= 0].ravel(), minlength=len(_COLOR_NAMES))
    components = []  # (color index, labels, label, box)
    objects = np.zeros(classes.shape, dtype=bool)
    for color_index in np.flatnonzero(counts >= min_area):
        labels, _ = _ndimage().label(classes == color_index, structure=_EIGHT_CONNECTED)
        areas = np.bincount(labels.ravel())
        for label, box in enumerate(_ndimage().find_objects(labels), start=1):
            if areas[label] >= min_area:
                components.append((int(color_index), labels, label, box))
                objects[box] |= labels[box] == label
    holes = _holes(objects, len(components), max(1, round(TEXTURE_HOLE_PX * scale)))
    found = [_describe_component(image, chroma, objects, labels, label, box, color_index, rim, holes, edge,
                                 min_windows) for color_index, labels, label, box in components]
    # Ink outside every object's rim is stray: specks, marks, pale ghosts, a dirty background.
    owned = _dilate(objects, rim)
    candidates = ~owned & (image.min(2) < _SURELY_WHITE)
    delta_e = np.zeros(classes.shape, dtype=np.float32)
    delta_e[candidates] = _delta_e_from_white(image[candidates])
    stray = delta_e > BACKGROUND_DELTA_E
    if HALO_PX > rim and stray.any():
        # JPEG's ringing is specks and streaks; a blot (stray ink filling a 3x3 square) stays stray.
        blot = _dilate(_erode(stray, 1), 1)
        if blot.any():
            labels, _ = _ndimage().label(blot, structure=_EIGHT_CONNECTED)
            blot = (np.bincount(labels.ravel()) >= round(BLOT_PX * scale))[labels] & blot
        halo = _dilate(objects, HALO_PX) & (delta_e <= HALO_DELTA_E) & ~blot & stray
        if JPEG_BLOCK_PX:
            halo &= _blocks_holding(owned, JPEG_BLOCK_PX)
        if HALO_LIGHTNESS and halo.any():
            halo[halo] = _lightness_below_white(image[halo]) <= HALO_LIGHTNESS
        stray &= ~halo
    # The surely-white pixels skipped above are within BACKGROUND_DELTA_E of white, not at 0: the tint counts them.
    near_white = ~owned & ~candidates
    white = image[near_white].astype(np.intp) - _SURELY_WHITE
    tint = delta_e[candidates & (delta_e <= BACKGROUND_DELTA_E)]
    n_plain = len(white) + len(tint)
    background_delta_e = (float(_NEAR_WHITE_DELTA_E[white[:, 0], white[:, 1], white[:, 2]].sum() + tint.sum()) / n_plain
                          if n_plain else 0.0)
    n_stray = int(stray.sum())
    marks: list[int] = []
    n_dirt = n_stray
    if n_stray:
        # A mark: a connected blob with MARK_PX clearly visible pixels, or FAINT_MARK_PX in all.
        labels, _ = _ndimage().label(stray, structure=_EIGHT_CONNECTED)
        areas = np.bincount(labels.ravel())
        strong = np.bincount(labels.ravel(), weights=(delta_e > MARK_DELTA_E).ravel(), minlength=len(areas))
        is_mark = (strong >= max(2, round(MARK_PX * scale))) | (areas >= round(FAINT_MARK_PX * scale))
        is_mark[0] = False
        marks = sorted((int(a) for a in areas[is_mark]), reverse=True)
        n_dirt = n_stray - sum(marks)
    return _Scene(sorted(found, key=lambda obj: -obj.area), n_stray / stray.size, n_dirt / stray.size, marks,
                  background_delta_e)


def detect_objects(image) -> list[DetectedObject]:
    """Colored shapes in `image` (uint8 HWC array or [3, H, W] float tensor), largest first."""
    return _analyze(_as_uint8_hwc(image)).objects


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


def _shape_ok(obj: DetectedObject, want: ObjectSpec) -> bool:
    # A dithered object, like a malformed one, counts as an object but is no clean shape.
    return obj.flaw is None and not obj.dithered and obj.shape == want.shape


def _assign(spec: SceneSpec, found: list[DetectedObject]) -> list[DetectedObject | None]:
    """Detection matched to each required object (None: missing), maximizing satisfied
    attributes (shape, color, relation) over all assignments; ties favor larger objects."""
    required = spec.objects
    n_slots = max(len(found), len(required))  # slots past len(found) stand for "missing"
    satisfied = np.zeros((len(required), n_slots))
    for i, want in enumerate(required):
        for j, obj in enumerate(found):
            satisfied[i, j] = _shape_ok(obj, want) + (want.color is not None and obj.color == want.color)
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


def _stray_failure(scene: _Scene) -> str | None:
    if scene.dirt_fraction > STRAY_LIMIT or scene.stray_fraction > BACKGROUND_LIMIT:
        return (f"background: {scene.stray_fraction:.1%} of the image is off-white (ΔE > {BACKGROUND_DELTA_E:g}) "
                "outside the objects")
    if scene.marks:
        noun = "mark" if len(scene.marks) == 1 else "marks"
        return f"stray: {len(scene.marks)} {noun} outside the objects (largest {scene.marks[0]} px)"
    return None


def verify(image, prompt_or_spec: str | SceneSpec) -> Verdict:
    """Check `image` (uint8 HWC array or [3, H, W] float tensor in [0, 1]) against a prompt.

    The score is the mean of: a count component, per required object a shape component and,
    if a color is required, a color component, and for position prompts a relation component;
    the balanced score first averages the components of each kind, then the kinds; the exact-count
    score is half [the count is exact] and half the mean of the other components; all are
    times a cleanliness factor that is 1 up to STRAY_LIMIT of stray ink and 0 from
    STRAY_ZERO_CREDIT. The crisp score is the score with each passing shape graded by its lead over the
    second-best template (CRISP_FLOOR at none, 1 from CRISP_LEAD) and times MARK_CREDIT for each stray
    mark: in it, every strict failure costs credit. The reason names the first failure among a dirty
    background or stray marks, the count, then each object's texture, shape and color, then the relation, and starts
    with that word. A dithered object fails its shape component, as a malformed one does.
    """
    spec = parse_prompt(prompt_or_spec) if isinstance(prompt_or_spec, str) else prompt_or_spec
    scene = _analyze(_as_uint8_hwc(image))
    detected = scene.objects
    matched = _assign(spec, detected[:MAX_MATCHED])

    n_required, n_found = len(spec.objects), len(detected)
    components = {"count": [1.0 if n_found == n_required else max(0.0, 1 - abs(n_found - n_required) / n_required)]}
    failures, crisp = [], []  # crisp: each required object's graded shape credit
    if (stray := _stray_failure(scene)) is not None:
        failures.append(stray)
    if n_found != n_required:
        noun = "object" if n_required == 1 else "objects"
        failures.append(f"count: expected {n_required} {noun}, found {n_found}")

    for i, (want, got) in enumerate(zip(spec.objects, matched, strict=True), start=1):
        found_text = got.description() if got else "nothing"
        if got is not None and got.dithered:
            failures.append(f"texture: object {i} fill is dithered (a {got.color} {got.shape}, zig-zag ΔE "
                            f"{got.zigzag:.1f} per pixel > {TEXTURE_DELTA_E:g})")
        shape_ok = got is not None and _shape_ok(got, want)
        crisp.append(CRISP_FLOOR + (1 - CRISP_FLOOR) * min(1.0, got.lead / CRISP_LEAD) if shape_ok else 0.0)
        checks = [("shape", shape_ok)]
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

    clean = min(1.0, max(0.0, (STRAY_ZERO_CREDIT - scene.stray_fraction) / (STRAY_ZERO_CREDIT - STRAY_LIMIT)))
    every_component = [value for values in components.values() for value in values]
    not_count = [value for kind, values in components.items() if kind != "count" for value in values]
    crisp_components = [value for kind, values in components.items() if kind != "shape" for value in values] + crisp
    return Verdict(
        score=float(np.mean(every_component)) * clean,
        strict=not failures,
        reason=failures[0] if failures else "ok",
        balanced_score=float(np.mean([np.mean(values) for values in components.values()])) * clean,
        exact_count_score=(0.5 * (n_found == n_required) + 0.5 * float(np.mean(not_count))) * clean,
        crisp_score=float(np.mean(crisp_components)) * clean * MARK_CREDIT ** len(scene.marks),
        background_delta_e=scene.background_delta_e,
    )
