"""`diffrl compare`: a trained checkpoint against the base model on the first test prompts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from diffrl.data.shapes import test_prompts
from diffrl.evaluation.compare import compare_models, rows_as_dicts, save_side_by_side, tally
from diffrl.evaluation.shapes import summarize
from diffrl.models.checkpoint import load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.utils.device import resolve_device


@dataclass
class CompareConfig:
    trained: Path
    """A run checkpoint (…/checkpoints/rollout-N: model/, lora/ or transformer/) or a model directory."""
    base: Path = SHIPPED_DEMO_MODEL
    """The base model (also what a LoRA or transformer-only checkpoint is applied to)."""
    base_checkpoint: Path | None = None
    """Compare two checkpoints: this one is applied to --base for the left column."""
    diffusion_model_family: str | None = None
    num_prompts: int = 32
    """The first N test prompts."""
    num_seeds: int = 1
    seed: int = 0
    num_steps: int = 10
    guidance_scale: float = 1.0
    """CFG for both models (override one with --base-guidance-scale / --trained-guidance-scale)."""
    base_guidance_scale: float | None = None
    trained_guidance_scale: float | None = None
    device: str = "auto"
    output_dir: Path = Path("runs/compare")


def compare(cfg: CompareConfig) -> dict:
    device = resolve_device(cfg.device)
    base = load_model(cfg.base, cfg.base_checkpoint, family=cfg.diffusion_model_family, device=device)
    trained = load_model(cfg.base, cfg.trained, family=cfg.diffusion_model_family, device=device)
    prompts = test_prompts()[: cfg.num_prompts]
    base_cfg = cfg.guidance_scale if cfg.base_guidance_scale is None else cfg.base_guidance_scale
    trained_cfg = cfg.guidance_scale if cfg.trained_guidance_scale is None else cfg.trained_guidance_scale
    rows, base_records, trained_records, base_images, trained_images = compare_models(
        base, trained, prompts, seed=cfg.seed, num_seeds=cfg.num_seeds, num_steps=cfg.num_steps,
        base_guidance_scale=base_cfg, trained_guidance_scale=trained_cfg)
    counts = tally(rows)
    out = cfg.output_dir
    out.mkdir(parents=True, exist_ok=True)
    grid = save_side_by_side(base_records, trained_records, base_images, trained_images, out / "side_by_side.png")
    report = {
        "config": {k: str(v) for k, v in asdict(cfg).items()},
        "win_tie_loss": counts,
        "base": summarize(base_records),
        "trained": summarize(trained_records),
        "prompts": rows_as_dicts(rows),
    }
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'prompt':<48} {'base':>9} {'trained':>9}  outcome")
    for r in rows:
        print(f"{r.prompt:<48} {r.base_strict}/{cfg.num_seeds} {r.base_score:.2f} {r.trained_strict}/{cfg.num_seeds} "
              f"{r.trained_score:.2f}  {r.outcome}")
    b, t = report["base"], report["trained"]
    print(f"strict accuracy (mean over categories): base {b['overall_strict']:.3f} → trained {t['overall_strict']:.3f}; "
          f"partial credit {b['overall_score']:.3f} → {t['overall_score']:.3f}")
    print(f"trained vs base over {len(rows)} prompts: {counts['win']} wins, {counts['tie']} ties, {counts['loss']} losses "
          f"(win or tie: {counts['win'] + counts['tie']})")
    print(f"report: {out / 'report.json'}  grid: {grid}")
    return report
