"""Run metrics: JSONL (one record per rollout), TensorBoard, and a reward-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path


def best_by_validation(records: list[dict]) -> dict | None:
    """The logged record with the highest validation accuracy (`val/strict`), the first of equals:
    the one `checkpoints/best` holds. None when the run had no validation split."""
    validated = [r for r in records if "val/strict" in r]
    return max(validated, key=lambda r: r["val/strict"]) if validated else None


class MetricsLogger:
    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self._file = self.path.open("a")
        from torch.utils.tensorboard import SummaryWriter

        self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, rollout: int, record: dict) -> None:
        self._file.write(json.dumps({"rollout": rollout, **record}) + "\n")
        self._file.flush()
        for key, value in record.items():
            self._tb.add_scalar(key, value, rollout)

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def plot_curves(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        fig, ax = plt.subplots(figsize=(7, 4))
        reward = [(r["rollout"], r["rollout/reward/raw_mean"]) for r in records if "rollout/reward/raw_mean" in r]
        evals = [(r["rollout"], r["eval/strict"]) for r in records if "eval/strict" in r]
        if reward:
            ax.plot(*zip(*reward), label="rollout reward (partial credit)", alpha=0.7)
        if evals:
            ax.plot(*zip(*evals), "o-", label="held-out strict accuracy (ODE, fixed seeds)")
        ax.set_xlabel("rollout")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        path = self.run_dir / "reward_curve.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path

    def close(self) -> None:
        self._file.close()
        self._tb.close()
