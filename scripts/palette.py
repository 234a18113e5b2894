"""The held-out images' palette (`eval/hue_spread`, `eval/chroma`: diffrl/evaluation/diversity.py) of evaluation
grids (`grid.png`, as `diffrl train` writes them under eval/rollout-N/ and device calls bring them back) or of
evaluation folders (their images/*.png): the first N images of each.
Usage: palette.py [--n 32] [--size HxW] GRID.png|EVAL_DIR …  (--size: one image's height and width, for a grid)"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image

from diffrl.evaluation.diversity import palette
from diffrl.evaluation.reward_eval import GRID_CAPTION_LINES, GRID_COLUMNS, GRID_IMAGES
from diffrl.utils.images import grid_cells


def images_of(path: Path, n: int, size: tuple[int, int] | None) -> np.ndarray:
    if path.is_dir():
        files = sorted((path / "images").glob("[0-9]*.png"))[:n]
        return np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
    if size is None:
        raise SystemExit(f"{path}: a grid needs --size HxW (one image's height and width)")
    return grid_cells(path, n=n, ncols=GRID_COLUMNS, height=size[0], width=size[1], caption_lines=GRID_CAPTION_LINES)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--n", type=int, default=GRID_IMAGES)
    parser.add_argument("--size", type=lambda s: tuple(int(v) for v in s.split("x")), default=None)
    args = parser.parse_args()
    for path in args.paths:
        images = images_of(path, args.n, args.size)
        measured = palette(images)
        print(f"hue_spread {measured['hue_spread']:.3f}  chroma {measured['chroma']:5.1f}  {len(images)} images  {path}")


if __name__ == "__main__":
    main()
