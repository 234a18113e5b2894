"""One line per training run folder: rollouts done, reward first→last, held-out strict accuracy
before→best→last, the wall clock to reach 0.8 / 0.9 held-out and, for runs with a validation
split, the rollout `checkpoints/best` holds and its held-out accuracy; with --speed a second line of
medians (rollout and train seconds, images/s, train pairs/s) and the peak GPU memory.
Usage: summarize_runs.py [--speed] RUN_DIR…"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

from diffrl.train.metrics import best_by_selection


def summarize(run: Path, window: int = 4) -> str:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["rollout/reward/raw_mean"] for r in records if "rollout/reward/raw_mean" in r]
    evals = [(r["rollout"], r.get("time/elapsed_s", 0.0), r["eval/strict"]) for r in records if "eval/strict" in r]
    w = max(1, min(window, len(rewards) // 2))
    first, last = (sum(rewards[:w]) / w, sum(rewards[-w:]) / w) if rewards else (float("nan"),) * 2

    def reach(target):
        hit = next(((k, t) for k, t, acc in evals if acc >= target), None)
        return f"{hit[0]} ({hit[1]:.0f}s)" if hit else "-"

    best = max(evals, key=lambda e: e[2]) if evals else (0, 0, float("nan"))
    seconds = records[-1].get("time/elapsed_s", float("nan")) if records else float("nan")
    pick, chosen = best_by_selection(records), ""
    if pick is not None:
        chosen = f"  val-best {pick['rollout']} (val {pick['val/strict']:.3f}, held-out {pick.get('eval/strict', float('nan')):.3f})"
    return (f"{run.name:<28} rollouts {len(rewards):>3} ({seconds:>4.0f}s)  reward {first:.3f}→{last:.3f}  "
            f"held-out {evals[0][2] if evals else float('nan'):.3f}→best {best[2]:.3f}@{best[0]}→last "
            f"{evals[-1][2] if evals else float('nan'):.3f}  to0.8 {reach(0.8)}  to0.9 {reach(0.9)}{chosen}")


def speed(run: Path) -> str:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rollouts = [r for r in records if "rollout/seconds" in r]

    def median(key):
        return statistics.median(r[key] for r in rollouts if key in r)

    peak = max((r.get("memory/peak_gib", 0.0) for r in rollouts), default=0.0)
    return (f"{'':<28} median rollout {median('rollout/seconds'):.2f}s ({median('rollout/images_per_s'):.0f} images/s)"
            f"  train {median('train/seconds'):.2f}s ({median('train/pairs_per_s'):.0f} pairs/s)  peak {peak:.1f} GiB")


if __name__ == "__main__":
    show_speed = "--speed" in sys.argv[1:]
    for arg in sys.argv[1:]:
        path = Path(arg)
        if (path / "metrics.jsonl").exists():
            print(summarize(path))
            if show_speed:
                print(speed(path))
