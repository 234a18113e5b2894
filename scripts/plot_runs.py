"""Compare training runs in one figure: the held-out score against wall clock (left) and rollout reward against
rollout (right). The held-out score is the shapes world's strict accuracy where runs log it, else the held-out
reward, with the held-out judge (`--eval-reward`) dashed beside it in the same colour.
Usage: plot_runs.py OUT.png RUN_DIR[=LABEL]…"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str, runs: list[str]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    loaded = []
    for spec in runs:
        path, _, label = spec.partition("=")
        records = [json.loads(line) for line in (Path(path) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        loaded.append((label or Path(path).name, records))
    strict = any("eval/strict" in r for _, records in loaded for r in records)
    held_out = "eval/strict" if strict else "eval/reward"
    lowest = 1.0
    for label, records in loaded:
        def curve(key):
            return [(r.get("time/elapsed_s", 0.0) / 60, r[key]) for r in records if key in r]

        evals, judged = curve(held_out), curve("eval/judge")
        rewards = [(r["rollout"], r["rollout/reward/raw_mean"]) for r in records if "rollout/reward/raw_mean" in r]
        lowest = min(lowest, *(score for _, score in evals + judged))
        (line,) = left.plot(*zip(*evals), "o-", ms=3, label=label)
        if judged:
            left.plot(*zip(*judged), "s--", ms=3, color=line.get_color(), label=f"{label}, judge")
        right.plot(*zip(*rewards), color=line.get_color(), alpha=0.8, label=label)
    if strict:
        for bar in (0.9, 0.95):  # the bars the shapes issues set
            left.axhline(bar, color="gray", ls=":", lw=1)
    # From 0 when a run starts low; otherwise a little below the lowest point, so close curves stay apart.
    bottom = 0.0 if lowest < 0.5 else round(lowest - 0.05, 1)
    left.set(xlabel="wall clock, rollouts + training (minutes)",
             ylabel="held-out strict accuracy" if strict else "held-out reward (solid), judge (dashed)", ylim=(bottom, 1))
    right.set(xlabel="rollout", ylabel="rollout reward" + (" (partial credit)" if strict else ""))
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
