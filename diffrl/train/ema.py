"""An exponential moving average of a set of parameters, and swapping it into the live module.

Pretraining saves the EMA; DiffusionNFT samples and scores its old policy θ_old with it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from diffrl.utils.offload import host_copy


def warmed_up_decay(decay: float, update: int, warmup: int) -> float:
    """The decay of an EMA's `update`-th update (from 1): min(decay, update / (warmup + update − 1)), diffusers' and
    timm's warm-up ((1 + t) / (W + t) with t = update − 1); `warmup` 0 is `decay` throughout."""
    return decay if warmup == 0 else min(decay, update / (warmup + update - 1))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A parameter's own storage: the local shard of an FSDP2 (DTensor) parameter, else itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class ParameterEMA:
    """Kept per rank on the parameters' local shards when the model is sharded (elementwise math)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], dtype: torch.dtype | None = None, on_host: bool = False):
        """`dtype`: the shadow's (default the parameters'); a frozen copy may be kept in bf16. `on_host`: the shadow
        lives in host memory (pinned when the parameters are on a GPU) and is copied in for each swap, so a frozen
        copy costs the device nothing between uses; such a copy is never updated."""
        self.params, self.on_host = list(params), on_host
        self.shadow = [host_copy(_local(p.detach()).to(dtype=dtype)) if on_host
                       else _local(p.detach()).to(dtype=dtype, copy=True) for p in self.params]
        if on_host:
            _wait_for_copies(self.params)

    @torch.no_grad()
    def update(self, decay: float) -> None:
        """shadow ← decay·shadow + (1 − decay)·param."""
        if self.on_host:
            raise RuntimeError("a ParameterEMA kept on the host is a frozen copy: it is never updated")
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
        with torch.no_grad():
            if self.on_host:  # the live values wait on the host too: the device never holds both
                backup = [host_copy(t) for t in live]
                _wait_for_copies(self.params)
                for dst, src in zip(live, self.shadow, strict=True):
                    dst.copy_(src, non_blocking=True)
            else:
                backup = [t.clone() for t in live]
                torch._foreach_copy_(live, self.shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                if self.on_host:
                    for dst, src in zip(live, backup, strict=True):
                        dst.copy_(src, non_blocking=True)
                    _wait_for_copies(self.params)  # the pinned backup must outlive its copy
                else:
                    torch._foreach_copy_(live, backup)


def _wait_for_copies(params: list[torch.nn.Parameter]) -> None:
    """Host copies are issued asynchronously from pinned memory: wait before a source is overwritten or freed."""
    for device in {p.device for p in params if p.device.type == "cuda"}:
        torch.cuda.synchronize(device)
