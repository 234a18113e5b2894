"""An exponential moving average of a set of parameters, and swapping it into the live module.

Pretraining saves the EMA; DiffusionNFT samples and scores its old policy θ_old with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch


class ParameterEMA:
    def __init__(self, params: Iterable[torch.nn.Parameter]):
        self.params = list(params)
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """shadow ← decay·shadow + (1 − decay)·param."""
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - decay)

    def state_dict(self) -> list[torch.Tensor]:
        return self.shadow

    def load_state_dict(self, shadow: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for dst, src in zip(self.shadow, shadow, strict=True):
                dst.copy_(src)

    @contextlib.contextmanager
    def swapped_in(self):
        """Inside the block the live parameters hold the EMA values; restored on exit."""
        backup = [p.detach().clone() for p in self.params]
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in self.params], self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], backup)
