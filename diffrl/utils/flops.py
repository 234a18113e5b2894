"""Counting a model's FLOPs with torch's FlopCounterMode, including attention with fewer key/value heads than
query heads (grouped-query attention, as Cosmos3's transformer runs it): torch's own formula for the fused
attention kernels asserts that query, key and value have the same number of heads."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

aten = torch.ops.aten


def _attention_flops(query_shape, key_shape, value_shape, *args: Any, **kwargs: Any) -> int:
    """Forward FLOPs of softmax(Q Kᵀ) V: two matmuls per query head, whatever the key/value heads' count."""
    *batch, heads, q_len, head_dim = query_shape
    kv_len, value_dim = key_shape[-2], value_shape[-1]
    batch_size = 1
    for size in batch:
        batch_size *= size
    return 2 * batch_size * heads * q_len * kv_len * (head_dim + value_dim)


_FUSED_ATTENTION = (aten._scaled_dot_product_efficient_attention, aten._scaled_dot_product_flash_attention,
                    aten._scaled_dot_product_cudnn_attention)


class _EagerFlopCounter(FlopCounterMode):
    """FlopCounterMode that counts with compilation off (torch.compiler's "force_eager" stance): a compiled module
    (`--compile`'s blocks) first called under a dispatch mode such as this counter is skipped by dynamo for good,
    every later call of it running eager, silently. Counted eager, it is not compiled yet when the counter sees its
    ops, and compiles at its first call afterwards."""

    def __enter__(self):
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stance.__exit__(*exc)


def flop_counter() -> FlopCounterMode:
    """A quiet FlopCounterMode whose fused-attention forward formula accepts grouped-query attention, and which
    counts with compilation off (`_EagerFlopCounter`)."""
    return _EagerFlopCounter(display=False, custom_mapping={op: _attention_flops for op in _FUSED_ATTENTION})
