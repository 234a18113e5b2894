"""Tensors to host memory and back, bit for bit, so that two processes can take turns on one GPU: a
colocated engine's weights while it sleeps, the trainer's optimizer state while the engine samples.

Host copies are pinned when they come from a GPU (fast copies both ways). Moving a tensor changes its
storage, never the object: modules and optimizers keep the tensors they hold. On a CPU device the
"host" copy is a fresh copy of the tensor; nothing is freed, but the path is the same.

Moving tensors off a GPU frees their blocks to torch's caching allocator, not to the device: the memory
reaches another process (the trainer, the engine) only once the allocator's unused segments go back to
the driver (`release_cached`). That must happen on the device the tensors were moved from, named when
the offload was set up: after the move, every tensor of the modules is on the host, so a device read
from them (`FamilyAdapter.device` is the transformer's first parameter's) names the CPU, and a release
guarded by it would never happen: the sleeping engine would keep every byte reserved.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    host = torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return host


def _synchronize(devices: Iterable[torch.device]) -> None:
    for device in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(device)


def release_cached(device: torch.device | str) -> None:
    """Give the caching allocator's unused segments back to the driver, so that another process on the device
    can use them; a no-op off CUDA. The device's queued work is waited for first: the copies out of the
    freed tensors are done (their host copies complete) before their segments go. `empty_cache` releases
    only segments without a live block: whoever calls this must hold no reference to what was moved."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()


def device_free_bytes(device: torch.device | str) -> int:
    """The device's free memory as its driver counts it (cudaMemGetInfo: every process's use moves it); 0 off CUDA."""
    device = torch.device(device)
    return int(torch.cuda.mem_get_info(device)[0]) if device.type == "cuda" else 0


def stranded_bytes(device: torch.device | str) -> int:
    """Cached bytes that `empty_cache` cannot release: the free parts of this process's segments on `device`
    that still hold a live block (0 off CUDA). After `release_cached`, everything reserved beyond the
    allocated bytes should be this; more means a segment without a live block was kept."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return sum(seg["total_size"] - seg["allocated_size"] for seg in torch.cuda.memory_snapshot()
               if seg.get("device") == index and seg["allocated_size"] > 0)


def family_modules(family) -> list[torch.nn.Module]:
    """Every module a model family holds (transformer, text encoders, VAE, …), each once."""
    found: dict[int, torch.nn.Module] = {}
    for value in vars(family).values():
        for item in value if isinstance(value, list | tuple) else (value,):
            if isinstance(item, torch.nn.Module):
                found.setdefault(id(item), item)
    return list(found.values())


class ModuleOffload:
    """The parameters and buffers of `modules` that live on `device`, moved to host memory (`offload`) and
    back (`restore`). `device` is recorded here, while the tensors are on it: `offload` releases its
    cached segments, which a device read from the (moved) modules would no longer name."""

    def __init__(self, modules: Iterable[torch.nn.Module], device: torch.device):
        self.modules, self.device = list(modules), torch.device(device)
        self._moved: list[torch.Tensor] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def _tensors(self) -> list[torch.Tensor]:
        return [t for t in _module_tensors(self.modules) if _same_device(t.device, self.device)]

    @torch.no_grad()
    def offload(self) -> int:
        """Move them to the host and give their device memory back to the driver (`release_cached`); returns
        the bytes moved (0 when already offloaded)."""
        if self._moved:
            return 0
        moved = self._tensors()
        for tensor in moved:
            tensor.data = host_copy(tensor.data)  # the device storage's last reference goes with the old .data
        _synchronize([self.device])  # every host copy is complete (the copies were queued without blocking)
        self._moved = moved  # the tensor objects, whose storage is now the host's: no reference to device memory
        release_cached(self.device)  # the device recorded at construction, not the modules' (now the host)
        return sum(t.numel() * t.element_size() for t in moved)

    @torch.no_grad()
    def restore(self) -> int:
        """Bring them back to `device`; returns the bytes moved."""
        moved, self._moved = self._moved, []
        for tensor in moved:
            tensor.data = tensor.data.to(self.device, non_blocking=True)
        _synchronize([self.device])
        return sum(t.numel() * t.element_size() for t in moved)


class FrozenOffload:
    """Modules whose weights never change (a frozen text encoder) kept in host memory (pinned where a GPU is) and
    visiting a device: `visit` copies them in, `leave` drops the device copies without copying anything back, since
    the host copy is still exactly theirs. One copy per visit, none per leave: half of `ModuleOffload`'s traffic, and
    from pinned memory, which the device can copy from without staging."""

    def __init__(self, modules: Iterable[torch.nn.Module], *, frozen_only: bool = False):
        """`frozen_only`: the parameters that take no gradient and the buffers; trained parameters (a LoRA adapter's)
        stay where they are."""
        self._tensors = [t for t in _module_tensors(modules)
                         if not (frozen_only and isinstance(t, torch.nn.Parameter) and t.requires_grad)]
        pin = torch.cuda.is_available()
        with torch.no_grad():
            for tensor in self._tensors:
                if tensor.device.type != "cpu" or (pin and not tensor.data.is_pinned()):
                    tensor.data = tensor.data.to("cpu").pin_memory() if pin else tensor.data.to("cpu")
        self._host = [tensor.data for tensor in self._tensors]
        self.visiting: torch.device | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._host)

    @staticmethod
    def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
        return host.to(device, non_blocking=True)  # later work on the device's stream runs after the copy

    @torch.no_grad()
    def visit(self, device: torch.device | str) -> None:
        device = torch.device(device)
        for tensor, host in zip(self._tensors, self._host, strict=True):
            tensor.data = self.to_device(host, device)
        self.visiting = device

    @torch.no_grad()
    def leave(self) -> None:
        """Back to the host copies; the device copies go to the allocator's cache, which reuses their blocks only
        after the work queued on them (stream-ordered), so nothing waits here."""
        for tensor, host in zip(self._tensors, self._host, strict=True):
            tensor.data = host
        self.visiting = None


class OptimizerOffload:
    """An optimizer's state tensors (Adam's moments and step counts) moved to host memory and back. `offload`
    keeps no reference to the device tensors and returns once the host copies are complete; their memory
    stays in this process's allocator cache until the caller releases it (`release_cached` on the trainer's
    device, as `Policy` does when a colocated process needs it)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self._devices: dict[tuple[int, str], torch.device] = {}

    @torch.no_grad()
    def offload(self) -> int:
        """Returns the bytes moved (0 when already offloaded, or before the first step, when there is no state)."""
        if self._devices:
            return 0
        moved = 0
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._devices[(id(state), key)] = value.device
                    state[key] = host_copy(value)
                    moved += value.numel() * value.element_size()
        _synchronize(self._devices.values())
        return moved

    @torch.no_grad()
    def restore(self) -> None:
        devices, self._devices = self._devices, {}
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if (id(state), key) in devices:
                    state[key] = value.to(devices[(id(state), key)], non_blocking=True)
        _synchronize(devices.values())


def _module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every parameter and buffer of `modules`, each once (tied weights and shared submodules included)."""
    found: dict[int, torch.Tensor] = {}
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            found.setdefault(id(tensor), tensor)
    return list(found.values())


def _same_device(a: torch.device, b: torch.device) -> bool:
    """"cuda" and "cuda:0" name the same device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
