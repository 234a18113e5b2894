"""Weight sync to an engine in another process on the same machine, in buckets of bounded size.

The sender splits named tensors (a full transformer's, or only a LoRA adapter's) into consecutive
buckets of at most `max_bytes`, in their given order; a tensor larger than that goes alone. Each
bucket is copied into one flat byte buffer, the same for every bucket of a sync, which is handed over
once by torch's own tensor sharing: on a GPU as a CUDA IPC handle (the receiver maps the sender's
memory, no copy), on a CPU as shared memory. Only the buffer is pickled, by torch's reductions, and
the receiver unpickles nothing else (`receive_tensor`); names, dtypes, shapes and offsets travel as JSON.

The receiver applies a bucket with `Engine.update_weights` (names, shapes, dtypes and finiteness all
checked before anything is written: a refused bucket changes nothing) and answers; only then is the
next bucket packed, so a sync holds one bucket of extra memory on each side. The weight version
changes with the last bucket only; a refused bucket stops the sync, leaving the buckets before it
applied and the engine's version as it was.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing  # registers torch's tensor-sharing reductions with multiprocessing

from diffrl.errors import RequestError

DEFAULT_BUFFER_BYTES = 512 * 2**20


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the wire formats spell it: `bfloat16`, not `torch.bfloat16`."""
    return str(dtype).removeprefix("torch.")


ALIGN = 64  # every tensor starts at a multiple of this in the buffer, so a byte slice can be viewed as any dtype

_DTYPES = {dtype_name(d): d for d in (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                      torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)}

# What a pickled shared tensor may name (torch.multiprocessing.reductions' CPU and CUDA paths): nothing else loads.
_REBUILDERS = {"rebuild_tensor", "rebuild_cuda_tensor", "rebuild_typed_storage", "rebuild_typed_storage_child",
               "rebuild_storage_fd", "rebuild_storage_filename", "rebuild_storage_empty"}
_CLASSES = {("torch", "Tensor"), ("torch", "Size"), ("torch.storage", "UntypedStorage"),
            ("torch.storage", "TypedStorage"), ("multiprocessing.resource_sharer", "DupFd")}


def tensor_bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan_buckets(tensors: Mapping[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """The names in order, cut into consecutive buckets whose packed size (each tensor padded to `ALIGN`)
    is at most `max_bytes`; a tensor larger than that is a bucket of its own."""
    if max_bytes < 1:
        raise ValueError(f"the weight buffer must hold at least one byte, got {max_bytes}")
    buckets: list[list[str]] = []
    current, size = [], 0
    for name, tensor in tensors.items():
        n = _padded(tensor_bytes(tensor))
        if current and size + n > max_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        buckets.append(current)
    return buckets


def packed_bytes(tensors: Mapping[str, torch.Tensor], names: Sequence[str]) -> int:
    return sum(_padded(tensor_bytes(tensors[n])) for n in names)


def pack(tensors: Mapping[str, torch.Tensor], names: Sequence[str], buffer: torch.Tensor) -> list[dict]:
    """Copy the named tensors into the uint8 `buffer`; returns the layout (JSON-ready) that `unpack` reads."""
    layout, offset = [], 0
    for name in names:
        tensor = tensors[name].detach()
        n = tensor_bytes(tensor)
        buffer[offset:offset + n].view(tensor.dtype).view(tensor.shape).copy_(tensor)
        layout.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
        offset += _padded(n)
    return layout


def unpack(buffer: torch.Tensor, layout: list) -> dict[str, torch.Tensor]:
    """Views into `buffer` by the layout `pack` wrote; a layout that does not fit the buffer is refused
    (`RequestError` on field "weights")."""
    if buffer.dtype != torch.uint8 or buffer.dim() != 1:
        raise RequestError("weights", f"the bucket must be a flat uint8 buffer, got {buffer.dtype} {tuple(buffer.shape)}")
    if not isinstance(layout, list):
        raise RequestError("weights", "the bucket layout must be a list")
    out: dict[str, torch.Tensor] = {}
    for entry in layout:
        try:
            name, dtype, shape, offset = entry["name"], _DTYPES[entry["dtype"]], entry["shape"], entry["offset"]
        except (KeyError, TypeError):
            raise RequestError("weights", f"bad layout entry {str(entry)[:200]}") from None
        if not isinstance(name, str) or name in out:
            raise RequestError("weights", f"tensor name {str(name)[:200]!r} is not a string or is repeated")
        if (not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape)
                or type(offset) is not int or offset < 0 or offset % ALIGN):
            raise RequestError("weights", f"{name[:200]}: bad shape {str(shape)[:100]} or offset {offset!r}")
        n = torch.Size(shape).numel() * dtype.itemsize
        if offset + n > buffer.numel():
            raise RequestError("weights", f"{name[:200]}: bytes {offset}..{offset + n} lie outside the "
                                          f"{buffer.numel()}-byte bucket")
        out[name] = buffer[offset:offset + n].view(dtype).view(shape)
    return out


def share_tensor(tensor: torch.Tensor) -> bytes:
    """`tensor` as torch's sharing reduction: an IPC handle (CUDA) or a shared-memory descriptor (CPU)."""
    return bytes(ForkingPickler.dumps(tensor))


class _SharedTensorUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        allowed = ((module == "torch.multiprocessing.reductions" and name in _REBUILDERS)
                   or (module, name) in _CLASSES
                   or (module == "torch" and name in _DTYPES))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a shared tensor")
        return super().find_class(module, name)


def receive_tensor(payload: bytes) -> torch.Tensor:
    """The tensor `share_tensor` sent, mapped into this process; any other pickle is refused."""
    try:
        tensor = _SharedTensorUnpickler(io.BytesIO(payload)).load()
    except Exception as err:  # noqa: BLE001 - a malformed payload of any kind is a refused bucket
        raise RequestError("weights", f"the bucket is not a shared tensor: {err}") from None
    if not isinstance(tensor, torch.Tensor):
        raise RequestError("weights", f"the bucket is a {type(tensor).__name__}, not a tensor")
    return tensor


def send_in_buckets(tensors: Mapping[str, torch.Tensor], max_bytes: int,
                    send: Callable[[list[dict], torch.Tensor | None, int, int], None]) -> int:
    """Pack `tensors` bucket by bucket into one buffer on their device and call `send(layout, buffer, index,
    count)` for each; `send` returns once the receiver is done with the bucket, which is then overwritten
    by the next (the buffer is the same object every time: share it once). No tensors: one empty bucket
    and no buffer, so the version still moves. Returns the number of buckets."""
    plans = plan_buckets(tensors, max_bytes) or [[]]
    device = next(iter(tensors.values())).device if tensors else torch.device("cpu")
    size = max(packed_bytes(tensors, names) for names in plans)
    buffer = torch.empty(size, dtype=torch.uint8, device=device) if size else None
    if buffer is not None and device.type == "cpu":
        buffer.share_memory_()  # before packing: moving it to shared memory would copy it
    for i, names in enumerate(plans):
        layout = pack(tensors, names, buffer) if names else []
        if device.type == "cuda":
            # The receiver's mapping of the buffer outlives one bucket, so it does not wait on the sharing
            # event again: the copies into the buffer must be finished before the bucket is announced.
            torch.cuda.current_stream(device).synchronize()
        send(layout, buffer, i, len(plans))
    return len(plans)


def apply_bucket(engine, buffer: torch.Tensor | None, layout: list, version: int, last: bool) -> dict:
    """The receiving side: one bucket of the shared `buffer` into `engine` (all or nothing, by
    `Engine.update_weights`); the version moves to `version` with the last bucket only."""
    tensors = unpack(buffer if buffer is not None else torch.empty(0, dtype=torch.uint8), layout)
    new_version = engine.update_weights(tensors, version if last else engine.weight_version)
    if buffer is not None and buffer.is_cuda:  # the copies out of the sender's memory are done before it reuses it
        torch.cuda.synchronize(buffer.device)
    return {"weight_version": new_version, "tensors": len(layout)}
