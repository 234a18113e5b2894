"""Image grids on disk (PNG), optionally with a caption under each cell."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, 3, H, W] floats in [0, 1] → [B, H, W, 3] uint8."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def fit_image(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """A `[3, h, w]` image in [0, 1] resized (bilinear, antialiased) to `[3, height, width]`, for showing it beside
    images of that size; unchanged when it has that size already."""
    if tuple(image.shape[-2:]) == (height, width):
        return image
    resized = torch.nn.functional.interpolate(image[None].float(), size=(height, width), mode="bilinear",
                                              antialias=True, align_corners=False)
    return resized[0].clamp(0, 1)


def wrap_caption(text: str, fits: Callable[[str], bool], max_lines: int) -> list[str]:
    """`text` in at most `max_lines` lines that each `fits`, broken at spaces (a word is cut only when it is
    wider than a whole line) and at its own line breaks; text left over ends the last line with "…"."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        line = ""
        for word in paragraph.split():
            candidate = f"{line} {word}" if line else word
            if fits(candidate):
                line = candidate
                continue
            if line:
                lines.append(line)
            while not fits(word) and len(word) > 1:  # wider than a line on its own
                cut = max(k for k in range(1, len(word)) if fits(word[:k]) or k == 1)
                lines.append(word[:cut])
                word = word[cut:]
            line = word
        lines.append(line)
    if len(lines) <= max_lines:
        return lines
    shown = lines[:max_lines]
    words = shown[-1].split()
    while words and not fits(" ".join(words) + " …"):
        words.pop()
    shown[-1] = " ".join(words + ["…"])
    return shown


_PAD = 2  # pixels between a grid's cells and around them


def _caption_height(lines: int) -> int:
    return 11 * lines + 2


def _cell_origin(k: int, ncols: int, cell_w: int, row_h: int) -> tuple[int, int]:
    """Where cell k (row-major) of a grid starts: its image's top-left pixel."""
    row, col = divmod(k, ncols)
    return _PAD + col * (cell_w + _PAD), _PAD + row * (row_h + _PAD)


def save_grid(
    images: torch.Tensor | np.ndarray,
    path: str | Path,
    *,
    ncols: int,
    captions: Sequence[str] | None = None,
    scale: int = 2,
    caption_lines: int = 2,
) -> Path:
    """Tile images row-major into one PNG; each cell upscaled `scale`× (nearest) for legibility. A caption is
    wrapped at words to the cell's width (`wrap_caption`: a "\n" in it starts a new line), in at most
    `caption_lines` lines."""
    array = to_uint8(images) if isinstance(images, torch.Tensor) else np.asarray(images, dtype=np.uint8)
    n, h, w, _ = array.shape
    cell_w, cell_h = w * scale, h * scale
    caption_h = _caption_height(caption_lines) if captions else 0
    nrows = (n + ncols - 1) // ncols
    grid = Image.new("RGB", (ncols * (cell_w + _PAD) + _PAD, nrows * (cell_h + caption_h + _PAD) + _PAD), (40, 40, 40))
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()

    def fits(line: str) -> bool:
        return draw.textlength(line, font=font) <= cell_w - 2
    for k in range(n):
        x0, y0 = _cell_origin(k, ncols, cell_w, cell_h + caption_h)
        grid.paste(Image.fromarray(array[k]).resize((cell_w, cell_h), Image.NEAREST), (x0, y0))
        if captions:
            for j, line in enumerate(wrap_caption(captions[k], fits, caption_lines)):
                draw.text((x0 + 1, y0 + cell_h + 1 + 11 * j), line, fill=(230, 230, 230), font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path


def grid_cells(path: str | Path, *, n: int, ncols: int, height: int, width: int, scale: int = 2,
               caption_lines: int = 2, captioned: bool = True) -> np.ndarray:
    """The first `n` images of a grid `save_grid` wrote (cells of `height` × `width` images, its `ncols`, `scale`
    and caption settings) as [n, height, width, 3] uint8: exactly the images it was given, its nearest upscale undone."""
    grid = np.asarray(Image.open(path).convert("RGB"))
    cell_w, cell_h = width * scale, height * scale
    caption_h = _caption_height(caption_lines) if captioned else 0
    cells = []
    for k in range(n):
        x0, y0 = _cell_origin(k, ncols, cell_w, cell_h + caption_h)
        cell = grid[y0 : y0 + cell_h : scale, x0 : x0 + cell_w : scale]
        if cell.shape[:2] != (height, width):
            raise ValueError(f"{path}: no cell {k} of {height}×{width} at {ncols} columns (the grid is "
                             f"{grid.shape[1]}×{grid.shape[0]} px)")
        cells.append(cell)
    return np.stack(cells)

