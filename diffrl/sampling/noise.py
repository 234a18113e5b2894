"""Per-sample random streams.

Every output owns a `torch.Generator` seeded with its own seed; its initial noise and every SDE
draw come from that generator alone. Drawing sample by sample (instead of one batched `randn`)
is what makes sample k identical whatever batch, microgroup or engine it lands in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def make_generators(seeds: Sequence[int], device: torch.device | str = "cpu") -> list[torch.Generator]:
    """One generator per seed, on `device` (CUDA generators draw on the GPU without a host copy)."""
    return [torch.Generator(device=device).manual_seed(int(seed)) for seed in seeds]


def randn_per_sample(
    shape: Sequence[int],
    generators: Sequence[torch.Generator],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard normal noise `[B, *shape[1:]]`, row b drawn from `generators[b]`."""
    batch, *rest = shape
    if batch != len(generators):
        raise ValueError(f"noise for {batch} samples needs {batch} generators, got {len(generators)}")
    rows = [torch.randn(rest, generator=g, device=g.device, dtype=torch.float32) for g in generators]
    noise = torch.stack(rows)
    return noise.to(device=device if device is not None else noise.device, dtype=dtype)
