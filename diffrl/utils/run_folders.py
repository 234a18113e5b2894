"""A run folder read back: its flat settings (`RUN/config.json`) and the checkpoint a command loads from it.

What `diffrl evaluate`, `compare` and `serve` take as a run (`diffrl.cli.runs` fills their flags from it). Light on
imports: the CLI's `--help` reads it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

CONFIG_FILE = "config.json"
_ROLLOUT = re.compile(r"rollout-(\d+)")


@dataclass
class Run:
    """A run folder (or none: a bare checkpoint or model) and the checkpoint a command loads from it."""

    folder: Path | None
    checkpoint: Path | None
    flags: dict = field(default_factory=dict)

    def get(self, name: str, default=None):
        value = self.flags.get(name)
        return default if value is None else value


def read_flags(run_dir: Path) -> dict | None:
    """The flat settings in `run_dir/config.json`, or None when there is no readable one."""
    try:
        flags = json.loads((Path(run_dir) / CONFIG_FILE).read_text()).get("flags")
    except (OSError, ValueError, AttributeError):
        return None
    return flags if isinstance(flags, dict) else None


def is_run_folder(path: Path) -> bool:
    return read_flags(path) is not None


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete `checkpoints/rollout-N` of a run (one with a manifest when any has one), or None."""
    found = sorted(((int(m.group(1)), c) for c in (Path(run_dir) / "checkpoints").glob("rollout-*")
                    if c.is_dir() and (m := _ROLLOUT.fullmatch(c.name))), reverse=True)
    with_manifest = [c for _, c in found if (c / "manifest.json").is_file()]
    if with_manifest:
        return with_manifest[0]
    return found[0][1] if found else None


def find_run(path: Path | None) -> Run:
    """`path` as a run folder (its newest checkpoint), a checkpoint inside a run (`RUN/checkpoints/rollout-N`,
    `…/best`, or a folder below one), or a checkpoint or model on its own (no run settings)."""
    if path is None:
        return Run(None, None)
    path = Path(path)
    flags = read_flags(path)
    if flags is not None:
        checkpoint = newest_checkpoint(path)
        if checkpoint is None:
            raise FileNotFoundError(f"{path} is a run folder with no checkpoint yet (checkpoints/rollout-N); "
                                    "evaluate it after its first checkpoint, or pass one explicitly")
        return Run(path, checkpoint, flags)
    for parent in path.resolve().parents[:3]:  # RUN/checkpoints/rollout-N[/lora]
        flags = read_flags(parent)
        if flags is not None:
            return Run(parent, path, flags)
    return Run(None, path)
