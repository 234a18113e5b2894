"""Run metrics: JSONL (one record per rollout), TensorBoard, and a reward-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path


def best_by_selection(records: list[dict], key: str = "val/strict") -> dict | None:
    """The logged record with the highest selection metric (the shapes world's validation accuracy,
    `val/strict`), the first of equals: the one `checkpoints/best` holds. None when no record has it."""
    validated = [r for r in records if key in r]
    return max(validated, key=lambda r: r[key]) if validated else None


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

    def log_images(self, tag: str, images, step: int, captions: list[str] | None = None) -> None:
        """A few evaluation images to TensorBoard (a video by its first frame), captions as text."""
        if images.dim() == 5:  # [N, C, F, H, W]
            images = images[:, :, 0]
        self._tb.add_images(tag, images.float().clamp(0, 1), step)
        if captions:
            self._tb.add_text(f"{tag}/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]

    def plot_curves(self) -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = self.records()
        fig, ax = plt.subplots(figsize=(7, 4))
        reward = [(r["rollout"], r["rollout/reward/raw_mean"]) for r in records if "rollout/reward/raw_mean" in r]
        strict = [(r["rollout"], r["eval/strict"]) for r in records if "eval/strict" in r]
        held_out = [(r["rollout"], r["eval/reward"]) for r in records if "eval/reward" in r]
        if reward:
            ax.plot(*zip(*reward), label="rollout reward", alpha=0.7)
        if strict:
            ax.plot(*zip(*strict), "o-", label="held-out strict accuracy (ODE, fixed seeds)")
        if held_out:
            ax.plot(*zip(*held_out), "o-", label="held-out reward (ODE, fixed seeds)")
        ax.set_xlabel("rollout")
        if strict:  # accuracies and the shapes rewards live in [0, 1]; other rewards keep their own scale
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
