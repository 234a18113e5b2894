"""Device and precision choices shared by the commands."""

from __future__ import annotations

import contextlib

import torch


def resolve_device(device: str) -> torch.device:
    """'auto' → CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CUDA (fp32 master weights stay fp32); a no-op elsewhere."""
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
