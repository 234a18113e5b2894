"""Checkpoints with random weights, built in code (no download): one module per family.

Each module has two size presets, `tiny()` (small enough for a CPU test) and `real()` (the family's real
transformer and VAE, with shallow text encoders of the real widths: a prompt is encoded once per request, so
their depth does not change what a benchmark of sampling and training measures), and
`save_random_checkpoint(path, sizes=None, ...)`, which writes a diffusers-format directory (default: `tiny()`)
and returns its path. The demo model is built in memory instead (`demo.random_family(sizes)`;
`family.save(path)` writes it).
"""

import json
from pathlib import Path

import torch

from diffrl.models.components import RANDOM_INIT_FILE, weight_files


@torch.no_grad()
def fill_normal_(param: torch.Tensor, std: float, generator: torch.Generator) -> None:
    """Fill `param` with N(0, std²) drawn by the CPU `generator` and copied to wherever `param` lives: the same
    seed gives the same weights whether the checkpoint is built on the CPU or a GPU (a CPU generator cannot draw
    into a CUDA tensor, and a CUDA generator would draw other numbers)."""
    param.copy_(torch.randn(param.shape, generator=generator, device="cpu", dtype=torch.float32).mul_(std))


def make_weightless(folder: str | Path, config_updates: dict, seed: int = 0) -> None:
    """Turn a saved diffusers model folder into one whose weights are drawn at load (`components.RANDOM_INIT_FILE`):
    its config.json updated with `config_updates` (a shallow build's block counts set back to the real model's), its
    weight files removed, the seed written. The model then costs no disk, and its load builds it on the device."""
    folder = Path(folder)
    config_file = folder / "config.json"
    config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**config, **config_updates}, indent=2) + "\n")
    for path in weight_files(folder):
        path.unlink()
    (folder / RANDOM_INIT_FILE).write_text(json.dumps({"seed": seed}) + "\n")
