"""Does a shapes reward pay for extra objects? Samples groups of a checkpoint on the train prompts of
counting and two objects (as a rollout would: one prompt, n seeds) and reports, per reward, the
group-normalized advantage that each kind of sample gets: exactly right, one or more objects too
many, anything else wrong. A reward that gives "too many" a positive advantage teaches the model to
draw extra objects.

    python scripts/reward_hedging.py --checkpoint <run>/checkpoints/rollout-N --device cpu
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path

import numpy as np

from diffrl.data.shapes import prompts_by_category, verify
from diffrl.evaluation.shapes import generate
from diffrl.models.checkpoint import load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rewards import get_reward
from diffrl.utils.device import resolve_device
from diffrl.utils.images import to_uint8

REWARDS = ("shapes", "shapes_balanced", "shapes_exact_count")  # scored through the registry, as in training


def kind_of(verdict) -> str:
    if verdict.strict:
        return "right"
    count = re.match(r"count: expected (\d+) objects?, found (\d+)", verdict.reason)
    return "too many" if count and int(count[2]) > int(count[1]) else "other failure"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped model")
    parser.add_argument("--samples-per-prompt", type=int, default=16)
    parser.add_argument("--seed", type=int, default=30_000)
    parser.add_argument("--num-steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=None, help="also write the table as JSON here")
    args = parser.parse_args()

    family = load_model(SHIPPED_DEMO_MODEL, args.checkpoint, device=resolve_device(args.device))
    train = prompts_by_category("train")
    prompts = train["counting"] + train["two_object"]
    n = args.samples_per_prompt
    expanded = [p for p in prompts for _ in range(n)]
    images = generate(family, expanded, [args.seed + i for i in range(len(expanded))], num_steps=args.num_steps,
                      guidance_scale=args.guidance_scale, progress=True)
    verdicts = [verify(image, prompt) for image, prompt in zip(to_uint8(images), expanded, strict=True)]

    advantages: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in REWARDS}
    kinds = [kind_of(v) for v in verdicts]
    scores = {name: np.array(get_reward(name)(images, expanded)) for name in REWARDS}
    for g in range(len(prompts)):
        group = slice(g * n, (g + 1) * n)
        for name in REWARDS:
            r = scores[name][group]
            a = (r - r.mean()) / (r.std() + 1e-4)  # per-prompt mean and std, as the trainer's default
            for kind, value in zip(kinds[group], a, strict=True):
                advantages[name][kind].append(float(value))

    counts = {kind: kinds.count(kind) for kind in ("right", "too many", "other failure")}
    print(f"{len(prompts)} train prompts (counting, two objects) x {n} samples: {counts}")
    table = {}
    for name in REWARDS:
        row = {kind: {"mean_advantage": float(np.mean(v)), "positive_share": float(np.mean(np.array(v) > 0))}
               for kind, v in advantages[name].items()}
        table[name] = row
        cells = "  ".join(f"{kind}: {row[kind]['mean_advantage']:+.2f} ({row[kind]['positive_share']:.0%} > 0)"
                          for kind in counts if kind in row)
        print(f"{name:<20} {cells}")
    if args.output:
        args.output.write_text(json.dumps({"checkpoint": str(args.checkpoint), "counts": counts, "advantage": table},
                                          indent=2) + "\n")


if __name__ == "__main__":
    main()
