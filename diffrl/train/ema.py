"""An exponential moving average of a set of parameters, and swapping it into the live module.

Pretraining saves the EMA; DiffusionNFT samples and scores its old policy θ_old with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage: the local shard of an FSDP2 (DTensor) parameter, else itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class ParameterEMA:
    """Kept per rank on the parameters' local shards when the model is sharded (elementwise math)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dtype: torch.dtype | None = None):
        """`dtype`: the shadow's (default the parameters'); a frozen copy may be kept in bf16."""
        self.params = list(params)
        self.shadow = [_local(p.detach()).to(dtype=dtype, copy=True) for p in self.params]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """shadow ← decay·shadow + (1 − decay)·param."""
        torch._foreach_lerp_(self.shadow, [_local(p.detach()) for p in self.params], 1 - decay)

    def state_dict(self) -> list[torch.Tensor]:
        return self.shadow

    def load_state_dict(self, shadow: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for dst, src in zip(self.shadow, shadow, strict=True):
                dst.copy_(src)

    @contextlib.contextmanager
    def swapped_in(self):
        """Inside the block the live parameters hold the EMA values; restored on exit."""
        live = [_local(p.data) for p in self.params]
        backup = [t.clone() for t in live]
        with torch.no_grad():
            torch._foreach_copy_(live, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, backup)
