"""The OCR world's sample grid: the first published test prompts, sampled at fixed seeds, each captioned with
its quoted text (what pretraining's checkpoints show; their OCR scores come from `diffrl evaluate
--prompt-data diffrl/data/ocr/prompts --reward ocr --eval-reward tesseract`)."""

from __future__ import annotations

from pathlib import Path

from diffrl.data.ocr.prompts import test_prompts
from diffrl.evaluation.sampling import TEST_SEED, generate
from diffrl.models.base import FamilyAdapter
from diffrl.utils.atomic import atomic_path
from diffrl.utils.images import save_grid


def sample_grid(family: FamilyAdapter, path: str | Path, *, num_prompts: int = 16, num_seeds: int = 2,
                num_steps: int = 10, guidance_scale: float = 3.0, seed: int = TEST_SEED) -> Path:
    prompts = [p for p in test_prompts()[:num_prompts] for _ in range(num_seeds)]
    was_training = family.transformer.training
    family.transformer.eval()
    try:
        images = generate(family, prompts, [seed + k for k in range(len(prompts))], num_steps=num_steps,
                          guidance_scale=guidance_scale)
    finally:
        family.transformer.train(was_training)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_grid(images, tmp, ncols=2 * num_seeds, captions=[p.split('"')[1] for p in prompts], caption_lines=1)
    return path
