"""Counting the operations that make the host wait for the accelerator, and where they come from.

On CUDA, an operation whose result the host must read (a tensor's value as a Python number, a shape that
depends on the data, a copy into host memory) blocks the Python thread until every kernel queued before it
has run: launches stop running ahead of the GPU, and the next kernels start only after Python has caught
up. `HostSyncCounter` records each such operation with the first frame of the Python stack inside diffrl,
so a loop's synchronizations can be counted, located and kept from coming back, on any device:

- `item`: `aten._local_scalar_dense` (what `.item()`, `float(t)`, `int(t)`, `bool(t)` and `if t:` call),
  and ops that return a Python value computed on the device (`aten.equal`, `aten.is_nonzero`);
- `shape`: ops whose output size depends on the data (`nonzero`, `masked_select`, indexing or assigning
  with a boolean mask, `unique`, `repeat_interleave` without `output_size`, `bincount`);
- `read`: a tensor read into host memory (`.tolist()`, `.cpu()`, `.numpy()`, `.to("cpu")`);
- `copy_to_host` / `copy_to_device`: a blocking aten copy between the host and an accelerator (a copy to the
  device from pageable memory waits for the stream too; a `non_blocking` one does not), seen only when an
  accelerator is in use.

On a CPU run every tensor is in host memory, so the counter cannot see where a tensor would live on a GPU.
It then counts the operations above on CPU tensors as they would be counted on the device (a denoising or
training step keeps everything it computes on the device), except those torch itself keeps on the host:
a non-fused optimizer's step counters (`torch/optim/`); reads into host memory are counted where diffrl (or
the caller's own code) asks for them, not inside installed libraries. Host-side bookkeeping on tensors that
live on the host on any device (rewards, a response's tensors) is counted too: tell it apart by its line.
Copies to the device (`.to(device)` from the host) are not seen on a CPU run. With an accelerator it counts
only operations that touch one of its tensors, which is exact.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections import Counter
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../diffrl
_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
# Where torch keeps tensors on the host whatever the device (a non-capturable optimizer's step counters).
HOST_RESIDENT_FRAMES = (os.path.join(_TORCH_DIR, "optim") + os.sep,)

_ITEM_OPS = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_SHAPE_OPS = {aten.nonzero.default, aten.masked_select.default, aten.bincount.default,
              aten._unique2.default, aten.unique_dim.default, aten.unique_consecutive.default,
              aten._unique.default}
_READ_METHODS = {"tolist", "cpu", "numpy"}


@dataclass(frozen=True)
class SyncEvent:
    kind: str  # item, shape, read, copy_to_host, copy_to_device
    op: str  # the aten op or tensor method
    where: str  # "diffrl/path.py:line (function)": the innermost frame inside diffrl ("?" when none)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    found = []

    def visit(value):
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for v in value:
                visit(v)
        elif isinstance(value, dict):
            for v in value.values():
                visit(v)

    visit(args)
    visit(kwargs or {})
    return found


def _bool_indices(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


def _dispatch_kind(func, args, kwargs) -> str | None:
    """The kind of synchronization an aten call forces, if any (ignoring where its tensors are)."""
    if func in _ITEM_OPS:
        return "item"
    if func in _SHAPE_OPS:
        return "shape"
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
        return "shape" if _bool_indices(args[1]) else None
    if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
        return None if (kwargs or {}).get("output_size") is not None else "shape"
    # A copy between the host and a device waits for the device unless it is asynchronous (non_blocking, from or
    # into page-locked memory).
    if func is aten._to_copy.default:
        src, device = args[0], (kwargs or {}).get("device")
        if device is None or torch.device(device).type == src.device.type or (kwargs or {}).get("non_blocking"):
            return None
        return "copy_to_host" if torch.device(device).type == "cpu" else "copy_to_device"
    if func in (aten.copy_.default, aten.copy.default):
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else (kwargs or {}).get("non_blocking", False)
        if dst.device.type == src.device.type or non_blocking:
            return None
        return "copy_to_host" if dst.device.type == "cpu" else "copy_to_device"
    return None


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _dispatch_kind(func, args, kwargs)
        if kind is not None:
            self.counter._seen(kind, str(func.overloadpacket.__name__), _tensors(args, kwargs))
        return func(*args, **(kwargs or {}))


class _Functions(TorchFunctionMode):
    """Reads into host memory, seen at the Python level (a CPU tensor's `.cpu()` or `.tolist()` reaches no aten op)."""

    def __init__(self, counter: HostSyncCounter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if (args and isinstance(args[0], torch.Tensor) and (name in _READ_METHODS or (name == "to" and _to_host(args, kwargs)))
                and not _called_from_library()):
            self.counter._seen("read", name, [args[0]])
            with self.counter._muted():  # the aten copy underneath is this read, counted once
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def _called_from_library() -> bool:
    """Whether the Python caller of a tensor method is an installed library (diffusers turning a numpy schedule
    into a tensor, say): host work on a CPU run, and seen as an aten copy anyway where an accelerator is used."""
    for path, _, _ in _frames():
        if path.startswith(_TORCH_DIR + os.sep) and "overrides" in path:
            continue
        if _in_package(path):  # diffrl itself, wherever it is installed
            return False
        return any(part in path for part in (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}"))
    return False


def _to_host(args, kwargs) -> bool:
    """Whether `Tensor.to(...)` names the host as its device in so many words (`"cpu"`). On a CPU run a
    `torch.device` variable cannot be told from the compute device; on a GPU the aten copy is seen anyway."""
    return any(isinstance(value, str) and value.split(":")[0] == "cpu" for value in (*args[1:], kwargs.get("device")))


class HostSyncCounter:
    """Inside `with HostSyncCounter() as c:` every host synchronization of this thread is recorded in `c.events`
    (torch's modes are per thread: run a loop that has a worker thread, such as the engine's, in this one).

    `c.total` (or `c.count(kind)`) counts them; `c.by_site()` counts them per diffrl source line; `c.report()`
    is a table of both. `host_resident_frames`: source folders whose operations read host-resident tensors (not
    counted on a CPU run)."""

    def __init__(self, host_resident_frames: tuple[str, ...] = HOST_RESIDENT_FRAMES):
        self.events: list[SyncEvent] = []
        self.host_resident_frames = host_resident_frames
        self._mute = 0
        self._modes: list = []

    # ------------------------------------------------------------------ recording
    def __enter__(self) -> HostSyncCounter:
        self._modes = [_Functions(self), _Dispatch(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []

    @contextlib.contextmanager
    def _muted(self):
        self._mute += 1
        try:
            yield
        finally:
            self._mute -= 1

    def _seen(self, kind: str, op: str, tensors: list[torch.Tensor]) -> None:
        if self._mute or not self._counts(kind, tensors):
            return
        self.events.append(SyncEvent(kind, op, _where()))

    def _counts(self, kind: str, tensors: list[torch.Tensor]) -> bool:
        if kind.startswith("copy_to") or any(t.device.type not in ("cpu", "meta") for t in tensors):
            return True  # exact: it touches the accelerator
        if any(t.device.type == "meta" for t in tensors):
            return False
        if _accelerator_in_use():
            return False  # CPU tensors on a run that has an accelerator: host work
        return not _host_resident(self.host_resident_frames)

    # ------------------------------------------------------------------ reading
    @property
    def total(self) -> int:
        return len(self.events)

    def count(self, *kinds: str) -> int:
        return sum(1 for e in self.events if not kinds or e.kind in kinds)

    def by_site(self) -> Counter:
        """(where, kind, op) → how many times."""
        return Counter((e.where, e.kind, e.op) for e in self.events)

    def reset(self) -> None:
        self.events.clear()

    def report(self, per: int = 1, label: str = "") -> str:
        """One line per site, its count divided by `per` (e.g. the number of steps run)."""
        lines = [f"{label}{self.total / per:g} host syncs" + (f" per unit ({self.total} over {per})" if per != 1 else "")]
        for (where, kind, op), n in sorted(self.by_site().items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {n / per:6g}  {kind:14s} {op:22s} {where}")
        return "\n".join(lines)


def _accelerator_in_use() -> bool:
    """A run with an accelerator counts exactly: CPU tensors there are host tensors."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _frames():
    """The Python stack, innermost first, outside this file: (path, line, function)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename != _THIS_FILE:
            yield frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
        frame = frame.f_back


def _in_package(path: str) -> bool:
    return path.startswith(_PACKAGE_DIR + os.sep)


def _host_resident(folders: tuple[str, ...]) -> bool:
    """Whether a frame below the innermost diffrl one (the library that made the call) is in `folders`."""
    for path, _, _ in _frames():
        if _in_package(path):
            return False
        if path.startswith(folders):
            return True
    return False


def _where() -> str:
    for path, line, name in _frames():
        if _in_package(path):
            return f"diffrl/{os.path.relpath(path, _PACKAGE_DIR)}:{line} ({name})"
    return "?"
