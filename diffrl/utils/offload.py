"""Tensors to host memory and back, bit for bit, so that two processes can take turns on one GPU: a
colocated engine's weights while it sleeps, the trainer's optimizer state while the engine samples.

Host copies are pinned when they come from a GPU (fast copies both ways). Moving a tensor changes its
storage, never the object: modules and optimizers keep the tensors they hold. On a CPU device the
"host" copy is a fresh copy of the tensor; nothing is freed, but the path is the same.
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
    back (`restore`)."""

    def __init__(self, modules: Iterable[torch.nn.Module], device: torch.device):
        self.modules, self.device = list(modules), torch.device(device)
        self._moved: list[torch.Tensor] = []

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def _tensors(self) -> list[torch.Tensor]:
        found: dict[int, torch.Tensor] = {}
        for module in self.modules:
            for tensor in (*module.parameters(), *module.buffers()):
                if _same_device(tensor.device, self.device):
                    found.setdefault(id(tensor), tensor)
        return list(found.values())

    @torch.no_grad()
    def offload(self) -> int:
        """Move them to the host; returns the bytes moved (0 when already offloaded)."""
        if self._moved:
            return 0
        self._moved = self._tensors()
        for tensor in self._moved:
            tensor.data = host_copy(tensor.data)
        _synchronize([self.device])
        return sum(t.numel() * t.element_size() for t in self._moved)

    @torch.no_grad()
    def restore(self) -> int:
        """Bring them back to `device`; returns the bytes moved."""
        moved, self._moved = self._moved, []
        for tensor in moved:
            tensor.data = tensor.data.to(self.device, non_blocking=True)
        _synchronize([self.device])
        return sum(t.numel() * t.element_size() for t in moved)


class OptimizerOffload:
    """An optimizer's state tensors (Adam's moments and step counts) moved to host memory and back."""

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


def _same_device(a: torch.device, b: torch.device) -> bool:
    """"cuda" and "cuda:0" name the same device when 0 is the current one."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)
