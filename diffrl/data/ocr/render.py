"""Pillow renders of a quoted text: the OCR world's pretraining images.

`render_clean` is the reference render (black on white, the largest size that fits, centred) at which the
world's resolution was chosen; `render_text` varies font, size, colours, background and placement, drawn
from a numpy generator so a seed fixes the image. `render_grid` / `render_grid_text` draw a text the way a
glyph-grid model is taught to (`glyph_grid`): each character centred in its cell, Pillow's built-in font drawn
bold, the same colours and blur as `render_text` on flat or gradient backgrounds. Fonts: Pillow's built-in one (FreeType's Aileron, at any
size) and every TrueType font found on the machine at run time (`system_fonts`), so two machines with other
fonts render other images from one seed; a text may wrap onto two lines where the image is tall enough.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFilter, ImageFont

from diffrl.data.ocr.glyph_grid import BOLD_PIXELS, FONT_SIZE, HEIGHT, GlyphGrid

FONT_DIRS = ("/usr/share/fonts", "/usr/local/share/fonts", "/Library/Fonts", "/System/Library/Fonts",
             "C:/Windows/Fonts", str(Path.home() / ".fonts"))
BUILTIN = "<pillow>"  # Pillow's own font (ImageFont.load_default)
MARGIN = 2  # pixels kept clear at every edge


@functools.cache
def system_fonts() -> tuple[str, ...]:
    """The TrueType / OpenType files under the usual font folders, sorted (symbol and math fonts left out:
    they draw no Latin letters)."""
    found = set()
    for folder in FONT_DIRS:
        root = Path(folder)
        if root.is_dir():
            found.update(str(p) for p in root.rglob("*") if p.suffix.lower() in (".ttf", ".otf"))
    return tuple(sorted(p for p in found if not any(k in Path(p).name.lower() for k in ("math", "symbol", "emoji"))))


def font_names() -> tuple[str, ...]:
    return (BUILTIN, *system_fonts())


@functools.cache
def load_font(name: str, size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size) if name == BUILTIN else ImageFont.truetype(name, size)


def _lines_size(lines: list[str], font, spacing: int) -> tuple[int, int]:
    box = ImageDraw.Draw(Image.new("L", (1, 1))).multiline_textbbox((0, 0), "\n".join(lines), font=font,
                                                                    spacing=spacing)
    return box[2] - box[0], box[3] - box[1]


def _layouts(text: str, height: int, width: int) -> list[list[str]]:
    """One line, and where the image is at least 48 px tall and the text has several words, its two most
    even halves."""
    words = text.split(" ")
    layouts = [[text]]
    if height >= 48 and len(words) > 1:
        cut = min(range(1, len(words)), key=lambda i: abs(len(" ".join(words[:i])) - len(" ".join(words[i:]))))
        layouts.append([" ".join(words[:cut]), " ".join(words[cut:])])
    return layouts


def fit_size(lines: list[str], font_name: str, height: int, width: int) -> int:
    """The largest font size (≥ 6) at which `lines` fit inside the margins; 6 when none does."""
    lo, hi = 6, 2 * height
    while lo < hi:
        mid = (lo + hi + 1) // 2
        w, h = _lines_size(lines, load_font(font_name, mid), spacing=mid // 6)
        if w <= width - 2 * MARGIN and h <= height - 2 * MARGIN:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _draw(lines, font_name, size, height, width, ink, background, where) -> Image.Image:
    """`background` is an [H, W, 3] uint8 array; `where` ∈ [0, 1]² places the text in the space left over."""
    image = Image.fromarray(background)
    font = load_font(font_name, size)
    spacing = size // 6
    draw = ImageDraw.Draw(image)
    box = draw.multiline_textbbox((0, 0), "\n".join(lines), font=font, spacing=spacing, align="center")
    w, h = box[2] - box[0], box[3] - box[1]
    x = MARGIN + where[0] * max(0, width - 2 * MARGIN - w) - box[0]
    y = MARGIN + where[1] * max(0, height - 2 * MARGIN - h) - box[1]
    draw.multiline_text((x, y), "\n".join(lines), font=font, fill=tuple(ink), spacing=spacing, align="center")
    return image


def render_clean(text: str, height: int, width: int, font_name: str = BUILTIN) -> np.ndarray:
    """Black text on white at the largest size that fits (on one line, or two where that is larger),
    centred: [H, W, 3] uint8."""
    lines, size = max(((l, fit_size(l, font_name, height, width)) for l in _layouts(text, height, width)),
                      key=lambda pair: pair[1])
    white = np.full((height, width, 3), 255, np.uint8)
    return np.asarray(_draw(lines, font_name, size, height, width, (0, 0, 0), white, (0.5, 0.5)))


def _luminance(rgb) -> float:
    r, g, b = (np.asarray(rgb, float) / 255.0)
    return 0.2126 * r + 0.7152 * g + 0.0722 * b


def _colors(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Ink and background colours whose luminances differ by at least 0.45 (dark on light or light on dark)."""
    while True:
        ink, paper = rng.integers(0, 256, size=(2, 3))
        if abs(_luminance(ink) - _luminance(paper)) >= 0.45:
            return ink, paper


def _background(paper: np.ndarray, rng: np.random.Generator, height: int, width: int,
                noise: bool = True) -> np.ndarray:
    """Flat, a gentle gradient toward a nearby colour, or (with `noise`) flat with faint noise."""
    kind = rng.integers(3 if noise else 2)
    base = np.broadcast_to(paper.astype(np.float32), (height, width, 3)).copy()
    if kind == 1:
        other = np.clip(paper + rng.integers(-40, 41, size=3), 0, 255)
        ramp = np.linspace(0, 1, width if rng.random() < 0.5 else height, dtype=np.float32)
        ramp = ramp[None, :, None] if ramp.size == width else ramp[:, None, None]
        base = base * (1 - ramp) + other.astype(np.float32) * ramp
    elif kind == 2:
        base += rng.normal(0, 6, size=base.shape).astype(np.float32)
    return np.clip(base, 0, 255).astype(np.uint8)


def render_text(text: str, rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A varied render of `text`: font, layout, size (60–100% of the largest that fits), ink and background
    colours, background kind and placement all drawn from `rng`; sometimes a slight blur. [H, W, 3] uint8."""
    names = font_names()
    font_name = names[rng.integers(len(names))]
    layouts = _layouts(text, height, width)
    lines = layouts[rng.integers(len(layouts))]
    largest = fit_size(lines, font_name, height, width)
    size = max(6, int(round(largest * rng.uniform(0.6, 1.0))))
    ink, paper = _colors(rng)
    background = _background(paper, rng, height, width)
    image = _draw(lines, font_name, size, height, width, ink, background, rng.uniform(0, 1, size=2))
    if rng.random() < 0.2:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.7)))
    return np.asarray(image)


@functools.cache
def glyph_coverage(char: str, font_size: int = FONT_SIZE, bold: int = BOLD_PIXELS) -> tuple[np.ndarray, int, int]:
    """How much of each pixel `char` covers as the glyph grid draws it (0-1, float32; drawn `bold` pixels wider),
    cropped to its ink, and where that crop's top-left corner sits relative to the cell's centre. Cell centres are
    whole pixels, so a glyph looks the same in every cell: drawn once, then placed."""
    font = load_font(BUILTIN, font_size)
    cap_top = font.getbbox("H", anchor="ls")[1]  # negative: the capital height above the baseline
    pad = 2 * font_size  # the cell's centre on the canvas
    canvas = Image.new("L", (2 * pad, 2 * pad), 0)
    draw = ImageDraw.Draw(canvas)
    for dx in range(bold + 1):  # drawn again `bold` pixels to the right, the pair centred on the cell
        draw.text((pad + dx - bold / 2, pad - cap_top / 2), char, font=font, fill=255, anchor="ms")
    coverage = np.asarray(canvas, np.float32) / 255
    rows, columns = np.nonzero(coverage)
    if rows.size == 0:
        return np.zeros((0, 0), np.float32), 0, 0
    top, left = rows.min(), columns.min()
    return coverage[top : rows.max() + 1, left : columns.max() + 1], int(top) - pad, int(left) - pad


def render_grid(text: str, width: int, ink=(0, 0, 0), background: np.ndarray | None = None,
                bold: int = BOLD_PIXELS, font_size: int = FONT_SIZE) -> np.ndarray:
    """`text` laid out on the glyph grid (each character centred in its cell, on its row's baseline), in `ink` on
    `background` (an [H, W, 3] uint8 array; white when None): [H, W, 3] uint8. Each glyph's coverage is drawn once
    (`glyph_coverage`) and blended as drawing it in place would: what no glyph covers keeps the background."""
    grid = GlyphGrid(width)
    if background is None:
        background = np.full((HEIGHT, width, 3), 255, np.uint8)
    uncovered = np.ones((HEIGHT, width), np.float32)
    for char, y, x in grid.placed(text):
        coverage, top, left = glyph_coverage(char, font_size, bold)
        y0, x0 = int(y) + top, int(x) + left
        y1, x1 = y0 + coverage.shape[0], x0 + coverage.shape[1]
        cy0, cx0 = max(0, -y0), max(0, -x0)  # what falls outside the image is cut
        y0, x0, y1, x1 = max(y0, 0), max(x0, 0), min(y1, HEIGHT), min(x1, width)
        if y1 > y0 and x1 > x0:
            uncovered[y0:y1, x0:x1] *= 1 - coverage[cy0 : cy0 + y1 - y0, cx0 : cx0 + x1 - x0]
    ink = np.asarray(ink, np.float32)
    image = background.astype(np.float32) * uncovered[..., None] + ink * (1 - uncovered[..., None])
    return np.rint(image).clip(0, 255).astype(np.uint8)


def render_grid_text(text: str, rng: np.random.Generator, width: int) -> np.ndarray:
    """A glyph-grid render of `text` with `render_text`'s varied ink, flat or gradient background and occasional
    blur (the layout and font are the grid's, fixed by the text; no noisy backgrounds: a pixel-space model that
    must draw them spends its capacity on texture). [H, W, 3] uint8."""
    ink, paper = _colors(rng)
    image = Image.fromarray(render_grid(text, width, ink, _background(paper, rng, HEIGHT, width, noise=False)))
    if rng.random() < 0.2:
        image = image.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 0.7)))
    return np.asarray(image)
