"""Activation checkpointing of a family's repeated blocks: every block, or one in every N (`--gradient-checkpointing
-interval N`, torchtitan's selective per-layer checkpointing).

A checkpointed block keeps only its inputs and recomputes its activations in the backward pass: less memory for
one more forward of that block. Checkpointing every block costs a whole extra forward per training step (a LoRA
step goes from about 2 forward-equivalents to 3); checkpointing one block in N keeps N−1 of every N blocks'
activations and recomputes the rest, so memory and recompute fall between the two ends, and a run can take as
much of the speed as its GPU's memory allows (BENCHMARKS.md: FLUX 3 NFT at 1024² peaked at 24.6 GiB with every
block checkpointed and at 103.8 GiB with none, training 66.7 against 50.2 s per rollout, both eager).

Built on diffusers' hook: a model's forward calls `_gradient_checkpointing_func(block, *args)` for each block
when checkpointing is on (some pass the block's bound `__call__`, some a function with the block as its first
argument); the function given here checkpoints the chosen blocks and calls the others directly. Gradients are the
same either way.

What a checkpointed block keeps (`keep`, --gradient-checkpointing-keeps): its inputs alone, or also the output of
every matmul and attention inside it (torch's selective activation checkpointing). The second recomputes only the
elementwise and norm work between the matmuls in the backward (a fraction of a forward's time) while holding the
largest activations; the memory falls between checkpointing and none.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from diffrl.models.batch_invariance import rows_share_one_timestep, shared_timestep
from diffrl.models.blocks import repeated_blocks


def checkpointed_blocks(blocks: Sequence[torch.nn.Module], interval: int) -> list[torch.nn.Module]:
    """The blocks to checkpoint: the first and then one in every `interval`, across the family's block lists in
    order (so a family whose lists differ in width still spreads them)."""
    if interval < 1:
        raise ValueError(f"--gradient-checkpointing-interval must be >= 1, got {interval}")
    return [block for i, block in enumerate(blocks) if i % interval == 0]


def block_of(fn, args: tuple) -> object:
    """The block a checkpointing hook was handed: `fn` itself, the block a bound method (`block.__call__`) belongs
    to, or else the first argument (a function of the block first)."""
    owner = fn
    while not isinstance(owner, torch.nn.Module) and hasattr(owner, "__self__"):
        owner = owner.__self__
    return owner if isinstance(owner, torch.nn.Module) else (args[0] if args else None)


KEEPS = ("inputs", "matmuls")


def _saved_ops() -> frozenset:
    """The ops whose outputs a `keep="matmuls"` block saves: the GEMMs (a linear layer dispatches to one of them)
    and every fused attention kernel the dispatcher may pick (those this build of torch has)."""
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu"]
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


def _recompute_as_forward(selective=None):
    """A checkpoint's `context_fn`, called as the block's forward runs: the recomputation in the backward pass runs
    under the forward's `rows_share_one_timestep` state (and `selective`'s contexts, for --gradient-checkpointing-keeps
    matmuls). The backward runs after the forward's state is gone, and a row-wise layer (`batch_invariance`) takes
    another path without it: eager that path happened to save tensors of the same shapes, compiled it is another
    graph, and torch's checkpoint stopped on the mismatch (Qwen-Image's modulations on a CPU)."""
    forward, recompute = selective() if selective is not None else (contextlib.nullcontext(), contextlib.nullcontext())
    return forward, _entered(recompute, rows_share_one_timestep(shared_timestep()))


@contextlib.contextmanager
def _entered(*managers):
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        yield


def _keep_matmuls(saved: frozenset, ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def enable_gradient_checkpointing(transformer: torch.nn.Module, block_lists: Sequence[str], interval: int = 1,
                                  keep: str = "inputs") -> int:
    """Turn checkpointing on for one block in every `interval` of `block_lists`, each keeping `keep` (see the
    module's docstring); returns how many blocks."""
    if keep not in KEEPS:
        raise ValueError(f"--gradient-checkpointing-keeps must be one of {', '.join(KEEPS)}, got {keep!r}")
    blocks = repeated_blocks(transformer, block_lists)
    chosen = {id(block) for block in checkpointed_blocks(blocks, interval)}
    selective = None
    if keep == "matmuls":
        selective = functools.partial(create_selective_checkpoint_contexts,
                                      functools.partial(_keep_matmuls, _saved_ops()))
    context_fn = functools.partial(_recompute_as_forward, selective)

    def checkpoint_chosen(fn, *args, **kwargs):
        if id(block_of(fn, args)) not in chosen:
            return fn(*args, **kwargs)
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    transformer.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_chosen)
    return len(chosen)
