"""Evaluate every checkpoint of a pretraining run on the test split at several CFG scales.

Used to pick the shipped demo checkpoint (good but imperfect) and its default guidance scale.
Writes one JSON with a summary per (checkpoint, scale) and prints a table.

    python scripts/eval_checkpoints.py RUN_DIR --guidance-scales 1 3 5 --out evals.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from diffrl.data.shapes import CATEGORIES, test_prompts
from diffrl.evaluation.shapes import evaluate_prompts, summarize
from diffrl.models.demo import DemoFamily


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--guidance-scales", type=float, nargs="+", default=[1.0, 3.0, 5.0])
    parser.add_argument("--num-seeds", type=int, default=4)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for ckpt in sorted((args.run_dir / "checkpoints").glob("step-*")):
        family = DemoFamily.load(ckpt / "model", device=device)
        for scale in args.guidance_scales:
            records, _ = evaluate_prompts(family, test_prompts(), num_seeds=args.num_seeds, num_steps=args.num_steps,
                                          guidance_scale=scale, batch_size=256)
            rows.append({"checkpoint": ckpt.name, "guidance_scale": scale, **summarize(records)})
            cats = " ".join(f"{rows[-1]['categories'][c]['strict']:.2f}" for c in CATEGORIES)
            print(f"{ckpt.name} cfg={scale:<4} overall={rows[-1]['overall_strict']:.3f} [{cats}]", flush=True)
    args.out.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
