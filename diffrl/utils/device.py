"""Device and precision choices shared by the commands."""

from __future__ import annotations

import contextlib

import torch


def resolve_device(device: str, flag: str = "--device") -> torch.device:
    """'auto' → CUDA when present, else CPU; a device this machine does not have is refused naming `flag` (torch
    would fail later with an AssertionError or a CUDA error traceback)."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ValueError(f"{flag} {device}: expected auto, cpu, cuda or cuda:N") from None
    check_device(resolved, f"{flag} {device}")
    return resolved


def check_device(device: torch.device, named: str) -> None:
    """A ValueError starting with `named` when `device` is a GPU this machine lacks."""
    if device.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"{named}: this machine has no CUDA GPU that torch can use (pass cpu, or auto)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        count = torch.cuda.device_count()
        raise ValueError(f"{named}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}")


def autocast(device: torch.device, bf16: bool):
    """bf16 autocast on CUDA (fp32 master weights stay fp32); a no-op elsewhere."""
    if bf16 and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def built_in(device: str | torch.device, dtype: torch.dtype):
    """Modules constructed inside the block are made on `device` with `dtype` parameters: a real-size model built
    straight in its stored dtype (LTX-2.3's 22 B transformer and text stack in fp32 would not fit an 80 GB GPU)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(previous)
