"""Base versus trained, prompt by prompt: the same prompts and seeds through both models (ODE),
each image scored strictly and by partial credit, and a win/tie/loss per prompt.

A prompt is a win for the trained model when its strict pass count is higher, or equal with a
higher mean partial score; a tie when both are equal (partial scores within 1e-6); else a loss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from diffrl.evaluation.shapes import SampleRecord, evaluate_prompts
from diffrl.models.base import FamilyAdapter
from diffrl.utils.images import save_grid

_TIE_TOLERANCE = 1e-6


@dataclass
class PromptComparison:
    prompt: str
    category: str
    base_strict: int  # passes over the prompt's seeds
    trained_strict: int
    base_score: float  # mean partial credit
    trained_score: float
    outcome: str  # "win" | "tie" | "loss" for the trained model


def outcome(base_strict: int, trained_strict: int, base_score: float, trained_score: float) -> str:
    if trained_strict != base_strict:
        return "win" if trained_strict > base_strict else "loss"
    if abs(trained_score - base_score) <= _TIE_TOLERANCE:
        return "tie"
    return "win" if trained_score > base_score else "loss"


def compare_records(prompts: Sequence[str], base: Sequence[SampleRecord], trained: Sequence[SampleRecord]) -> list[PromptComparison]:
    rows = []
    for prompt in prompts:
        b = [r for r in base if r.prompt == prompt]
        t = [r for r in trained if r.prompt == prompt]
        bs, ts = sum(r.strict for r in b), sum(r.strict for r in t)
        bscore, tscore = sum(r.score for r in b) / len(b), sum(r.score for r in t) / len(t)
        rows.append(PromptComparison(prompt, b[0].category, bs, ts, bscore, tscore, outcome(bs, ts, bscore, tscore)))
    return rows


def compare_models(
    base: FamilyAdapter,
    trained: FamilyAdapter,
    prompts: Sequence[str],
    *,
    seed: int = 0,
    num_seeds: int = 1,
    num_steps: int = 10,
    base_guidance_scale: float = 1.0,
    trained_guidance_scale: float = 1.0,
) -> tuple[list[PromptComparison], list[SampleRecord], list[SampleRecord], torch.Tensor, torch.Tensor]:
    """Both models on the same (prompt, seed) pairs; per-prompt comparisons, records and images."""
    base_records, base_images = evaluate_prompts(base, prompts, num_seeds=num_seeds, seed=seed, num_steps=num_steps,
                                                 guidance_scale=base_guidance_scale)
    trained_records, trained_images = evaluate_prompts(trained, prompts, num_seeds=num_seeds, seed=seed,
                                                       num_steps=num_steps, guidance_scale=trained_guidance_scale)
    return (compare_records(prompts, base_records, trained_records), base_records, trained_records,
            base_images, trained_images)


def tally(rows: Sequence[PromptComparison]) -> dict[str, int]:
    counts = Counter(r.outcome for r in rows)
    return {"win": counts["win"], "tie": counts["tie"], "loss": counts["loss"]}


def save_side_by_side(base_records, trained_records, base_images, trained_images, path: str | Path) -> Path:
    """Pairs of cells, base then trained, four pairs per row; each captioned ok/X and the prompt."""
    cells, captions = [], []
    for b, t, bi, ti in zip(base_records, trained_records, base_images, trained_images, strict=True):
        cells += [bi, ti]
        captions += [("base ok " if b.strict else "base X ") + b.prompt, ("trained ok " if t.strict else "trained X ") + t.prompt]
    return save_grid(torch.stack(cells), path, ncols=8, captions=captions, caption_lines=3)


def rows_as_dicts(rows: Sequence[PromptComparison]) -> list[dict]:
    return [asdict(r) for r in rows]
