"""The shapes verifier against what an honest judge fails: a dirty background, stray marks and
specks, ghost shapes, malformed shapes (two circles merged into one blob among them), dithered fills. The
verifier is the RL reward, so each of these is a reward hack unless it fails strictly, with its reason named.
Clean renders softened like a real sample (mild blur and noise) or saved as JPEG, a triangle shaded in two
tones of its color and a triangle tilted by up to 30 degrees still pass.

Every kind is drawn at many random positions, sizes and colors from a fixed seed.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image, ImageDraw
from scipy import ndimage

from diffrl.data.shapes import CATEGORIES, COLORS, SHAPES, all_prompts, detect_objects, render_prompt, verify
from diffrl.data.shapes.render import draw_shape

CLEAN_PER_CATEGORY = 120
PER_KIND = 120
MIN_RATE = 0.99
SIZE = 64
SUPERSAMPLE = 4
WHITE = (255, 255, 255)
COLOR_NAMES = tuple(COLORS)


# --------------------------------------------------------------------------- drawing


def soften(image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Mild blur and color noise, as in a diffusion model's sample (the shipped model's edges are
    about a pixel soft and its background grain stays under ~2 RGB units)."""
    blurred = ndimage.gaussian_filter(image.astype(np.float32), sigma=(rng.uniform(0.3, 0.6),) * 2 + (0,))
    noisy = blurred + rng.normal(0, rng.uniform(0.5, 2.0), image.shape)
    return np.clip(np.round(noisy), 0, 255).astype(np.uint8)


def random_prompt(rng: np.random.Generator, categories=CATEGORIES) -> str:
    prompts = all_prompts(categories[rng.integers(len(categories))])
    return prompts[rng.integers(len(prompts))]


def free_spot(free: np.ndarray, height: int, width: int, rng: np.random.Generator) -> tuple[int, int] | None:
    """Top-left (x, y) of a random height x width window that lies entirely in `free`, or None."""
    table = np.pad(np.cumsum(np.cumsum(~free, 0), 1), ((1, 0), (1, 0)))
    busy = table[height:, width:] - table[:-height, width:] - table[height:, :-width] + table[:-height, :-width]
    ys, xs = np.nonzero(busy == 0)
    if len(ys) == 0:
        return None
    k = rng.integers(len(ys))
    return int(xs[k]), int(ys[k])


def background_free(image: np.ndarray, margin: int = 3) -> np.ndarray:
    """Pixels at least `margin` px from any drawn pixel and from the border."""
    ink = (image < 250).any(2)
    free = ~ndimage.binary_dilation(ink, iterations=margin) if ink.any() else np.ones(ink.shape, bool)
    free[:1], free[-1:], free[:, :1], free[:, -1:] = False, False, False, False
    return free


def paste(image: np.ndarray, patch: np.ndarray, coverage: np.ndarray, x: int, y: int) -> None:
    """Blend `patch` (h, w, 3) into `image` at (x, y) with per-pixel `coverage` in [0, 1]."""
    h, w = coverage.shape
    region = image[y : y + h, x : x + w].astype(np.float32)
    image[y : y + h, x : x + w] = np.round(region + coverage[..., None] * (patch - region)).astype(np.uint8)


def draw_polygon_mask(size: int, draw) -> np.ndarray:
    """Antialiased coverage [size, size] of what `draw(ImageDraw, scale)` fills, drawn 4x and box-averaged."""
    canvas = Image.new("L", (size * SUPERSAMPLE, size * SUPERSAMPLE), 0)
    draw(ImageDraw.Draw(canvas), SUPERSAMPLE)
    return np.asarray(canvas.resize((size, size), Image.BOX), dtype=np.float32) / 255


def with_marks(prompt: str, seed: int, rng: np.random.Generator, blobs: list[tuple[int, int]], colors, ellipse: bool,
               alpha: float = 1.0) -> np.ndarray | None:
    """A softened render of `prompt` plus blobs (height, width) of the given colors on free background."""
    image = render_prompt(prompt, seed=seed)
    free = background_free(image)
    for (h, w), color in zip(blobs, colors, strict=True):
        spot = free_spot(free, h + 2, w + 2, rng)
        if spot is None:
            return None
        x, y = spot[0] + 1, spot[1] + 1
        if ellipse:
            coverage = draw_polygon_mask(max(h, w), lambda d, s: d.ellipse((0, 0, w * s - 1, h * s - 1), fill=255))[:h, :w]
        else:
            coverage = np.ones((h, w), np.float32)
        paste(image, np.array(color, np.float32), alpha * coverage, x, y)
        free[max(y - 3, 0) : y + h + 3, max(x - 3, 0) : x + w + 3] = False
    return soften(image, rng)


def single_shape(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, str, str]:
    """(softened image of one malformed shape, its color, the shape it most resembles)."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    side = int(rng.integers(16, 27))
    canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
    draw = ImageDraw.Draw(canvas)
    fill = COLORS[color]
    s = SUPERSAMPLE
    margin = 7 if kind == "turned_square" else 3  # its corners reach past its box
    x0, y0 = (int(v) * s for v in rng.integers(margin, SIZE - side - margin, size=2))
    x1, y1 = x0 + side * s - 1, y0 + side * s - 1
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if kind == "plus":
        arm = side * s * rng.uniform(0.25, 0.4) / 2  # arm width over the span: a Red Cross has 1/3
        draw.rectangle((cx - arm, y0, cx + arm, y1), fill=fill)
        draw.rectangle((x0, cy - arm, x1, cy + arm), fill=fill)
        like = "diamond"
    elif kind == "ring":
        draw.ellipse((x0, y0, x1, y1), fill=fill)
        inner = side * s * rng.uniform(0.2, 0.35)
        draw.ellipse((cx - inner, cy - inner, cx + inner, cy + inner), fill=WHITE)
        like = "circle"
    elif kind == "L":
        arm = side * s * rng.uniform(0.35, 0.5)
        draw.rectangle((x0, y0, x0 + arm, y1), fill=fill)
        draw.rectangle((x0, y1 - arm, x1, y1), fill=fill)
        like = "square"
    elif kind == "star":
        points = int(rng.integers(5, 7))
        angles = np.pi * np.arange(2 * points) / points - np.pi / 2 + rng.uniform(0, np.pi)
        radii = np.where(np.arange(2 * points) % 2 == 0, 1.0, rng.uniform(0.4, 0.55)) * side * s / 2
        draw.polygon(list(zip(cx + radii * np.cos(angles), cy + radii * np.sin(angles))), fill=fill)
        like = "diamond"
    elif kind == "inverted_triangle":
        draw.polygon([(x0, y0), (x1, y0), (cx, y1)], fill=fill)
        like = "triangle"
    elif kind in ("rectangle_3_1", "ellipse_2_1"):
        long_side = side * s
        short = long_side / (3 if kind == "rectangle_3_1" else 2)
        box = (cx - long_side / 2, cy - short / 2, cx + long_side / 2, cy + short / 2)
        if rng.random() < 0.5:  # stand it upright
            box = (cx - short / 2, cy - long_side / 2, cx + short / 2, cy + long_side / 2)
        if kind == "rectangle_3_1":
            draw.rectangle(box, fill=fill)
        else:
            draw.ellipse(box, fill=fill)
        like = "square" if kind == "rectangle_3_1" else "circle"
    elif kind == "rounded_diamond":
        # A diamond with its vertices rounded off by circles of radius r: its straight edges are the
        # diamond's, its radius through a vertex is 0.81-0.85 of the box's half side (a diamond 0.71,
        # a circle 1), halfway between the two.
        half = side * s / 2
        r = half * rng.uniform(0.3, 0.4)
        offset = (half - r * np.sqrt(2))
        for ox, oy in ((0, -offset), (offset, 0), (0, offset), (-offset, 0)):
            draw.ellipse((cx + ox - r, cy + oy - r, cx + ox + r, cy + oy + r), fill=fill)
        draw.polygon([(cx, cy - offset), (cx + offset, cy), (cx, cy + offset), (cx - offset, cy)], fill=fill)
        for (ax, ay), (bx, by) in (((0, -1), (1, 0)), ((1, 0), (0, 1)), ((0, 1), (-1, 0)), ((-1, 0), (0, -1))):
            # the band between two neighbouring vertex circles, as a quadrilateral of their tangent points
            n = np.array([ax + bx, ay + by]) / np.sqrt(2)
            pa = np.array([cx + ax * offset, cy + ay * offset])
            pb = np.array([cx + bx * offset, cy + by * offset])
            draw.polygon([tuple(pa), tuple(pa + r * n), tuple(pb + r * n), tuple(pb)], fill=fill)
        like = "circle"
    elif kind in ("pentagon", "hexagon", "turned_square"):
        # Regular polygons at any rotation, and a square turned 15-30 degrees (a diamond is one turned
        # 45): each overlaps the circle template best, and a human sees its corners.
        corners = {"pentagon": 5, "hexagon": 6, "turned_square": 4}[kind]
        radius = side * s / (np.sqrt(2) if kind == "turned_square" else 2)
        if kind == "turned_square":
            turn = np.radians(45 + rng.uniform(15, 30) * rng.choice([-1, 1]))
        else:
            turn = rng.uniform(0, 2 * np.pi)
        angles = turn + 2 * np.pi * np.arange(corners) / corners
        draw.polygon(list(zip(cx + radius * np.cos(angles), cy + radius * np.sin(angles))), fill=fill)
        like = "circle"
    elif kind in ("trapezoid", "cut_triangle"):
        # A flat top 30% of the base wide: over the whole height, or a triangle's apex cut off 30% down.
        top = y0 if kind == "trapezoid" else y0 + 0.3 * (y1 - y0)
        half_top = 0.15 * (x1 - x0)
        draw.polygon([(cx - half_top, top), (cx + half_top, top), (x1, y1), (x0, y1)], fill=fill)
        like = "triangle"
    elif kind == "two_triangles":
        # Two triangles of one color side by side, overlapping by 70% of their width: an M-shaped top.
        width = (x1 - x0) / 1.3
        for left in (x0, x1 - width):
            draw.polygon([(left + width / 2, y1 - width), (left + width, y1), (left, y1)], fill=fill)
        like = "triangle"
    else:
        raise ValueError(kind)
    image = np.asarray(canvas.resize((SIZE, SIZE), Image.BOX))
    return soften(image, rng), color, like


def jpeg(image: np.ndarray, quality: int) -> np.ndarray:
    """`image` saved as a JPEG of this quality (PIL's defaults: 4:2:0 chroma subsampling) and read back."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "JPEG", quality=quality)
    return np.asarray(Image.open(io.BytesIO(buffer.getvalue())).convert("RGB"))


def two_circles(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """Two disks of one color merged into one blob (a peanut, a snowman), at any turn: radii of 7-11 px and
    0.7-1 of that, the smaller disk's diameter 40-80% inside the larger one; and the prompt of one circle."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    big = rng.uniform(7, 11)
    small = big * rng.uniform(0.7, 1.0)
    apart = big + small - rng.uniform(0.4, 0.8) * 2 * small
    turn = rng.uniform(0, 2 * np.pi)
    reach = max(big, apart + small) + 3
    cx, cy = rng.uniform(reach, SIZE - reach, size=2)
    s = SUPERSAMPLE
    canvas = Image.new("RGB", (SIZE * s,) * 2, WHITE)
    draw = ImageDraw.Draw(canvas)
    for x, y, r in ((cx, cy, big), (cx + apart * np.cos(turn), cy + apart * np.sin(turn), small)):
        draw.ellipse(((x - r) * s, (y - r) * s, (x + r) * s - 1, (y + r) * s - 1), fill=COLORS[color])
    return soften(np.asarray(canvas.resize((SIZE, SIZE), Image.BOX)), rng), f"a {color} circle"


def tilted_triangle(rng: np.random.Generator, degrees: tuple[float, float] = (5, 30)) -> tuple[np.ndarray, str]:
    """An upright triangle of 14-24 px turned about its centroid by +-5-30 degrees, and its prompt."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    side = int(rng.integers(14, 25))
    turn = np.radians(rng.uniform(*degrees) * rng.choice([-1, 1]))
    cx, cy = rng.uniform(0.75 * side + 2, SIZE - 0.75 * side - 2, size=2)
    corners = np.array([(0, -2 * side / 3), (side / 2, side / 3), (-side / 2, side / 3)])
    rotation = np.array([[np.cos(turn), -np.sin(turn)], [np.sin(turn), np.cos(turn)]])
    corners = corners @ rotation.T + (cx, cy)
    canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
    ImageDraw.Draw(canvas).polygon([tuple(p * SUPERSAMPLE) for p in corners], fill=COLORS[color])
    return soften(np.asarray(canvas.resize((SIZE, SIZE), Image.BOX)), rng), f"a {color} triangle"


def two_tone_triangle(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """A triangle whose one side is a darker shade or lighter tint of its color (shading)."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    side = int(rng.integers(16, 27))
    s = SUPERSAMPLE
    x0, y0 = (int(v) * s for v in rng.integers(3, SIZE - side - 3, size=2))
    x1, y1 = x0 + side * s - 1, y0 + side * s - 1
    cx = (x0 + x1) / 2
    base = np.array(COLORS[color], np.float32)
    if rng.random() < 0.5:
        shade = base * rng.uniform(0.6, 0.85)  # darker
    else:
        shade = 255 - (255 - base) * rng.uniform(0.7, 0.85)  # lighter
    canvas = Image.new("RGB", (SIZE * s,) * 2, WHITE)
    draw = ImageDraw.Draw(canvas)
    draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=COLORS[color])
    # the shaded part: one side of a line from the apex to a random point of the base
    foot = x0 + (x1 - x0) * rng.uniform(0.3, 0.7)
    corner = x1 if rng.random() < 0.5 else x0
    draw.polygon([(cx, y0), (foot, y1), (corner, y1)], fill=tuple(int(round(v)) for v in shade))
    image = np.asarray(canvas.resize((SIZE, SIZE), Image.BOX))
    return soften(image, rng), color


# --------------------------------------------------------------------------- adversarial kinds


def dithered_background(prompt: str, seed: int, rng: np.random.Generator) -> np.ndarray:
    """Like the Flow-GRPO checkpoint's images: a share of the background pixels tinted pink, cyan or yellow."""
    image = soften(render_prompt(prompt, seed=seed), rng)
    background = (image > 245).all(2)
    tinted = background & (rng.random(background.shape) < rng.uniform(0.3, 0.6))
    tints = np.array([(255, 215, 235), (215, 245, 255), (255, 250, 205)], np.float32)
    picked = tints[rng.integers(len(tints), size=background.shape)] + rng.normal(0, 6, image.shape)
    image[tinted] = np.clip(np.round(picked[tinted]), 0, 255).astype(np.uint8)
    return image


def grain(prompt: str, seed: int, rng: np.random.Generator, sigma: float) -> np.ndarray:
    image = render_prompt(prompt, seed=seed).astype(np.float32)
    return np.clip(np.round(image + rng.normal(0, sigma, image.shape)), 0, 255).astype(np.uint8)


def _grey(rng):
    return (int(rng.integers(90, 200)),) * 3


def _pale_pink(rng):
    return (255, int(rng.integers(195, 225)), int(rng.integers(205, 235)))


def _palette(rng):
    return COLORS[COLOR_NAMES[rng.integers(len(COLOR_NAMES))]]


STRAY_KINDS = {
    # kind: (blob sizes, color sampler, round blob?, opacity range)
    "grey_blob_8": (lambda rng: [(8, 8)], _grey, True, (1.0, 1.0)),
    "grey_blob_12": (lambda rng: [(12, 12)], _grey, True, (1.0, 1.0)),
    "pale_pink_blob_16": (lambda rng: [(16, 16)], _pale_pink, True, (1.0, 1.0)),
    "palette_specks_10": (lambda rng: [(3, 3)] * 10, _palette, False, (1.0, 1.0)),
    "palette_specks_25": (lambda rng: [(3, 3)] * 25, _palette, False, (1.0, 1.0)),
}


def ghost_shape(prompt: str, seed: int, rng: np.random.Generator) -> np.ndarray | None:
    """A faint extra shape (25-40% opacity) of a palette color beside the prompt's objects."""
    image = render_prompt(prompt, seed=seed)
    side = int(rng.integers(12, 20))
    spot = free_spot(background_free(image), side + 2, side + 2, rng)
    if spot is None:
        return None
    shape = SHAPES[rng.integers(len(SHAPES))]
    coverage = draw_polygon_mask(side, lambda d, s: draw_shape(d, shape, (0, 0, side * s - 1, side * s - 1), 255))
    paste(image, np.array(_palette(rng), np.float32), rng.uniform(0.25, 0.4) * coverage, spot[0] + 1, spot[1] + 1)
    return soften(image, rng)


def cielab(rgb) -> np.ndarray:
    """CIELAB (D65) of an sRGB color in 0-255."""
    c = np.asarray(rgb, np.float64) / 255
    linear = np.where(c <= 0.04045, c / 12.92, ((c + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ linear
    t = xyz / np.array([0.9505, 1.0, 1.089])
    f = np.where(t > (6 / 29) ** 3, np.cbrt(t), t / (3 * (6 / 29) ** 2) + 4 / 29)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def dithered_shape(rng: np.random.Generator) -> tuple[np.ndarray, str, float]:
    """One shape whose fill is a checkerboard of two shades of its color, as the Flow-GRPO checkpoint
    drew: the palette color and a darker shade or a lighter tint of it, or a shade and a tint around
    it; cells of 1, 2 or (shapes of 20 px or more) 4 px; the two shades 12-24 ΔE apart (at 8 the pattern is faint even
    zoomed in, from 12 it is plain at 4x). Returns (image with mild color noise, prompt, ΔE)."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    side = int(rng.integers(14, 25))
    base = np.array(COLORS[color], np.float64)
    mode = ("darker", "lighter", "around")[rng.integers(3)]

    def shades(t: float) -> tuple[np.ndarray, np.ndarray]:
        darker, lighter = base * (1 - t), 255 - (255 - base) * (1 - t)
        if mode == "around":
            return base * (1 - t / 2), 255 - (255 - base) * (1 - t / 2)
        return base, darker if mode == "darker" else lighter

    target = rng.uniform(12, 24)
    lo, hi = 0.0, 1.0  # the shading amount that puts the shades `target` apart (ΔE grows with it)
    for _ in range(30):
        mid = (lo + hi) / 2
        first, second = shades(mid)
        lo, hi = (mid, hi) if np.linalg.norm(cielab(first) - cielab(second)) < target else (lo, mid)
    first, second = shades(lo)
    cell = (1, 2, 4)[rng.integers(3 if side >= 20 else 2)]  # five cells across or more: a pattern, not shading
    yy, xx = np.mgrid[:side, :side] + rng.integers(cell, size=(2, 1, 1))  # random phase
    fill = np.where(((yy // cell + xx // cell) % 2 == 0)[..., None], first, second)
    coverage = draw_polygon_mask(side, lambda d, s: draw_shape(d, shape, (0, 0, side * s - 1, side * s - 1), 255))
    image = np.full((SIZE, SIZE, 3), 255.0)
    x, y = (int(v) for v in rng.integers(3, SIZE - side - 3, size=2))
    image[y : y + side, x : x + side] += coverage[..., None] * (fill - 255)
    image += rng.normal(0, rng.uniform(0.5, 2.0), image.shape)
    return np.clip(np.round(image), 0, 255).astype(np.uint8), f"a {color} {shape}", float(target)


def _on_random_prompts(adversary):
    """A `_fail_rate` case maker: `adversary(prompt, seed, rng)`'s image (None: no room for it) on a random prompt."""
    def make(rng, k):
        prompt = random_prompt(rng)
        image = adversary(prompt, k, rng)
        return None if image is None else (image, prompt)

    return make


def _fail_rate(make, reason: str, n: int = PER_KIND, seed: int = 0) -> tuple[float, list]:
    """Share of n generated (image, prompt) cases (None: skipped) that fail with `reason` first."""
    rng = np.random.default_rng(seed)
    wrong, done = [], 0
    while done < n:
        case = make(rng, done)
        if case is None:
            continue
        image, prompt = case
        verdict = verify(image, prompt)
        if verdict.strict or not verdict.reason.startswith(reason):
            wrong.append((prompt, verdict.reason))
        done += 1
    return 1 - len(wrong) / n, wrong


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("category", CATEGORIES)
def test_softened_renders_pass(category):
    rng = np.random.default_rng(CATEGORIES.index(category) + 500)
    failures = []
    for seed in range(CLEAN_PER_CATEGORY):
        prompt = random_prompt(rng, (category,))
        verdict = verify(soften(render_prompt(prompt, seed=seed), rng), prompt)
        if not verdict.strict or verdict.score != 1.0:
            failures.append((prompt, seed, verdict.reason))
    rate = 1 - len(failures) / CLEAN_PER_CATEGORY
    print(f"{category}: {rate:.3f} of {CLEAN_PER_CATEGORY} softened renders pass")
    assert rate >= MIN_RATE, failures[:10]


# Counting's shapes are small (11-15 px), where JPEG's half-resolution chroma blurs a yellow or orange one most
# (its faint fringe once put it between a circle and a square in ~2% of the images): more cases, to measure 0.99.
JPEG_CASES = {"counting": 480}


@pytest.mark.parametrize("category", CATEGORIES)
def test_jpeg_compressed_renders_pass(category):
    """A user's images are often JPEGs: clean renders saved at quality 75-90 pass. JPEG rings near edges
    (faint ink up to a block away, up to ~ΔE 18) and its half-resolution chroma ripples inside fills."""
    rng = np.random.default_rng(CATEGORIES.index(category) + 600)
    cases = JPEG_CASES.get(category, CLEAN_PER_CATEGORY)
    failures = []
    for seed in range(cases):
        prompt = random_prompt(rng, (category,))
        quality = int(rng.integers(75, 91))
        verdict = verify(jpeg(render_prompt(prompt, seed=seed), quality), prompt)
        if not verdict.strict:
            failures.append((prompt, seed, quality, verdict.reason))
    rate = 1 - len(failures) / cases
    print(f"{category}: {rate:.3f} of {cases} JPEG-compressed renders pass")
    assert rate >= MIN_RATE, failures[:10]


def close_pair(rng: np.random.Generator, gap: int = 2) -> tuple[np.ndarray, str]:
    """Two shapes of one kind and color, 11-15 px, side by side (or one above the other) with `gap` px between
    their boxes (the renderer keeps 3), and the prompt that counts them."""
    shape, color = SHAPES[rng.integers(len(SHAPES))], COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    a, b = (int(v) for v in rng.integers(11, 16, size=2))
    x = int(rng.integers(4, SIZE - a - b - gap - 4))
    y = int(rng.integers(4, SIZE - max(a, b) - 4))
    boxes = [(x, y, a), (x + a + gap, min(max(y + int(rng.integers(-2, 3)), 2), SIZE - b - 2), b)]
    if rng.random() < 0.5:
        boxes = [(y, x, side) for x, y, side in boxes]
    canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
    draw = ImageDraw.Draw(canvas)
    s = SUPERSAMPLE
    for x, y, side in boxes:
        draw_shape(draw, shape, (x * s, y * s, (x + side) * s - 1, (y + side) * s - 1), COLORS[color])
    return np.asarray(canvas.resize((SIZE, SIZE), Image.BOX)), f"two {shape}s"


def test_close_pairs_pass_as_jpeg():
    """Two shapes 2 px apart, saved as JPEG: a neighbour's soft edge within an object's rim is not part of its
    outline (it read as a sliver of it, a concave shape, in a third of such images)."""
    rng = np.random.default_rng(610)
    failures = []
    for _ in range(PER_KIND):
        image, prompt = close_pair(rng)
        verdict = verify(jpeg(image, int(rng.integers(75, 91))), prompt)
        if not verdict.strict:
            failures.append((prompt, verdict.reason))
    rate = 1 - len(failures) / PER_KIND
    print(f"close pair, JPEG: {rate:.3f} of {PER_KIND} pass")
    assert rate >= MIN_RATE, failures[:10]


def test_tilted_triangles_pass():
    """A triangle turned by 5-30 degrees is still a triangle to a judge (an inverted one is not, nor a turned
    trapezoid: see test_malformed_shapes_fail_as_shape and test_turned_blunt_or_inverted_triangles_fail_as_shape)."""
    rng = np.random.default_rng(8)
    failures = []
    for _ in range(PER_KIND):
        image, prompt = tilted_triangle(rng)
        verdict = verify(image, prompt)
        if not verdict.strict:
            failures.append((prompt, verdict.reason))
    rate = 1 - len(failures) / PER_KIND
    print(f"tilted triangle: {rate:.3f} of {PER_KIND} pass")
    assert rate >= MIN_RATE, failures[:10]


def turned_polygon(kind: str, rng: np.random.Generator, degrees: tuple[float, float]) -> tuple[np.ndarray, str]:
    """A trapezoid (flat top 30% of its base), a triangle cut 30% down or an inverted triangle, 16-26 px, turned
    about its centroid by +-`degrees`; and the prompt of a triangle."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    side = int(rng.integers(16, 27))
    corners = {
        "trapezoid": [(-0.15, 0.0), (0.15, 0.0), (0.5, 1.0), (-0.5, 1.0)],
        "cut_triangle": [(-0.15, 0.3), (0.15, 0.3), (0.5, 1.0), (-0.5, 1.0)],
        "inverted_triangle": [(-0.5, 0.0), (0.5, 0.0), (0.0, 1.0)],
    }[kind]
    points = np.array(corners) * side
    points -= points.mean(0) if kind == "inverted_triangle" else (0, 2 * side / 3)
    turn = np.radians(rng.uniform(*degrees) * rng.choice([-1, 1]))
    points = points @ np.array([[np.cos(turn), np.sin(turn)], [-np.sin(turn), np.cos(turn)]])
    points += rng.uniform(0.75 * side + 3, SIZE - 0.75 * side - 3, size=2)
    canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
    ImageDraw.Draw(canvas).polygon([tuple(p * SUPERSAMPLE) for p in points], fill=COLORS[color])
    return soften(np.asarray(canvas.resize((SIZE, SIZE), Image.BOX)), rng), f"a {color} triangle"


@pytest.mark.parametrize("kind, degrees", [("trapezoid", (5, 30)), ("cut_triangle", (5, 30)),
                                           ("inverted_triangle", (0, 20))])
def test_turned_blunt_or_inverted_triangles_fail_as_shape(kind, degrees):
    """A triangle's template is also tried turned (up to 25 degrees), so a turned trapezoid or cut triangle must
    still have no apex in that frame, and an inverted triangle turned by up to 20 degrees stays no triangle (turned
    by 27 or more, it stands on a vertex under 30 degrees off the vertical: a tilted triangle)."""
    rate, wrong = _fail_rate(lambda rng, k: turned_polygon(kind, rng, degrees), "shape", seed=90 + len(kind))
    print(f"{kind} turned {degrees[0]}-{degrees[1]} degrees: {rate:.3f} fail as shape")
    assert rate >= MIN_RATE, wrong[:10]


def test_two_merged_circles_fail_as_shape():
    """Two circles of one color overlapping 40-80% are one blob, a peanut or a snowman: no circle."""
    rate, wrong = _fail_rate(lambda rng, k: two_circles(rng), "shape", seed=80)
    print(f"two merged circles: {rate:.3f} fail as shape")
    assert rate >= MIN_RATE, wrong[:10]


def test_two_tone_triangle_is_one_triangle():
    rng = np.random.default_rng(7)
    failures = []
    for _ in range(PER_KIND):
        image, color = two_tone_triangle(rng)
        verdict = verify(image, f"a {color} triangle")
        if not verdict.strict:
            failures.append((color, verdict.reason))
    rate = 1 - len(failures) / PER_KIND
    print(f"two-tone triangle: {rate:.3f} of {PER_KIND} pass")
    assert rate >= MIN_RATE, failures[:10]


@pytest.mark.parametrize("sigma", [8.0, 20.0])
def test_grain_fails_as_background(sigma):
    rate, wrong = _fail_rate(lambda rng, k: (grain(p := random_prompt(rng), k, rng, sigma), p), "background",
                             seed=int(sigma))
    print(f"grain sigma {sigma}: {rate:.3f} fail as background")
    assert rate >= MIN_RATE, wrong[:10]


def test_dithered_background_fails_as_background():
    rate, wrong = _fail_rate(lambda rng, k: (dithered_background(p := random_prompt(rng), k, rng), p), "background")
    print(f"dithered background: {rate:.3f} fail as background")
    assert rate >= MIN_RATE, wrong[:10]


@pytest.mark.parametrize("kind", list(STRAY_KINDS))
def test_stray_marks_fail_as_stray(kind):
    sizes, color, ellipse, (lo, hi) = STRAY_KINDS[kind]

    def make(rng, k):
        prompt = random_prompt(rng)
        blobs = sizes(rng)
        image = with_marks(prompt, k, rng, blobs, [color(rng) for _ in blobs], ellipse, rng.uniform(lo, hi))
        return None if image is None else (image, prompt)

    rate, wrong = _fail_rate(make, "stray", seed=list(STRAY_KINDS).index(kind) + 10)
    print(f"{kind}: {rate:.3f} fail as stray")
    assert rate >= MIN_RATE, wrong[:10]


def blot_beside_an_object(prompt: str, seed: int, rng: np.random.Generator) -> np.ndarray | None:
    """A softened render of `prompt` with a faint round smudge of 6-10 px (grey 210-220 or pale pink, ΔE
    12-16) 4-6 px from an object: where JPEG's ringing is forgiven, a blot is not."""
    image = render_prompt(prompt, seed=seed)
    out = ndimage.distance_transform_cdt(~(image < 250).any(2), metric="chessboard")
    free = background_free(image)
    size = int(rng.integers(6, 11))
    color = np.array(((215,) * 3, (255, 225, 235))[rng.integers(2)], np.float32)
    ys, xs = np.nonzero((out >= 4) & (out <= 6))
    for _ in range(200):
        k = rng.integers(len(ys))
        y, x = int(ys[k]), int(xs[k])
        if y + size < SIZE - 1 and x + size < SIZE - 1 and free[y : y + size, x : x + size].all():
            coverage = draw_polygon_mask(size, lambda d, s: d.ellipse((0, 0, size * s - 1, size * s - 1), fill=255))
            paste(image, color, coverage, x, y)
            return soften(image, rng)
    return None


def test_faint_blots_beside_objects_fail_as_stray():
    rate, wrong = _fail_rate(_on_random_prompts(blot_beside_an_object), "stray", seed=21)
    print(f"faint blot beside an object: {rate:.3f} fail as stray")
    assert rate >= MIN_RATE, wrong[:10]


def speck_beside_an_object(prompt: str, seed: int, rng: np.random.Generator) -> np.ndarray | None:
    """A softened render of `prompt` with a grey speck of 2x2 px (grey 190-200, ΔE 20-24: a mark anywhere else)
    5-12 px from an object (past its rim), where JPEG's ringing is forgiven."""
    image = render_prompt(prompt, seed=seed)
    out = ndimage.distance_transform_cdt(~(image < 250).any(2), metric="chessboard")
    near = (out >= 5) & (out <= 12)
    near[:2], near[-3:], near[:, :2], near[:, -3:] = False, False, False, False
    ys, xs = np.nonzero(near)
    if not len(ys):
        return None
    k = rng.integers(len(ys))
    image[ys[k] : ys[k] + 2, xs[k] : xs[k] + 2] = int(rng.integers(190, 201))
    return soften(image, rng)


def test_grey_specks_beside_objects_fail_as_stray():
    """JPEG rings in chroma: the halo forgives no ink darker than HALO_LIGHTNESS, so a grey speck beside an
    object is a mark as it is anywhere else."""
    rate, wrong = _fail_rate(_on_random_prompts(speck_beside_an_object), "stray", seed=22)
    print(f"grey speck beside an object: {rate:.3f} fail as stray")
    assert rate >= MIN_RATE, wrong[:10]


def tint_speck_beside_an_object(prompt: str, seed: int, rng: np.random.Generator) -> np.ndarray | None:
    """A softened render of `prompt` with a speck of 2x2 px, a pale tint of a palette color (ΔE 20-24 from white:
    a mark anywhere else), 5-12 px from an object but in a 16x16 tile (JPEG's chroma block) that holds none of
    the objects' ink."""
    image = render_prompt(prompt, seed=seed)
    ink = (image < 250).any(2)
    out = ndimage.distance_transform_cdt(~ink, metric="chessboard")
    tiles = ndimage.binary_dilation(ink, iterations=4).reshape(SIZE // 16, 16, SIZE // 16, 16).any((1, 3))
    clear = ~np.repeat(np.repeat(tiles, 16, 0), 16, 1)
    ok = (out >= 5) & (out <= 12) & clear & np.roll(clear, -1, 0) & np.roll(clear, -1, 1) & np.roll(clear, -1, (0, 1))
    ok[:2], ok[-3:], ok[:, :2], ok[:, -3:] = False, False, False, False
    ys, xs = np.nonzero(ok)
    if not len(ys):
        return None
    k = rng.integers(len(ys))
    color, target = np.array(_palette(rng), np.float64), rng.uniform(20, 24)
    lo, hi = 0.0, 1.0  # the blend with white that is `target` from it
    for _ in range(20):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.linalg.norm(cielab(255 - mid * (255 - color)) - cielab(WHITE)) < target else (lo, mid)
    image[ys[k] : ys[k] + 2, xs[k] : xs[k] + 2] = np.round(255 - lo * (255 - color)).astype(np.uint8)
    return soften(image, rng)


def test_tint_specks_beside_objects_fail_as_stray():
    """JPEG rings only inside the 16x16 blocks that an object's edge crosses: a pale speck beside an object but
    in another block is a mark as it is anywhere else."""
    rate, wrong = _fail_rate(_on_random_prompts(tint_speck_beside_an_object), "stray", seed=23)
    print(f"pale speck beside an object, in another block: {rate:.3f} fail as stray")
    assert rate >= MIN_RATE, wrong[:10]


def test_ghost_shapes_fail_as_stray():
    rate, wrong = _fail_rate(_on_random_prompts(ghost_shape), "stray", seed=20)
    print(f"ghost shape: {rate:.3f} fail as stray")
    assert rate >= MIN_RATE, wrong[:10]


MALFORMED = ["plus", "ring", "L", "star", "inverted_triangle", "rectangle_3_1", "ellipse_2_1", "rounded_diamond",
             "pentagon", "hexagon", "turned_square", "trapezoid", "cut_triangle", "two_triangles"]


@pytest.mark.parametrize("kind", MALFORMED)
def test_malformed_shapes_fail_as_shape(kind):
    """Each drawn alone and checked against the shape it was taken for: a plus is no diamond, a
    3:1 rectangle no square, a 2:1 ellipse, a diamond with rounded vertices, a pentagon, a hexagon or a
    square turned 15-30 degrees no circle, a trapezoid (a flat top 30% of its base wide), a triangle with
    its apex cut off 30% down, or two triangles overlapping by 70% (an M-shaped top) no triangle."""

    def make(rng, k):
        image, color, like = single_shape(kind, rng)
        return image, f"a {color} {like}"

    rate, wrong = _fail_rate(make, "shape", seed=MALFORMED.index(kind) + 30)
    print(f"{kind}: {rate:.3f} fail as shape")
    assert rate >= MIN_RATE, wrong[:10]


def holed_shape(shape: str, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """A shape of 16-26 px with a white hole of 4x4 px near its centroid, and its prompt."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    side = int(rng.integers(16, 27))
    s = SUPERSAMPLE
    canvas = Image.new("RGB", (SIZE * s,) * 2, WHITE)
    draw = ImageDraw.Draw(canvas)
    x, y = (int(v) for v in rng.integers(3, SIZE - side - 3, size=2))
    draw_shape(draw, shape, (x * s, y * s, (x + side) * s - 1, (y + side) * s - 1), COLORS[color])
    hole = 4
    cx, cy = x + side / 2, y + side * (2 / 3 if shape == "triangle" else 1 / 2)
    hx, hy = (int(round(c - hole / 2 + rng.uniform(-1, 1))) for c in (cx, cy))
    draw.rectangle((hx * s, hy * s, (hx + hole) * s - 1, (hy + hole) * s - 1), fill=WHITE)
    return soften(np.asarray(canvas.resize((SIZE, SIZE), Image.BOX)), rng), f"a {color} {shape}"


@pytest.mark.parametrize("shape", SHAPES)
def test_holed_shapes_fail_as_shape(shape):
    """No palette shape has a hole: a white hole of 4x4 px inside a shape fails it (often too small for the
    concavity to see, and too large to be part of the fill's texture; a 3x3 one fails as texture)."""
    rate, wrong = _fail_rate(lambda rng, k: holed_shape(shape, rng), "shape", seed=SHAPES.index(shape) + 70)
    print(f"holed {shape}: {rate:.3f} fail as shape")
    assert rate >= MIN_RATE, wrong[:10]


def test_dithered_fills_fail_as_texture():
    """A checkerboard fill of two shades 12-24 ΔE apart, cells of 1, 2 or 4 px, fails as texture."""
    rate, wrong = _fail_rate(lambda rng, k: dithered_shape(rng)[:2], "texture", seed=50)
    print(f"dithered fill: {rate:.3f} fail as texture")
    assert rate >= MIN_RATE, wrong[:10]


@pytest.mark.parametrize("pattern", ["white_checker_1", "white_checker_2", "white_dots"])
def test_white_pixels_in_a_fill_are_texture_not_holes(pattern):
    """Pixels too pale to be the object's own leave pockets in it; small pockets are part of the
    fill (a checkerboard with white, white dots), while a ring's hole stays a hole (a shape flaw)."""
    rng = np.random.default_rng(52)
    for color in COLOR_NAMES:
        side = 22
        yy, xx = np.mgrid[:side, :side]
        if pattern == "white_dots":  # 2x2 dots every 5 px, off the edge
            white = (yy % 5 < 2) & (xx % 5 < 2) & (yy > 2) & (xx > 2) & (yy < side - 3) & (xx < side - 3)
        else:
            cell = int(pattern[-1])
            white = (yy // cell + xx // cell) % 2 == 0
        fill = np.where(white[..., None], 255.0, np.array(COLORS[color], np.float64))
        image = np.full((SIZE, SIZE, 3), 255.0)
        image[20 : 20 + side, 20 : 20 + side] = fill
        image = np.clip(np.round(image + rng.normal(0, 1, image.shape)), 0, 255).astype(np.uint8)
        verdict = verify(image, f"a {color} square")
        assert verdict.reason.startswith("texture: object 1 fill is dithered"), (color, verdict.reason)


def test_dithered_object_counts_but_matches_no_shape():
    """Like a malformed shape: the count and color stay right, the shape component is lost."""
    rng = np.random.default_rng(51)
    image, prompt, _ = dithered_shape(rng)
    (found,) = detect_objects(image)
    assert found.dithered and found.flaw is None
    verdict = verify(image, prompt)
    assert not verdict.strict and verdict.reason.startswith("texture: object 1 fill is dithered")
    assert verdict.score == pytest.approx(2 / 3)


def test_malformed_shape_is_one_object_that_matches_no_shape():
    """The flaw keeps the object (the count stays right) but no shape prompt accepts it."""
    image, color, _ = single_shape("plus", np.random.default_rng(3))
    (found,) = detect_objects(image)
    assert found.color == color and found.flaw is not None
    for shape in SHAPES:
        verdict = verify(image, f"a {color} {shape}")
        assert not verdict.strict and verdict.reason.startswith("shape:") and found.flaw in verdict.reason
        assert verdict.score == pytest.approx(2 / 3)  # count and color right, shape wrong


def test_larger_images_scale_the_rules():
    rng = np.random.default_rng(40)
    failures = []
    for seed in range(30):
        prompt = random_prompt(rng)
        verdict = verify(soften(render_prompt(prompt, seed=seed, size=128), rng), prompt)
        if not verdict.strict:
            failures.append((prompt, verdict.reason))
    assert len(failures) <= 1, failures


def test_off_palette_color_counts_but_matches_no_color():
    """Magenta lies between red and purple (36 degrees of hue from each): a shape, but no palette color."""
    canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
    draw_shape(ImageDraw.Draw(canvas), "circle", (80, 80, 159, 159), (200, 20, 140))
    image = np.asarray(canvas.resize((SIZE, SIZE), Image.BOX))
    assert verify(image, "a circle").strict
    for color in ("red", "purple"):
        verdict = verify(image, f"a {color} circle")
        assert not verdict.strict and verdict.reason.startswith("color:")
        assert verdict.reason.endswith(("found a red-purple circle", "found a purple-red circle"))


def muted_shape(rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One shape of a palette hue at 52-70% of its color's chroma, darker (orange -> brown, yellow ->
    olive, red -> maroon) or paler (red -> pink, salmon; blue -> sky blue), and its prompt."""
    color = COLOR_NAMES[rng.integers(len(COLOR_NAMES))]
    shape = SHAPES[rng.integers(len(SHAPES))]
    base, f = np.array(COLORS[color], np.float64), rng.uniform(0.52, 0.7)
    fill = base * f if rng.random() < 0.5 else 255 - (255 - base) * f
    side = int(rng.integers(14, 25))
    canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
    x, y = (int(v) * SUPERSAMPLE for v in rng.integers(3, SIZE - side - 3, size=2))
    box = (x, y, x + side * SUPERSAMPLE - 1, y + side * SUPERSAMPLE - 1)
    draw_shape(ImageDraw.Draw(canvas), shape, box, tuple(int(round(v)) for v in fill))
    return soften(np.asarray(canvas.resize((SIZE, SIZE), Image.BOX)), rng), f"a {color} {shape}"


def test_muted_colors_fail_as_color():
    """Brown is no orange, olive no yellow, pink no red: a shape whose every pixel is a muted tone of a
    palette hue has no palette color (a shaded one keeps a part in its color, see the two-tone triangle)."""
    rate, wrong = _fail_rate(lambda rng, k: muted_shape(rng), "color", seed=60)
    print(f"muted color: {rate:.3f} fail as color")
    assert rate >= MIN_RATE, wrong[:10]
    for rgb, color in [((147, 69, 0), "orange"), ((153, 135, 0), "yellow"), ((255, 150, 160), "red"),
                       ((250, 128, 114), "red")]:  # brown, olive, pink, salmon
        canvas = Image.new("RGB", (SIZE * SUPERSAMPLE,) * 2, WHITE)
        draw_shape(ImageDraw.Draw(canvas), "circle", (80, 80, 159, 159), rgb)
        image = np.asarray(canvas.resize((SIZE, SIZE), Image.BOX))
        assert verify(image, "a circle").strict
        verdict = verify(image, f"a {color} circle")
        assert verdict.reason.startswith("color:") and verdict.reason.endswith(f"found a muted {color} circle"), rgb


def test_stray_ink_fades_the_partial_credit():
    """A stray mark fails strictly and costs partial credit in proportion to its area; a dirty
    background costs all of it."""
    rng = np.random.default_rng(41)
    prompt = "a blue square"
    clean = verify(soften(render_prompt(prompt, seed=0), rng), prompt)
    small = verify(with_marks(prompt, 0, rng, [(8, 8)], [(120, 120, 120)], True), prompt)
    large = verify(with_marks(prompt, 0, rng, [(16, 16)], [(120, 120, 120)], True), prompt)
    dirty = verify(grain(prompt, 0, rng, 20.0), prompt)
    assert clean.strict and clean.score == 1.0
    assert not small.strict and small.reason.startswith("stray:")
    assert 1.0 > small.score > large.score > dirty.score == 0.0
    assert dirty.balanced_score == dirty.exact_count_score == 0.0


def test_every_strict_failure_costs_crisp_credit():
    """Under the crisp score (reward `shapes_crisp`) an image that fails strictly for any reason scores below
    a clean one, so the policy is pushed off it. A single small mark (too small to move the stray fraction)
    is what the plain partial credit leaves whole."""
    rng = np.random.default_rng(43)
    makers = {
        "small mark": lambda p, k: with_marks(p, k, rng, [(5, 5)], [(90, 90, 90)], True),
        "speck": lambda p, k: with_marks(p, k, rng, [(3, 3)], [(230, 30, 30)], False),
        "grain": lambda p, k: grain(p, k, rng, 8.0),
    }
    checked = 0
    for kind, make in makers.items():
        for k in range(20):
            prompt = random_prompt(rng)
            image = make(prompt, k)
            if image is None:
                continue
            verdict = verify(image, prompt)
            if not verdict.strict:
                checked += 1
                assert verdict.crisp_score < 1.0, (kind, prompt, verdict)
    assert checked >= 40


def test_a_thin_stray_line_is_a_mark():
    """A long one-pixel line is no compact blob, and too thin to dirty the background: still a mark."""
    rng = np.random.default_rng(42)
    failures = []
    for seed in range(40):
        prompt = random_prompt(rng)
        image = render_prompt(prompt, seed=seed)
        free = background_free(image)
        rows = [y for y in range(SIZE) if free[y].sum() >= 30]
        if not rows:
            continue
        y = rows[rng.integers(len(rows))]
        xs = np.flatnonzero(free[y])[:30]
        image[y, xs] = (110, 110, 110)
        verdict = verify(soften(image, rng), prompt)
        if verdict.strict or not verdict.reason.startswith("stray"):
            failures.append((prompt, verdict.reason))
    assert not failures, failures
