"""Experiment trackers a run also logs to, when asked: Weights & Biases (`--use-wandb`) and SwanLab (`--use-swanlab`).
Each gets the records `metrics.jsonl` gets, at the rollout as step, and the evaluation images. Both packages are
optional: asked for without it installed, the run is refused before anything loads.

A run folder keeps each tracker's run id (`wandb_id`, `swanlab_id`), so `--resume` continues the same tracked run.
A tracker cannot take back what it was sent: the rollouts a killed run logged after its last checkpoint keep their
first values there (`metrics.jsonl` and TensorBoard are rewritten to the resumed run's).
"""

from __future__ import annotations

import importlib
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Tracker:
    """One tracker's package and how its `init` takes the folder it writes into."""

    package: str
    local_dir_keyword: str  # the `init` keyword naming the folder its local files go to
    local_subdir: str | None = None  # under the run folder (None: the run folder itself; the package adds its own)

    @property
    def flag(self) -> str:
        return f"--use-{self.package}"


TRACKERS = {"wandb": Tracker("wandb", "dir"), "swanlab": Tracker("swanlab", "log_dir", "swanlog")}


def asked_trackers(settings) -> list[str]:
    """The trackers a run's CheckpointConfig turns on (`use_wandb`, `use_swanlab`)."""
    return [name for name in TRACKERS if getattr(settings, f"use_{name}")]


def require_tracker(name: str):
    """The tracker's module, or a one-line error saying how to get it."""
    tracker = TRACKERS[name]
    try:
        return importlib.import_module(tracker.package)
    except ImportError:
        raise ValueError(f"{tracker.flag}: the {tracker.package} package is not installed "
                         f"(pip install {tracker.package})") from None


class TrackedRun:
    def __init__(self, name: str, run_dir: Path, settings, config: dict):
        """`name`: a key of TRACKERS; `settings`: the run's CheckpointConfig (its `<name>_project`, `_group`,
        `_run_name`, `_mode`); `config`: the flat settings."""
        tracker, module = TRACKERS[name], require_tracker(name)
        id_file = run_dir / f"{name}_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id + "\n")
        local = run_dir / tracker.local_subdir if tracker.local_subdir else run_dir
        local.mkdir(parents=True, exist_ok=True)
        self._module = module
        self._run = module.init(project=getattr(settings, f"{name}_project"), group=getattr(settings, f"{name}_group"),
                                name=getattr(settings, f"{name}_run_name") or run_dir.name, config=config,
                                mode=getattr(settings, f"{name}_mode"), id=run_id, resume="allow",
                                **{tracker.local_dir_keyword: str(local)})

    def log(self, step: int, record: dict) -> None:
        self._run.log(record, step=step)

    def log_images(self, tag: str, images: torch.Tensor, step: int, captions: list[str] | None = None) -> None:
        """[N, C, H, W] images in [0, 1]."""
        pixels = (images.float().clamp(0, 1) * 255).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        captions = captions or [None] * len(pixels)
        self._run.log({tag: [self._module.Image(p, caption=c) for p, c in zip(pixels, captions)]}, step=step)

    def finish(self) -> None:
        self._run.finish()
