"""Does run B's reward curve match run A's within noise? For two run folders trained on the same
rollouts (e.g. 1 GPU vs 2): the first rollout's reward of each, the mean and largest difference
over the shared rollouts, run A's rollout-to-rollout noise (standard deviation of successive
differences / √2), and B's gradient norm over A's (first update, median).
Usage: compare_curves.py RUN_A RUN_B"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def by_rollout(run: Path) -> dict[int, dict]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {r["rollout"]: r for r in records if "rollout/reward/raw_mean" in r}


def main(a_dir: str, b_dir: str) -> None:
    a, b = by_rollout(Path(a_dir)), by_rollout(Path(b_dir))
    shared = sorted(set(a) & set(b))
    reward_a = [a[k]["rollout/reward/raw_mean"] for k in shared]
    diffs = [b[k]["rollout/reward/raw_mean"] - a[k]["rollout/reward/raw_mean"] for k in shared]
    noise = statistics.pstdev([y - x for x, y in zip(reward_a, reward_a[1:])]) / 2**0.5
    ratios = [b[k]["train/grad_norm"] / a[k]["train/grad_norm"] for k in shared]
    first = shared[0]
    print(f"{len(shared)} shared rollouts; first rollout reward A {a[first]['rollout/reward/raw_mean']:.5f} "
          f"B {b[first]['rollout/reward/raw_mean']:.5f}")
    print(f"reward B - A: mean {statistics.mean(diffs):+.4f}, largest |B - A| {max(map(abs, diffs)):.4f}; "
          f"A's rollout-to-rollout noise {noise:.4f}")
    print(f"grad norm B / A: first update {ratios[0]:.3f}, median {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
