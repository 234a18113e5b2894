"""An endless stream of (prompt, render) pairs for pretraining the OCR demo model: a generated prompt (its
quoted text never one of the test split's) and a varied render of its quoted text. Each DataLoader worker
draws from its own seeded stream, so a run is reproducible for a fixed number of workers (and fonts)."""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from diffrl.data.ocr.prompts import sample_prompt
from diffrl.data.ocr.render import render_text


class RenderedTexts(IterableDataset):
    def __init__(self, seed: int, height: int = 48, width: int = 256):
        self.seed, self.height, self.width = seed, height, width

    def __iter__(self):
        worker = get_worker_info()
        rng = np.random.default_rng([self.seed, worker.id if worker else 0])
        while True:
            prompt, text = sample_prompt(rng)
            image = render_text(text, rng, self.height, self.width)
            yield prompt, torch.from_numpy(image.copy()).permute(2, 0, 1)  # uint8 [3, H, W]
