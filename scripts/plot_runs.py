"""Compare training runs in one figure: held-out strict accuracy against wall clock (left) and
rollout reward against rollout (right). Usage: plot_runs.py OUT.png RUN_DIR[=LABEL]…"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str, runs: list[str]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    lowest = 1.0
    for spec in runs:
        path, _, label = spec.partition("=")
        records = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        label = label or Path(path).name
        evals = [(r.get("time/elapsed_s", 0.0) / 60, r["eval/strict"]) for r in records if "eval/strict" in r]
        rewards = [(r["rollout"], r["rollout/reward/raw_mean"]) for r in records if "rollout/reward/raw_mean" in r]
        lowest = min(lowest, *(accuracy for _, accuracy in evals))
        (line,) = left.plot(*zip(*evals), "o-", ms=3, label=label)
        right.plot(*zip(*rewards), color=line.get_color(), alpha=0.8, label=label)
    for bar in (0.9, 0.95):  # the bars the shapes issues set
        left.axhline(bar, color="gray", ls=":", lw=1)
    # From 0 when a run starts low; otherwise a little below the lowest point, so close curves stay apart.
    bottom = 0.0 if lowest < 0.5 else round(lowest - 0.05, 1)
    left.set(xlabel="wall clock, rollouts + training (minutes)", ylabel="held-out strict accuracy", ylim=(bottom, 1))
    right.set(xlabel="rollout", ylabel="rollout reward (partial credit)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
