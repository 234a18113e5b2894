"""Sample prompts at fixed seeds (ODE) and score them with the shapes verifier.

Image k of the expanded list (each prompt repeated for its seeds, in prompt order) gets seed
`seed + k`, so an evaluation is reproducible and any single image can be regenerated alone. The
sampling itself (`generate`, noise drawn on the CPU) lives in `diffrl.evaluation.sampling`.

`save_samples` writes every scored image (`images/00000.png`, …, lossless) and `records.jsonl` (one
line per image: prompt, seed, verdict, file), so that anyone can re-score an evaluation with another
verifier (`rescore`) or look at what passed.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from diffrl.data.shapes import CATEGORIES, category_of, prompts_by_category, test_prompts, verify
from diffrl.evaluation.sampling import TEST_SEED, VALIDATION_SEED, generate  # noqa: F401  (re-exported)
from diffrl.models.base import FamilyAdapter
from diffrl.utils.atomic import atomic_path, write_text_atomic
from diffrl.utils.images import save_grid, to_uint8
from diffrl.utils.output_files import read_records


@dataclass
class SampleRecord:
    prompt: str
    category: str
    seed: int
    strict: bool
    score: float
    reason: str
    background_delta_e: float = 0.0  # the verdict's background tint (records written before it have none)

    @classmethod
    def judged(cls, prompt: str, category: str, seed: int, verdict) -> SampleRecord:
        """The record of one image and the verifier's verdict on it."""
        return cls(prompt, category, seed, verdict.strict, verdict.score, verdict.reason, verdict.background_delta_e)


def balanced_eval_set(prompts: Sequence[str], images_per_category: int) -> tuple[list[str], list[int]]:
    """Prompts repeated so each category gets at least `images_per_category` images, and how many
    seeds each prompt gets. The test split has 1 single-object prompt but 16 position prompts; a
    category mean over 4 images would swing by 0.25 per image."""
    by_cat: dict[str, list[str]] = defaultdict(list)
    for p in prompts:
        by_cat[category_of(p)].append(p)
    counts = {cat: max(1, -(-images_per_category // len(ps))) for cat, ps in by_cat.items()}
    return list(prompts), [counts[category_of(p)] for p in prompts]


def validation_prompts(per_category: int = 8, seed: int = 0) -> list[str]:
    """A fixed subset of the *train* prompts, at most `per_category` of each category, to choose a
    checkpoint by (early stopping) without looking at the test split. Its images use their own
    seeds, so they are not the rollouts' samples, but the prompts are ones the model trains on."""
    import numpy as np

    chosen = []
    for category, prompts in sorted(prompts_by_category("train").items()):
        ordered = sorted(prompts)
        rng = np.random.default_rng([seed, CATEGORIES.index(category)])
        picks = rng.choice(len(ordered), size=min(per_category, len(ordered)), replace=False)
        chosen += [ordered[i] for i in sorted(picks)]
    return chosen


def evaluate_prompts(
    family: FamilyAdapter,
    prompts: Sequence[str],
    *,
    num_seeds: int | Sequence[int] = 4,
    seed: int = 0,
    num_steps: int = 10,
    guidance_scale: float = 3.0,
    batch_size: int = 64,
    progress: bool = False,
    resolution: int | None = None,
    negative_prompt: str = "",
    height: int | None = None,
    width: int | None = None,
) -> tuple[list[SampleRecord], torch.Tensor]:
    """Sample every prompt `num_seeds` times (one count for all, or one per prompt) and score it."""
    per_prompt = [num_seeds] * len(prompts) if isinstance(num_seeds, int) else list(num_seeds)
    expanded = [p for p, k in zip(prompts, per_prompt, strict=True) for _ in range(k)]
    seeds = [seed + i for i in range(len(expanded))]
    images = generate(family, expanded, seeds, num_steps=num_steps, guidance_scale=guidance_scale,
                      batch_size=batch_size, progress=progress, resolution=resolution, height=height, width=width,
                      negative_prompt=negative_prompt)
    records = []
    for prompt, s, image in zip(expanded, seeds, to_uint8(images)):
        records.append(SampleRecord.judged(prompt, category_of(prompt), s, verify(image, prompt)))
    return records, images


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation / sqrt(n); 0 for fewer than two values)."""
    values = list(values)
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    return mean, (sum((v - mean) ** 2 for v in values) / (n - 1) / n) ** 0.5


def summarize(records: Sequence[SampleRecord]) -> dict:
    """Per-category strict accuracy and mean partial score, each category's image count `n` and the standard
    error of its strict accuracy; `overall` is the mean over categories (GenEval's convention; its standard
    error combines the categories'), `per_sample` the plain mean over images."""
    by_cat: dict[str, list[SampleRecord]] = defaultdict(list)
    for r in records:
        by_cat[r.category].append(r)
    categories = {}
    for cat in CATEGORIES:
        if rs := by_cat.get(cat):
            strict, strict_se = mean_se([float(r.strict) for r in rs])
            categories[cat] = {"strict": strict, "score": sum(r.score for r in rs) / len(rs), "n": len(rs),
                               "strict_se": strict_se}
    per_sample, per_sample_se = mean_se([float(r.strict) for r in records])
    return {
        "categories": categories,
        "overall_strict": sum(c["strict"] for c in categories.values()) / len(categories),
        "overall_strict_se": sum(c["strict_se"] ** 2 for c in categories.values()) ** 0.5 / len(categories),
        "overall_score": sum(c["score"] for c in categories.values()) / len(categories),
        "per_sample_strict": per_sample,
        "per_sample_strict_se": per_sample_se,
        "n": len(records),
        # A drift no score charges (RL can tint the background while every verdict passes): mean over images.
        "background_delta_e": sum(r.background_delta_e for r in records) / len(records),
    }


def format_summary(summary: dict) -> str:
    """The table `diffrl evaluate` prints: per category and overall, strict accuracy ± its standard error, partial
    credit and the image count."""
    lines = [f"{'category':<16} {'strict':>7} {'± se':>7} {'score':>7} {'n':>5}"]
    for cat, c in summary["categories"].items():
        lines.append(f"{cat:<16} {c['strict']:>7.3f} {c.get('strict_se', 0.0):>7.3f} {c['score']:>7.3f} {c['n']:>5}")
    lines.append(f"{'category mean':<16} {summary['overall_strict']:>7.3f} {summary.get('overall_strict_se', 0.0):>7.3f} "
                 f"{summary['overall_score']:>7.3f} {len(summary['categories']):>5}")
    if "per_sample_strict" in summary:
        lines.append(f"{'per sample':<16} {summary['per_sample_strict']:>7.3f} "
                     f"{summary.get('per_sample_strict_se', 0.0):>7.3f} {'':>7} {summary['n']:>5}")
    if "background_delta_e" in summary:
        lines.append(f"background ΔE76 from white, mean: {summary['background_delta_e']:.2f}")
    return "\n".join(lines)


def records_as_dicts(records: Sequence[SampleRecord]) -> list[dict]:
    return [asdict(r) for r in records]


IMAGES_DIR = "images"
RECORDS_FILE = "records.jsonl"


def clear_samples(out_dir: str | Path) -> None:
    """Remove the images and records an earlier evaluation left in `out_dir` (a shorter rerun would
    otherwise leave its extra images behind)."""
    out_dir = Path(out_dir)
    (out_dir / RECORDS_FILE).unlink(missing_ok=True)
    for stale in (out_dir / IMAGES_DIR).glob("[0-9]*.png"):
        stale.unlink()


def save_samples(records: Sequence[SampleRecord], images: torch.Tensor, out_dir: str | Path) -> list[dict]:
    """Every image as `images/<index>.png` (the exact pixels that were scored) and `records.jsonl`, one
    line per image: index, prompt, category, seed, strict, score, reason and file; each file is
    written under a temporary name and renamed. Returns the lines."""
    out_dir = Path(out_dir)
    clear_samples(out_dir)
    rows = []
    for k, (record, pixels) in enumerate(zip(records, to_uint8(images), strict=True)):
        file = f"{IMAGES_DIR}/{k:05d}.png"
        with atomic_path(out_dir / file) as tmp:
            Image.fromarray(pixels).save(tmp, format="PNG")
        rows.append({"index": k, **asdict(record), "file": file})
    write_text_atomic(out_dir / RECORDS_FILE, "".join(json.dumps(row) + "\n" for row in rows))
    return rows


def saved_samples(out_dir: str | Path) -> list[tuple[dict, np.ndarray]]:
    """Each sample an evaluation saved (`--save-images`): its record as written (with the verdict of the
    verifier at evaluation time) and its image, in record order."""
    out_dir = Path(out_dir)
    rows = read_records(out_dir)  # records.jsonl (samples.jsonl in a folder written before the one naming scheme)
    if any("file" not in row for row in rows):
        raise ValueError(f"{out_dir} holds no saved images (its records name no file): evaluate with --save-images")
    return [(row, np.asarray(Image.open(out_dir / row["file"]).convert("RGB"))) for row in rows]


def judge(row: dict, image: np.ndarray) -> SampleRecord:
    """A saved sample's record with the current verifier's verdict."""
    return SampleRecord.judged(row["prompt"], row["category"], row["seed"], verify(image, row["prompt"]))


def rescore(out_dir: str | Path) -> list[SampleRecord]:
    """The saved images of an evaluation scored again by the current verifier, in record order."""
    return [judge(row, image) for row, image in saved_samples(out_dir)]


def short_reason(reason: str) -> str:
    """The verifier's failure in a few words: its kind and what was expected and found, without the object's
    index and the measurements in parentheses ("shape: object 2 expected a circle, found a red stretched shape
    (aspect 1.57)" -> "shape: expected a circle, found a red stretched shape")."""
    reason = re.sub(r"\s*\([^()]*\)", "", reason)
    return " ".join(re.sub(r"\bobject \d+ ", "", reason).split())


def record_caption(record: SampleRecord, label: str = "") -> str:
    """"ok <prompt>" for a strict pass, else "X <prompt>" and, on a line of its own, why it failed."""
    head = f"{label} " if label else ""
    if record.strict:
        return f"{head}ok {record.prompt}"
    return f"{head}X {record.prompt}\n{short_reason(record.reason)}" if record.reason else f"{head}X {record.prompt}"


def save_records_grid(records: Sequence[SampleRecord], images: torch.Tensor, path: str | Path,
                      limit: int | None = None) -> Path:
    """A grid of scored samples, each captioned with its prompt, ok (strict pass) or X and why (`record_caption`)."""
    shown = len(records) if limit is None else min(limit, len(records))
    captions = [record_caption(r) for r in records[:shown]]
    return save_grid(images[:shown], path, ncols=8, captions=captions, caption_lines=5)


def sample_grid(
    family: FamilyAdapter,
    path: str | Path,
    *,
    num_prompts: int = 24,
    num_seeds: int = 2,
    num_steps: int = 10,
    guidance_scale: float = 3.0,
    seed: int = 0,
) -> tuple[Path, list[SampleRecord]]:
    """A captioned grid of the first test prompts (✓ strict pass, ✗ fail), `num_seeds` per prompt."""
    was_training = family.transformer.training
    family.transformer.eval()
    records, images = evaluate_prompts(family, test_prompts()[:num_prompts], num_seeds=num_seeds, seed=seed,
                                       num_steps=num_steps, guidance_scale=guidance_scale)
    family.transformer.train(was_training)
    return save_records_grid(records, images, path), records
