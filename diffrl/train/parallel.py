"""Data parallelism for the trainer: process group, FSDP2 sharding of a family's transformer, and
the full (unsharded) weights the engines and checkpoints need.

Launched with torchrun (`RANK`, `WORLD_SIZE`, `LOCAL_RANK` in the environment); a plain process is
world size 1 and nothing here changes it. Parallelism is applied as a separate step on an
already-built model (torchtitan's pattern): `shard_transformer` wraps each transformer block, then
the root, with `fully_shard`; gradients are averaged over ranks by FSDP's reduce-scatter, so a rank
that averages its loss over its own equal share of the batch computes the global mean's gradient.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from diffrl.models.base import repeated_blocks


@dataclass(frozen=True)
class Parallel:
    rank: int = 0
    world_size: int = 1
    mesh: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard_of(self, total: int, what: str) -> slice:
        """This rank's contiguous equal share of `total` items (refused when it does not divide)."""
        if total % self.world_size:
            raise ValueError(f"{what} = {total} must be divisible by the number of ranks ({self.world_size})")
        size = total // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)


def init_parallel(device: torch.device) -> Parallel:
    """Join the torchrun process group when there is one (gloo on CPU, NCCL on GPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return Parallel()
    if device.type == "cuda":  # before NCCL starts, so its communicator binds to this rank's GPU
        torch.cuda.set_device(rank_device(device))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return Parallel(dist.get_rank(), world_size, init_device_mesh(device.type, (world_size,)))


def finish_parallel(parallel: Parallel) -> None:
    """End a torchrun rank after its last collective: wait for every rank, leave the process group and
    exit at once, skipping the interpreter's teardown. Why: a gloo worker thread may still be releasing
    the last work of an FSDP all-gather, which drops a Python tensor and so needs the GIL; if that lands
    while the interpreter finalizes, the thread dies unwinding and the rank aborts with "terminate
    called without an active exception" (SIGABRT; about one two-rank CPU run in 20 under load,
    pytorch/pytorch#179291). A plain process (world size 1) returns and exits normally."""
    if not parallel.enabled:
        return
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def rank_device(device: torch.device) -> torch.device:
    """This process's device: under torchrun each rank owns the GPU of its LOCAL_RANK."""
    if device.type == "cuda" and device.index is None and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def rank_reward_device(reward_device: str | None, device: torch.device, gpus: int | None = None) -> str | None:
    """Where this process's model rewards load. On a GPU that names its index (each torchrun rank's): unset or a
    bare `cuda` is that GPU, so reward workers (spawned processes, whose bare `cuda` is GPU 0) score on their rank's
    GPU and not all on one; `cuda:N` as given (a reward GPU of its own, e.g. the one after the ranks': every rank's
    reward model then sits there), refused naming the flag when this machine has no GPU N (`gpus`)."""
    if device.type != "cuda":
        return reward_device
    if reward_device in (None, "cuda"):
        return str(device) if device.index is not None else reward_device
    try:
        wanted = torch.device(reward_device)
    except RuntimeError:
        return reward_device  # the reward's own loader names the bad value
    if wanted.type == "cuda" and wanted.index is not None and gpus is not None and wanted.index >= gpus:
        raise ValueError(f"--reward-device {reward_device}: this machine has {gpus} GPU(s), cuda:0 to cuda:{gpus - 1}")
    return reward_device


def shard_transformer(transformer: torch.nn.Module, block_lists: tuple[str, ...], mesh: DeviceMesh,
                      dtype: torch.dtype | None = None) -> None:
    """FSDP2 over each block of the named block lists, then the root. Weights, gradient reduction and
    the optimizer stay fp32; a bf16 forward comes from the family's autocast (`autocast_dtype`).

    `dtype`: the masters' dtype for a transformer loaded in another one (a full finetune's fp32 masters of a bf16
    checkpoint): the parameters outside the blocks are cast first, then each block just before it is sharded, so a
    rank never holds more than one block unsharded in `dtype` (a whole 20.9 B transformer in fp32 is 84 GB per GPU)."""
    from torch.distributed.fsdp import fully_shard  # lazy: FSDP imports torch._dynamo (~1 s); one process needs none

    blocks = repeated_blocks(transformer, block_lists)
    if dtype is not None:  # what transformer.to(dtype) would cast, block by block
        inside = {id(t) for block in blocks for t in (*block.parameters(), *block.buffers())}
        for t in (*transformer.parameters(), *transformer.buffers()):
            if id(t) not in inside and t.is_floating_point():
                t.data = t.data.to(dtype)
    for block in blocks:
        if dtype is not None:
            block.to(dtype)
        fully_shard(block, mesh=mesh)
    # The root too reshards after every forward (FSDP2 keeps a root's gathered weights by default):
    # NFT's old-policy forward swaps the EMA into the shards between forwards, and a root still
    # holding the previous forward's weights would mix the two (tests/parallel_ema_check.py).
    fully_shard(transformer, mesh=mesh, reshard_after_forward=True)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind a (possibly sharded) parameter, gradient or norm. Collective for
    sharded tensors: every rank must call it, in the same order."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_gather_rows(local: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Concatenate every rank's rows in rank order (e.g. rewards, for batch-wide advantages)."""
    if not parallel.enabled:
        return local
    local = local.to(_comm_device(parallel)).contiguous()
    parts = [torch.empty_like(local) for _ in range(parallel.world_size)]
    dist.all_gather(parts, local)
    return torch.cat(parts).cpu()


def _comm_device(parallel: Parallel) -> torch.device:
    """Where collective inputs must live: the GPU for NCCL, the CPU for gloo."""
    if parallel.mesh is not None and parallel.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def any_rank(flag: bool, parallel: Parallel) -> bool:
    """True when `flag` is true on any rank (decisions that every rank must take together)."""
    if not parallel.enabled:
        return flag
    t = torch.tensor([float(flag)], device=_comm_device(parallel))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def mean_over_ranks(stats: dict[str, float], parallel: Parallel) -> dict[str, float]:
    """Per-rank statistics (same keys everywhere) averaged over ranks, for logging."""
    if not parallel.enabled:
        return stats
    keys = sorted(stats)
    t = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=_comm_device(parallel))
    dist.all_reduce(t)
    return dict(zip(keys, (t / parallel.world_size).tolist(), strict=True))
