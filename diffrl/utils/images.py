"""Image grids on disk (PNG), optionally with a caption under each cell."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def to_uint8(images: torch.Tensor) -> np.ndarray:
    """[B, 3, H, W] floats in [0, 1] → [B, H, W, 3] uint8."""
    return (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()


def save_grid(
    images: torch.Tensor | np.ndarray,
    path: str | Path,
    *,
    ncols: int,
    captions: Sequence[str] | None = None,
    scale: int = 2,
    caption_lines: int = 2,
) -> Path:
    """Tile images row-major into one PNG; each cell upscaled `scale`× (nearest) for legibility."""
    array = to_uint8(images) if isinstance(images, torch.Tensor) else np.asarray(images, dtype=np.uint8)
    n, h, w, _ = array.shape
    cell_w, cell_h = w * scale, h * scale
    caption_h = 11 * caption_lines + 2 if captions else 0
    pad = 2
    nrows = (n + ncols - 1) // ncols
    grid = Image.new("RGB", (ncols * (cell_w + pad) + pad, nrows * (cell_h + caption_h + pad) + pad), (40, 40, 40))
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default()
    chars_per_line = max(cell_w // 6, 8)
    for k in range(n):
        row, col = divmod(k, ncols)
        x0, y0 = pad + col * (cell_w + pad), pad + row * (cell_h + caption_h + pad)
        grid.paste(Image.fromarray(array[k]).resize((cell_w, cell_h), Image.NEAREST), (x0, y0))
        if captions:
            text = captions[k]
            lines = [text[i : i + chars_per_line] for i in range(0, len(text), chars_per_line)][:caption_lines]
            for j, line in enumerate(lines):
                draw.text((x0 + 1, y0 + cell_h + 1 + 11 * j), line, fill=(230, 230, 230), font=font)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    grid.save(path)
    return path
