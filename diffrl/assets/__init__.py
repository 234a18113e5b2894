"""The demo models that ship inside the package, by folder (no torch: the train config's defaults and the recipes
name them, and `diffrl train --help` builds those without loading a model)."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent

# The pretrained demo model that ships with the package (the main job's default).
SHIPPED_DEMO_MODEL = _HERE / "demo-shapes"
# The OCR world's demo model (docs/ocr-world.md), shipped once it is pretrained on a GPU.
SHIPPED_OCR_MODEL = _HERE / "demo-ocr"
# The editing world's demo model (docs/editing-world.md), shipped once it is pretrained on a GPU
# (`diffrl pretrain --world shapes-edit`, scripts/device/pretrain_edit.sh).
SHIPPED_EDIT_MODEL = _HERE / "demo-shapes-edit"
