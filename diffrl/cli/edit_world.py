"""Which world `diffrl evaluate` and `diffrl compare` judge a model in without --prompt-data: the shapes world
(text to image) or its editing world (`shapes-edit`, docs/editing-world.md), and the editing world's settings.

The choice: --world, else the run's own --world (its config.json), else the model folder's: a demo model whose
tokenizer knows the edit verbs (`diffrl/assets/demo-shapes-edit`, any `diffrl pretrain --world shapes-edit` model)
is an editing model, whose text-to-image scores would mean nothing.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from diffrl.cli.runs import Run
from diffrl.models.random_checkpoints.demo import EDIT_VERBS
from diffrl.models.registry import resolve_family

EDIT_WORLD = "shapes-edit"
DEFAULT_EDITS_PER_KIND = 16  # without a run: `evaluate_edits`'s default


def folder_world(model_path: Path | None, family: str | None) -> str:
    """shapes-edit for a demo model folder whose tokenizer holds the edit verbs, else shapes."""
    if model_path is None:
        return "shapes"
    try:
        if resolve_family(family, model_path).name != "demo":
            return "shapes"  # a real tokenizer knows "add" and "move" as words, not as a world
        vocab = json.loads((Path(model_path) / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    except (OSError, KeyError, TypeError, ValueError):
        return "shapes"
    return EDIT_WORLD if all(verb in vocab for verb in EDIT_VERBS) else "shapes"


def run_world(cfg, run: Run) -> str | None:
    """--world, else the run's; None when neither says (the model folder decides after the run's settings)."""
    if cfg.world is not None:
        return cfg.world
    if run.folder is not None and run.get("prompt_data") is None:
        return run.get("world") or "shapes"
    return None


def refuse_shapes_flags(cfg, flags: dict[str, object]) -> None:
    """The text-to-image protocol's flags, which the editing world's fixed held-out edits have no use for."""
    for name, default in flags.items():
        if getattr(cfg, name, default) != default:
            raise ValueError(f"--{name.replace('_', '-')} is for the shapes world; --world shapes-edit evaluates the "
                             "task's fixed held-out edits at its fixed seeds: set their number with "
                             "--images-per-category N (edits of each kind)")


def edit_size(cfg) -> int | None:
    """The square side the editing world renders its scenes at (None: the task's 64)."""
    height, width = cfg.height or cfg.resolution, cfg.width or cfg.resolution
    if height != width:
        raise ValueError(f"--world shapes-edit renders square scenes; got {width}x{height} (pass --resolution)")
    return height


def edits_per_kind(cfg, run: Run, least: int = 1) -> object:
    """`cfg` with --images-per-category (edits of each kind) from the run's held-out evaluation where unset."""
    if cfg.images_per_category is not None:
        return cfg
    own = run.get("eval_images_per_category", 0) if run.folder is not None else 0
    return replace(cfg, images_per_category=max(least, own) if own else DEFAULT_EDITS_PER_KIND)
