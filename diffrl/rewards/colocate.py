"""`--reward-colocate`: model rewards share the trainer's GPU and leave it while the trainer trains.

Every model reward a process loads (`get_reward`: once per process and device) records here the modules it
scores with. `sleep` moves their parameters and buffers to host memory (pinned, bit for bit:
`utils/offload.py`) and hands the freed device memory back; `wake` brings them back. The trainer's policy
wakes them beside a colocated engine, before a sampling block (a rollout, scored as its microgroups land,
or a held-out evaluation), and puts them to sleep after it. Reward worker processes (`--reward-workers`)
hold their own copies: the pool has every worker do the same (`ProcessRewardPool.sleep` / `wake`).
On a CPU the "move" is a copy in host memory: nothing is freed, but the path is the same.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from diffrl.utils.offload import ModuleOffload

_LOADED: list[ModuleOffload] = []  # the model rewards of this process, each with the device it scores on


def track(modules: Iterable[torch.nn.Module], device: torch.device) -> None:
    """Record a model reward just loaded on `device`."""
    modules = list(modules)
    if modules and device.type == "cpu":
        _own_storage(modules)
    if modules:
        _LOADED.append(ModuleOffload(modules, device))


@torch.no_grad()
def _own_storage(modules: list[torch.nn.Module]) -> None:
    """Weights loaded on the CPU may sit in memory mapped from their file, at any alignment, and CPU BLAS
    rounds differently at another alignment: copied once into allocated memory (as a round trip through host
    memory leaves them), a model scores the same before and after one."""
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            tensor.data = tensor.data.clone()


def sleep() -> int:
    """Move this process's model rewards to host memory; returns the bytes moved."""
    moved = sum(offload.offload() for offload in _LOADED)
    if moved and any(offload.device.type == "cuda" for offload in _LOADED):
        torch.cuda.empty_cache()  # the freed blocks are for the trainer, which may be another process
    return moved


def wake() -> int:
    """Bring them back to their devices; returns the bytes moved."""
    return sum(offload.restore() for offload in _LOADED)


def asleep() -> bool:
    return any(offload.offloaded for offload in _LOADED)


class InProcessRewards:
    """This process's model rewards (inline scoring and held-out evaluation), put to sleep and woken with the
    policy's sampling blocks."""

    def sleep(self) -> int:
        return sleep()

    def wake(self) -> int:
        return wake()
