"""Batch invariance: sample k of a request gets the same velocity and the same decoded image whatever
batch, microgroup or trainer micro-batch it sits in (exactly, on CPU), as the rollout contract asks
(docs/architecture.md, "Rollout contract"). Used by the families built on diffusers' transformers and VAEs
(demo, flux3_image, sd3)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch


def embed_rows_one_at_a_time(embedder: torch.nn.Module, *, timestep: bool = True) -> None:
    """Make the timestep MLP batch-invariant: each distinct input row goes through its own
    single-row matmul.

    It is the only matmul whose row count is the batch size (every other one sees batch × tokens
    rows), and BLAS picks different kernels — with different rounding — for 1, 2, 3 or 5 rows
    than for 4 or 16. Rows of a rollout request share one timestep, so this is one call per step
    there; training batches pay one tiny call per distinct timestep. Sample k then gets the same
    velocity whatever batch, microgroup or trainer micro-batch it sits in (exactly, on CPU).
    """
    # A subclass rather than a patched bound method: a deep copy of the model (an old policy, a
    # reference) then calls its own weights, not the original's.
    # `timestep=False` for an MLP over other per-row inputs (SD3's pooled text projection): its rows
    # differ even when a step's timestep is shared, so it always finds the distinct rows.
    mixin = _RowWiseTimestepForward if timestep else _RowWiseForward
    embedder.__class__ = type(f"RowWise{type(embedder).__name__}", (mixin, type(embedder)), {})


# Set while a forward runs whose rows all share one timestep, which the caller knows on the host (a
# rollout step's σ, expanded). Finding the distinct rows takes torch.unique, whose output size is a
# device-to-host sync: two per forward (the timestep and the zero embedding), which on a GPU stall the
# kernel queue of a launch-bound model (`benchmarks/rollout_breakdown.py`). Per thread: the engine and
# the trainer may run forwards at once.
_SHARED_TIMESTEP = threading.local()


@contextmanager
def rows_share_one_timestep(shared: bool) -> Iterator[None]:
    before = getattr(_SHARED_TIMESTEP, "on", False)
    _SHARED_TIMESTEP.on = shared
    try:
        yield
    finally:
        _SHARED_TIMESTEP.on = before


def shared_timestep() -> bool:
    """Whether this thread's forward runs under `rows_share_one_timestep(True)`."""
    return getattr(_SHARED_TIMESTEP, "on", False)


class _RowWiseForward:
    def forward(self, sample, *args, **kwargs):
        one_row = super().forward  # outside the comprehension: zero-argument super needs this frame
        if sample.requires_grad:  # torch.unique has no gradient: every row on its own (training batches)
            return torch.cat([one_row(sample[i : i + 1], *args, **kwargs) for i in range(sample.shape[0])])
        unique, inverse = torch.unique(sample, dim=0, return_inverse=True)
        rows = [one_row(unique[i : i + 1], *args, **kwargs) for i in range(unique.shape[0])]
        return torch.cat(rows)[inverse]


class _RowWiseTimestepForward(_RowWiseForward):
    def forward(self, sample, *args, **kwargs):
        if getattr(_SHARED_TIMESTEP, "on", False):  # every row equal: the same single-row call, no sync
            one_row = super(_RowWiseForward, self).forward
            row = one_row(sample[:1], *args, **kwargs)  # [1, …]: a timestep per token too (Wan2.2 TI2V)
            return row.expand(sample.shape[0], *row.shape[1:]).contiguous()
        return super().forward(sample, *args, **kwargs)


def one_value_for_all_rows(sigma) -> bool:
    """Whether every row of `sigma` is one value, known without reading the tensor: a number, a
    single element, or a tensor expanded from one (stride 0, as the denoising loop passes each step's σ)."""
    if isinstance(sigma, (int, float)):
        return True
    if not isinstance(sigma, torch.Tensor):
        return False
    return sigma.numel() <= 1 or (sigma.dim() == 1 and sigma.stride(0) == 0)


# Pixels a GPU decodes per VAE call: 8 images at 512², 2 at 1024² (a few GiB of activations in fp32).
DECODE_PIXELS_PER_CALL = 8 * 512 * 512


def decode_rows(decode: Callable[[torch.Tensor], torch.Tensor], latents: torch.Tensor, *,
                chunked: bool | None = None, per_call: int | None = None) -> torch.Tensor:
    """`decode` over the rows of `latents`: one row per call on CPU, where BLAS would round a batched
    convolution differently and an image must not depend on its microgroup; on a GPU (or `chunked`) in
    chunks of `DECODE_PIXELS_PER_CALL`, since kernels there differ by batch size anyway and one 512²
    image per call left the VAE mostly idle (BENCHMARKS.md, SD3.5-M). `per_call` (the family's
    `vae_decode_batch`, `--vae-decode-batch`) overrides both on any device: N rows per call, 0 all at once."""
    if per_call is not None:
        if per_call < 0:
            raise ValueError(f"--vae-decode-batch must be >= 0 (0: all at once), got {per_call}")
        return torch.cat([decode(chunk) for chunk in latents.split(per_call or len(latents))])
    if not (latents.device.type != "cpu" if chunked is None else chunked):
        return torch.cat([decode(row[None]) for row in latents])
    first = decode(latents[:1])  # its size says how many images fit in one call
    per_call = max(1, DECODE_PIXELS_PER_CALL // first[0, 0].numel())  # H·W pixels, F·H·W for a video
    rest = [decode(chunk) for chunk in latents[1:].split(per_call)] if len(latents) > 1 else []
    return torch.cat([first, *rest])
