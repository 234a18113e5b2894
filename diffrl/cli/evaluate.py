"""`diffrl evaluate`: held-out strict accuracy of a model on the shapes world, plus a grid."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from diffrl.data.shapes import prompts_by_category, test_prompts, train_prompts
from diffrl.evaluation.shapes import (balanced_eval_set, evaluate_prompts, format_summary, records_as_dicts,
                                     save_records_grid, summarize)
from diffrl.models.checkpoint import load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.utils.device import resolve_device


@dataclass
class EvaluateConfig:
    model_path: Path = SHIPPED_DEMO_MODEL
    """Local diffusers-format model directory (default: the shipped demo model)."""
    checkpoint: Path | None = None
    """A run checkpoint (…/checkpoints/rollout-N: model/, lora/ or transformer/) applied to --model-path."""
    diffusion_model_family: str | None = None
    split: Literal["test", "train"] = "test"
    max_prompts_per_category: int | None = None
    num_seeds: int = 4
    """Images per prompt; image k of the expanded prompt list uses seed `seed + k`."""
    images_per_category: int | None = None
    """Instead of --num-seeds: at least this many images per category, shared out over its prompts
    (the trainer's held-out protocol, --eval-images-per-category; with --seed 10000 the same images)."""
    seed: int = 0
    num_steps: int = 10
    guidance_scale: float = 3.0
    batch_size: int = 64
    device: str = "auto"
    output_dir: Path = Path("runs/eval")


def evaluate(cfg: EvaluateConfig) -> dict:
    device = resolve_device(cfg.device)
    family = load_model(cfg.model_path, cfg.checkpoint, family=cfg.diffusion_model_family, device=device)
    if cfg.max_prompts_per_category is None:
        prompts = test_prompts() if cfg.split == "test" else train_prompts()
    else:
        groups = prompts_by_category(cfg.split).values()
        prompts = [p for group in groups for p in group[: cfg.max_prompts_per_category]]
    seeds: int | list[int] = cfg.num_seeds
    if cfg.images_per_category is not None:
        prompts, seeds = balanced_eval_set(prompts, cfg.images_per_category)
    images_total = seeds * len(prompts) if isinstance(seeds, int) else sum(seeds)
    print(f"evaluating {cfg.checkpoint or cfg.model_path} on {len(prompts)} {cfg.split} prompts, {images_total} images "
          f"({cfg.num_steps} ODE steps, CFG {cfg.guidance_scale}, {device})")
    records, images = evaluate_prompts(
        family, prompts, num_seeds=seeds, seed=cfg.seed, num_steps=cfg.num_steps,
        guidance_scale=cfg.guidance_scale, batch_size=cfg.batch_size, progress=True,
    )
    summary = summarize(records)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": {k: str(v) for k, v in asdict(cfg).items()}, **summary}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records_as_dicts(records)))
    save_records_grid(records, images, out / "grid.png", limit=64)
    print(format_summary(summary))
    print(f"report: {out / 'report.json'}  grid: {out / 'grid.png'}")
    return report
