"""Choose a model's sampling CFG on validation prompts, then score the test prompts at that CFG.

The validation prompts and seeds are the trainer's (a fixed subset of the *train* prompts), the
test prompts and seeds its held-out protocol's. The test split plays no part in the choice: it is
scored once, at the chosen scale (and, for reference, at --also-test scales).

    python scripts/guidance_by_validation.py [--checkpoint <run>/checkpoints/rollout-N] --device cpu \
        --scales 1 1.5 2 3 --output out.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffrl.data.shapes import test_prompts
from diffrl.evaluation.shapes import (TEST_SEED, VALIDATION_SEED, balanced_eval_set, evaluate_prompts, summarize,
                                     validation_prompts)
from diffrl.models.checkpoint import load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.utils.device import resolve_device


def score(family, prompts, per_category: int, seed: int, guidance: float, num_steps: int) -> dict:
    prompts, seeds = balanced_eval_set(prompts, per_category)
    records, _ = evaluate_prompts(family, prompts, num_seeds=seeds, seed=seed, num_steps=num_steps,
                                  guidance_scale=guidance)
    summary = summarize(records)
    return {"strict": summary["overall_strict"], "score": summary["overall_score"],
            "categories": {c: v["strict"] for c, v in summary["categories"].items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped model")
    parser.add_argument("--scales", type=float, nargs="+", default=[1.0, 1.5, 2.0, 3.0])
    parser.add_argument("--val-images-per-category", type=int, default=64)
    parser.add_argument("--val-prompts-per-category", type=int, default=8)
    parser.add_argument("--test-images-per-category", type=int, default=128)
    parser.add_argument("--also-test", type=float, nargs="*", default=[],
                        help="scales to score on the test prompts besides the chosen one (reference only)")
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    if any(s < 1.0 for s in args.scales + args.also_test):
        parser.error("--scales / --also-test: CFG scales must be >= 1 (1 = no guidance)")

    family = load_model(SHIPPED_DEMO_MODEL, args.checkpoint, device=resolve_device(args.device))
    val = validation_prompts(args.val_prompts_per_category)
    validation = {}
    for scale in args.scales:
        validation[scale] = score(family, val, args.val_images_per_category, VALIDATION_SEED, scale, args.num_steps)
        print(f"validation  CFG {scale:<4}  strict {validation[scale]['strict']:.3f}", flush=True)
    chosen = max(args.scales, key=lambda s: validation[s]["strict"])  # ties: the first (lowest) scale
    test = {}
    for scale in dict.fromkeys([chosen, *args.also_test]):
        test[scale] = score(family, test_prompts(), args.test_images_per_category, TEST_SEED, scale, args.num_steps)
        print(f"test        CFG {scale:<4}  strict {test[scale]['strict']:.3f}{'  (chosen)' if scale == chosen else ''}",
              flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        report = {"checkpoint": str(args.checkpoint) if args.checkpoint else "shipped", "num_steps": args.num_steps,
                  "chosen_scale": chosen, "validation": validation, "test": test}
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
