"""Reading safetensors weights into a module, with one-line errors naming the file."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from diffrl.errors import ModelLoadError


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelLoadError(f"corrupt file: {path} ({err})") from None


def load_weights(module: torch.nn.Module, path: Path) -> None:
    """Every tensor of `module` from `path`, strictly (a missing or extra name is an error)."""
    try:
        module.load_state_dict(read_weights(path), strict=True)
    except RuntimeError as err:
        first_line = str(err).strip().splitlines()[0]
        raise ModelLoadError(f"weights do not fit the config: {path} ({first_line})") from None
