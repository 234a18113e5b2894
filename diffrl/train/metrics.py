"""Run metrics: JSONL (one record per rollout), TensorBoard (and W&B when asked), and a reward-curve PNG.

On `--resume` from rollout k, `metrics.jsonl` is rewritten (atomically) to the records of rollouts
<= k before the run appends again, so a rollout that is re-run appears once; a last line cut short by
a kill is dropped with a note. Any other unreadable line is an error naming the file and line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from diffrl.utils.atomic import write_text_atomic


def read_metrics(path: Path) -> tuple[list[dict], bool]:
    """The records of a metrics.jsonl, and whether its last line was torn (a write cut short: dropped).
    Raises ValueError naming the file and line for any other line that is not a record."""
    if not path.is_file():
        return [], False
    lines = path.read_bytes().decode("utf-8", errors="replace").split("\n")
    numbered = [(i, line) for i, line in enumerate(lines, 1) if line.strip()]
    records, torn = [], False
    for n, (i, line) in enumerate(numbered):
        try:
            record = json.loads(line)
            if not isinstance(record, dict) or not isinstance(record.get("rollout"), int):
                raise ValueError("no integer 'rollout'")
        except ValueError as err:
            if n == len(numbered) - 1:  # the last line: a write cut short by a kill (or a crash's zeros)
                torn = True
                break
            raise ValueError(f"{path}, line {i}: not a metrics record ({str(err).splitlines()[0]})") from None
        records.append(record)
    return records, torn


def best_by_selection(records: list[dict], key: str = "val/strict") -> dict | None:
    """The logged record with the highest selection metric (the shapes world's validation accuracy,
    `val/strict`), the first of equals: the one `checkpoints/best` holds. None when no record has it."""
    validated = [r for r in records if key in r]
    return max(validated, key=lambda r: r[key]) if validated else None


class MetricsLogger:
    def __init__(self, run_dir: Path, resume_rollout: int | None = None, trackers: tuple = ()):
        """`resume_rollout`: the rollout index a resumed run continues from (its checkpoint's); the
        records of later rollouts, which the run does again, are dropped first. `trackers`: `TrackedRun`s (W&B,
        SwanLab) that get every record and image too."""
        self.run_dir = run_dir
        self.trackers = list(trackers)
        self.path = run_dir / "metrics.jsonl"
        if resume_rollout is not None and self.path.exists():
            self._truncate_to(resume_rollout)
        self._file = self.path.open("a")
        from torch.utils.tensorboard import SummaryWriter

        # purge_step hides the killed run's TensorBoard events of the rollouts done again.
        purge = None if resume_rollout is None else resume_rollout + 1
        self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)

    def _truncate_to(self, rollout: int) -> None:
        records, torn = read_metrics(self.path)
        if torn:
            print(f"note: {self.path}: dropped its last line, cut short by the interrupted run")
        kept = [r for r in records if r["rollout"] <= rollout]
        if len(kept) < len(records):
            print(f"note: {self.path}: dropped {len(records) - len(kept)} record(s) after rollout {rollout}, "
                  "which this run does again")
        unterminated = self.path.read_bytes()[-1:] not in (b"", b"\n")  # an append would join two lines
        if torn or unterminated or len(kept) < len(records):
            write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept), durable=True)

    def log(self, rollout: int, record: dict) -> None:
        self._file.write(json.dumps({"rollout": rollout, **record}) + "\n")
        self._file.flush()
        for key, value in record.items():
            self._tb.add_scalar(key, value, rollout)
        for tracker in self.trackers:
            tracker.log(rollout, record)

    def sync(self) -> None:
        """Make the logged records durable (before a checkpoint that counts them as done)."""
        self._file.flush()
        os.fsync(self._file.fileno())

    def log_images(self, tag: str, images, step: int, captions: list[str] | None = None) -> None:
        """A few evaluation images to TensorBoard (a video by its first frame), captions as text."""
        if images.dim() == 5:  # [N, C, F, H, W]
            images = images[:, :, 0]
        self._tb.add_images(tag, images.float().clamp(0, 1), step)
        if captions:
            self._tb.add_text(f"{tag}/captions", "\n\n".join(f"{i}: {c}" for i, c in enumerate(captions)), step)
        for tracker in self.trackers:
            tracker.log_images(tag, images, step, captions)

    def log_rollout_samples(self, samples, step: int, limit: int = 8) -> None:
        """The first `limit` samples of a rollout (a video by its first frame) with their rewards and prompts,
        under `rollout/samples`: what the policy drew and how it was scored, next to the eval images."""
        # Replayed records keep no images (an empty tensor in their place): nothing to show for them.
        shown = [s for s in samples if s.output is not None and s.output.generated_output is not None
                 and s.output.generated_output.numel() > 0][:limit]
        if not shown:
            return
        images = torch.stack([s.output.generated_output.detach().float().cpu() for s in shown])
        captions = [f"reward {s.reward:.3f} | {s.prompt}" if s.reward is not None else s.prompt for s in shown]
        self.log_images("rollout/samples", images, step, captions)

    def records(self) -> list[dict]:
        return read_metrics(self.path)[0]

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
        for tracker in self.trackers:
            tracker.finish()
