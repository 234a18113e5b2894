"""Regional compilation: `torch.compile` each of a family's repeated blocks, in place.

Blocks rather than the whole transformer because
- every block of one kind shares one compiled graph (its parameters are graph inputs), so compile time
  is a few blocks', not the model's, and the glue between blocks (embeddings, RoPE tables, the
  batch-invariance wrappers) stays eager;
- `nn.Module.compile` keeps the module and its parameter names, so LoRA adapters, gradient
  checkpointing, FSDP2 units, weight sync and checkpoints see the same model as without it;
- the engine and the trainer share the compiled modules, so rollout and training still run one
  implementation of the forward.
Apply it after LoRA is added (peft replaces layers inside the blocks) and before FSDP2 shards them.
A family whose forward bypasses its blocks' calls compiles that path as well (`FamilyAdapter.compile`; Cosmos3's
video pathway), and names where its graphs live (`FamilyAdapter.compiled_units`) for `uncompiled_block_kinds` and
`block_kinds_at_recompile_limit`.

Modes (`--compile-mode`, torch.compile's `mode`):
- `default`: inductor's fused kernels, no CUDA graphs.
- `max-autotune-no-cudagraphs`: inductor times several GEMM and fusion choices per shape and keeps the
  fastest; compilation takes several times longer (minutes on SD3.5-M), the kernels are the same kind.
`reduce-overhead` (CUDA graphs) is refused (`SpeedOptions.check`): every block of one kind replays one
compiled graph, and in inference cudagraph trees take each call for a new iteration, so the next block's
replay overwrites the output the previous block handed it ("accessing tensor output of CUDAGraphs that has
been overwritten by a subsequent run", on an H200, in the training loop and the engine alike).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.blocks import repeated_blocks
from diffrl.utils.compile_settings import compile_setting, require_compile_settings

# Each kind of block compiles once per grad mode, autocast state and shape regime (static, then dynamic
# batch): a family with three kinds of block (SD3.5's dual-attention, plain and last blocks) needs more
# than dynamo's default of 8 entries, and past the limit it silently runs eager.
RECOMPILE_LIMIT = 64

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs")
REDUCE_OVERHEAD_REFUSED = ("--compile-mode reduce-overhead: CUDA graphs fail under per-block compilation (each "
                           "block's replay overwrites the previous block's output; BENCHMARKS.md, speed levers)")


def check_compile_mode(mode: str | None) -> None:
    """Refuse a mode other than `COMPILE_MODES` (None: default), reduce-overhead with its reason."""
    if mode == "reduce-overhead":
        raise ValueError(REDUCE_OVERHEAD_REFUSED)
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(f"--compile-mode {mode}: expected one of {', '.join(COMPILE_MODES)}")


def compile_blocks(transformer: torch.nn.Module, block_lists: Sequence[str], *, mode: str | None = None,
                   eager_numerics: bool = True, dynamic: bool = False) -> int:
    """Compile every block named by `block_lists` (see `repeated_blocks`) in `mode` (one of `COMPILE_MODES`;
    None: default); returns how many.

    `eager_numerics` keeps the bf16 roundings eager would make between fused ops (inductor's
    `emulate_precision_casts`). The engine's graph (no gradients) and the trainer's (with them) fuse
    differently, so without it the trainer's replay of a rollout step drifts from the engine's log-prob:
    on SD3.5-M at 512² the first pass's mean |Δlogp| was 2.2e-4 (36% of pairs clipped at Flow-GRPO's clip
    range 1e-4) and 4.5e-5 with it (14%), for 7% of the training speed (BENCHMARKS.md). Eager: 1.6e-8. Those
    figures predate `compile_settings`: the setting then held only in the thread that compiled the blocks, not
    in the engine's worker threads, and on a CPU the remaining drift (5.8e-5) went to exactly 0 once it did.

    `dynamic`: every block's graph takes a symbolic batch size from its first call (`batch_dynamic`), so a rollout
    at one batch size and its replay at another run one graph; otherwise the first call's sizes are baked in and the
    next batch size recompiles, with other kernels (BENCHMARKS.md, "Where a compiled replay parts")."""
    check_compile_mode(mode)
    require_compile_settings(dynamo={"recompile_limit": max(compile_setting("dynamo", "recompile_limit"), RECOMPILE_LIMIT)},
                             inductor={"emulate_precision_casts": eager_numerics})
    blocks = repeated_blocks(transformer, block_lists)
    if not blocks:
        raise ValueError(f"no blocks to compile under {list(block_lists)}")
    for block in blocks:
        block.compile(mode=None if mode == "default" else mode)
        if dynamic:
            block._compiled_call_impl = batch_dynamic(block._compiled_call_impl)
    return len(blocks)


def batch_dynamic(compiled):
    """`compiled` (a torch.compile'd callable) with the batch dimension of its tensor arguments marked dynamic
    before each call: the leading dimension of every tensor whose leading size is the first tensor's (the rows), so
    one graph serves every batch size from the first call. Only the batch: `torch.compile(dynamic=True)` makes
    every size symbolic, and inductor fails on some blocks' spatial arithmetic (SANA's, on a CPU) that static sizes
    keep simple. The marks are made here, outside the compiled frame, where dynamo reads them."""
    def call(*args, **kwargs):
        tensors = [t for t in _tensors((args, kwargs)) if t.dim() > 0]
        if tensors:
            rows = tensors[0].shape[0]
            for t in tensors:
                if t.shape[0] == rows:
                    torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(*args, **kwargs)

    call.__wrapped__ = compiled
    return call


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def cached_graphs(family) -> dict[str, list[int]]:
    """Per kind of compiled block (`family.compiled_units()`), how many graphs dynamo holds on each of its code
    objects (graphs are cached on code objects, shared by a class's instances)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    return {name: [len(_debug_get_cache_entry_list(code)) for code in codes]
            for name, codes in family.compiled_units().items()}


def block_kinds_at_recompile_limit(family) -> list[str]:
    """The kinds of compiled block (`family.compiled_units()`) whose dynamo cache is full: a call whose shapes or
    state no cached graph accepts then runs eager, silently, for the rest of the process. Checked after each update,
    because a run meets new shapes late (a prompt's text length, a smaller last microgroup)."""
    limit = compile_setting("dynamo", "recompile_limit")
    return sorted(name for name, counts in cached_graphs(family).items() if any(n >= limit for n in counts))


def uncompiled_block_kinds(family) -> list[str]:
    """The kinds of compiled block (`family.compiled_units()`) for which dynamo holds no graph, once every block has
    run at least once: those run eager, silently. Dynamo skips a compiled module for good when its first call comes
    under a dispatch mode (a FLOP counter, a profiler's mode), which once left benchmark runs that asked for
    --compile eager (BENCHMARKS.md, FLUX 3)."""
    return sorted(name for name, counts in cached_graphs(family).items() if not any(counts))
