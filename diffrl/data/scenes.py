"""Endless streams of rendered (prompt, image) pairs from the train split, for SFT; `RenderedEdits`: the editing
world's (instruction, target, source) triples.

Categories are drawn uniformly, then a prompt within the category, so small categories
(single objects) are not drowned by large ones (position). Each DataLoader worker draws from its
own seeded stream, so a run is reproducible for a fixed number of workers.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from diffrl.data.shapes import parse_prompt, prompts_by_category, render_scene, sample_example


class RenderedScenes(IterableDataset):
    def __init__(self, seed: int, image_size: int = 64, split: str = "train"):
        self.seed = seed
        self.image_size = image_size
        self.groups = [prompts for prompts in prompts_by_category(split).values() if prompts]

    def __iter__(self):
        worker = get_worker_info()
        rng = np.random.default_rng([self.seed, worker.id if worker else 0])
        while True:
            prompts = self.groups[rng.integers(len(self.groups))]
            prompt = prompts[rng.integers(len(prompts))]
            image = render_scene(parse_prompt(prompt), rng, size=self.image_size)
            yield prompt, torch.from_numpy(image.copy()).permute(2, 0, 1)  # uint8 [3, H, W]


class RenderedEdits(IterableDataset):
    """(instruction, target uint8 [3, H, W], source uint8 [3, H, W]) from the editing world's `split`: each example
    is `sample_example(s, split)` (kind uniform, then an instruction of it, then its scene) for a seed `s` drawn from
    the worker's seeded stream; the target is the source with the instruction applied (what `verify_edit` passes)."""

    def __init__(self, seed: int, image_size: int = 64, split: str = "train"):
        self.seed, self.image_size, self.split = seed, image_size, split

    def __iter__(self):
        worker = get_worker_info()
        rng = np.random.default_rng([self.seed, worker.id if worker else 0, 1])
        while True:
            example = sample_example(int(rng.integers(2**62)), self.split, size=self.image_size)
            target, source = (torch.from_numpy(x.copy()).permute(2, 0, 1)
                              for x in (example.target_image(), example.source_image()))
            yield example.instruction, target, source
