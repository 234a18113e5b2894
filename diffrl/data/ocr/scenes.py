"""An endless stream of (prompt, render) pairs for pretraining the OCR demo model: a generated prompt (its
quoted text never one of the test split's) and a varied render of its quoted text (on the glyph grid for a
grid-layout model: `glyph_grid`). Each DataLoader worker
draws from its own seeded stream, so a run is reproducible for a fixed number of workers (and fonts)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from diffrl.data.ocr.prompts import sample_prompt
from diffrl.data.ocr.render import render_grid_text, render_text


class RenderedTexts(IterableDataset):
    def __init__(self, seed: int, height: int = 48, width: int = 256, glyph_grid: bool = False):
        self.seed, self.height, self.width, self.glyph_grid = seed, height, width, glyph_grid

    def __iter__(self):
        worker = get_worker_info()
        rng = np.random.default_rng([self.seed, worker.id if worker else 0])
        while True:
            prompt, text = sample_prompt(rng)
            image = (render_grid_text(text, rng, self.width) if self.glyph_grid
                     else render_text(text, rng, self.height, self.width))
            yield prompt, torch.from_numpy(image.copy()).permute(2, 0, 1)  # uint8 [3, H, W]
