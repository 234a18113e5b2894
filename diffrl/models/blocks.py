"""The repeated blocks of a transformer: the unit of FSDP2 sharding, compilation, FP8 and checkpointing."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def repeated_blocks(transformer: torch.nn.Module, block_lists: Sequence[str]) -> list[torch.nn.Module]:
    """The blocks named by a family's `block_lists`, in order: a ModuleList's items, each ModuleList of a
    ModuleDict (per-mode blocks), or a single module. One unit each for FSDP2 and for compilation."""

    def blocks(container: torch.nn.Module) -> list[torch.nn.Module]:
        if isinstance(container, torch.nn.ModuleDict):
            return [b for child in container.values() for b in blocks(child)]
        if isinstance(container, torch.nn.ModuleList):
            return list(container)
        return [container]

    return [b for name in block_lists for b in blocks(getattr(transformer, name))]
