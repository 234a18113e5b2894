"""Reading sglang's pickled tensor payloads (`POST /update_weights_from_tensor`) without running their code.

A pickle names functions that the reader calls to rebuild objects; a hostile one names `os.system`. This
module's `Unpickler.find_class` answers only the exact names a payload of tensors needs, each with a
function of this module that checks its arguments (never the function the name means in torch), and refuses
every other name (`RefusedPayload`, naming it). Admitted (`ADMITTED`):

- `torch._utils._rebuild_tensor_v2` and `torch._utils._rebuild_parameter`: a CPU tensor pickled by value, as
  `pickle.dumps` writes one (a parameter comes back as its plain tensor). The storage must come from the next
  name; offset, size and stride are checked against it; backward hooks and tensor metadata must be empty.
- `torch.storage._load_from_bytes`: the storage's bytes. torch would read them with `torch.load(...,
  weights_only=False)` (an unrestricted unpickle); here they are parsed as the one layout torch writes for a
  storage (`torch.save`'s legacy format: three plain-data pickles, one storage record whose only global is
  the storage class, its key, the raw bytes), with the same restricted unpickler and no persistent ids but
  that record's.
- `collections.OrderedDict` (the empty backward hooks), `torch.Size`, the torch dtypes in `DTYPES`, and
  sglang's `FlattenedTensorMetadata` (`sglang.srt.weight_sync.tensor_bucket` or, in older sglang,
  `sglang.srt.model_executor.model_runner`), rebuilt as `Metadata` here: its six fields, checked.

- CUDA tensors shared by CUDA IPC, what miles-diffusion's updater sends (it moves each tensor to its GPU, calls
  sglang's `monkey_patch_torch_reductions`, and pickles with `MultiprocessingSerializer`, torch's ForkingPickler):
  `torch.multiprocessing.reductions.rebuild_cuda_tensor` and sglang's patched copy of it,
  `sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified` (older sglang: `sglang.srt.patch_torch`), which
  names the device by its UUID instead of its index; with them `torch.Tensor` and `torch.storage.TypedStorage`,
  the classes the reduction names, answered as inert markers (a payload cannot call or build them). Reading the
  pickle runs nothing: it yields an `IpcTensor`, the fifteen arguments checked as data (the markers, a dtype of
  `DTYPES`, size, stride and offset inside the storage, a storage of whole elements up to `MAX_IPC_BYTES`, a
  memory handle of the layout torch's caching allocator writes for a cudaMalloc block, a reference-counter name
  of torch's `/torch_<pid>_<n>_<n>` form with an offset inside its 10,000 counters, a 64-byte event handle,
  booleans where booleans belong). Opening it (`open_ipc_tensor`) is a separate step the endpoint takes only for
  a loopback peer on a server with CUDA: the device index must be one this process sees (or the UUID one of its
  devices'), the counter file must exist in /dev/shm with room for the counters, torch's own
  `rebuild_cuda_tensor` maps the memory, the mapped range must lie inside the allocation the driver reports
  (`cuMemGetAddressRange`; a storage offset beyond it is refused before any byte is read), and the tensor is
  cloned into the server's memory at once (the mapping is released before the request answers).

Why admit a pickle at all. The project's rule is that nothing crossing a boundary is unpickled; this endpoint is the
one exception, because miles' client sends nothing else and cannot be changed. What makes it bearable: the
unpickler resolves no name to a callable of Python or torch (each admitted name is a function of this module that
checks its arguments, or an inert marker), so a hostile pickle can only build dicts, lists, tuples, strings,
numbers and the records above; the only effect of a CUDA IPC record is to map device memory that another process
on this host exported and to adjust one of torch's reference counters for it, both of which torch does on its own
for any process that receives a shared tensor; and that happens only for a loopback peer, the same host the memory
must come from. What remains: a local process that may update the weights can make the server read GPU memory
another local process exported (an IPC handle is a capability: only its exporter can hand it out); that is what
the endpoint is for.

Refused, with the reason in the message (`REFUSED_WHY`): torch.multiprocessing's CPU sharing reductions, what
`MultiprocessingSerializer` writes for a CPU tensor. `rebuild_storage_fd` connects to a socket address the payload
gives (`multiprocessing.resource_sharer.DupFd`) and only works with the sender's multiprocessing key;
`rebuild_storage_filename` maps a shared-memory file the payload names. Refused too: CUDA memory handles of
torch's expandable segments (`expandable_segments:True`: the receiver takes file descriptors out of the process
whose pid the handle names), protocol 0/1 object pickles (`copyreg._reconstructor`), persistent ids outside a
storage's bytes, and every other global.

Verified on CPU only (tests/test_update_weights_from_tensor.py): the unpickling, every check on the records, the
refusals, and the endpoint's routing of IPC records. Opening a real CUDA IPC handle from another process through
the endpoint is what scripts/device/ipc_weight_sync.sh checks on a GPU; it has not run yet.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import math
import os
import pickle
import re
import struct
from dataclasses import dataclass
from typing import Any, Callable

import torch

from diffrl.errors import RequestError

FIELD = "serialized_named_tensors"

DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name) for name in (
        "float64", "float32", "float16", "bfloat16", "uint8", "int8", "int16", "int32", "int64", "bool",
        "float8_e4m3fn", "float8_e5m2") if isinstance(getattr(torch, name, None), torch.dtype)}

# torch.save's legacy storage classes (and the untyped one) and the dtype of their elements.
STORAGE_DTYPES: dict[tuple[str, str], torch.dtype] = {
    ("torch.storage", "UntypedStorage"): torch.uint8, ("torch", "UntypedStorage"): torch.uint8,
    ("torch", "DoubleStorage"): torch.float64, ("torch", "FloatStorage"): torch.float32,
    ("torch", "HalfStorage"): torch.float16, ("torch", "BFloat16Storage"): torch.bfloat16,
    ("torch", "ByteStorage"): torch.uint8, ("torch", "CharStorage"): torch.int8,
    ("torch", "ShortStorage"): torch.int16, ("torch", "IntStorage"): torch.int32,
    ("torch", "LongStorage"): torch.int64, ("torch", "BoolStorage"): torch.bool,
}

_SHARED = ("a tensor in shared memory (MultiprocessingSerializer's CPU tensor): its storage is the sending process's "
           "memory; send CPU tensors pickled by value (pickle.dumps), CUDA tensors by CUDA IPC, or use "
           "/update_weights_from_disk")
REFUSED_WHY = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _SHARED,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _SHARED,
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"):
        "a shared-memory file descriptor (MultiprocessingSerializer's CPU tensor): it connects to a socket the "
        "payload names; send CPU tensors pickled by value (pickle.dumps) or use /update_weights_from_disk",
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"):
        "a shared-memory file name (torch's file_system sharing); send CPU tensors pickled by value instead",
}

_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


class RefusedPayload(RequestError):
    """The payload is not a pickle of tensors this module reads; nothing of it was run."""

    def __init__(self, message: str):
        super().__init__(FIELD, message)


class _Storage:
    """A storage read from its bytes: one flat uint8 buffer and the dtype its tensor views it as."""

    __slots__ = ("data", "dtype")

    def __init__(self, data: torch.Tensor, dtype: torch.dtype):
        self.data, self.dtype = data, dtype


class Metadata:
    """sglang's `FlattenedTensorMetadata`: where one tensor lies in a flattened bucket."""

    FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")

    def __setstate__(self, state: Any) -> None:  # pickle's BUILD: the dataclass's fields, nothing else
        if not isinstance(state, dict) or set(state) != set(self.FIELDS):
            keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise RefusedPayload(f"FlattenedTensorMetadata with fields {keys}, expected {list(self.FIELDS)}")
        self.__dict__.update(state)

    def __reduce__(self):  # never pickled again from here
        raise TypeError("Metadata is read, not written")


def _check_int(value: Any, what: str) -> int:
    if type(value) is not int or value < 0:
        raise RefusedPayload(f"{what} must be a non-negative integer, got {type(value).__name__}")
    return value


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = False,
                       backward_hooks: Any = None, metadata: Any = None) -> torch.Tensor:
    if not isinstance(storage, _Storage):
        raise RefusedPayload("a tensor's storage must be its bytes (torch.storage._load_from_bytes)")
    if backward_hooks or metadata:
        raise RefusedPayload("a tensor with backward hooks or tensor metadata is refused")
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) != len(stride) or len(size) > 8:
        raise RefusedPayload("a tensor's size and stride must be tuples of one length (at most 8)")
    offset = _check_int(offset, "a tensor's storage offset")
    size = tuple(_check_int(s, "a tensor's size") for s in size)
    stride = tuple(_check_int(s, "a tensor's stride") for s in stride)
    itemsize = torch.empty((), dtype=storage.dtype).element_size()
    elements = storage.data.numel() // itemsize
    if math.prod(size) and offset + sum((s - 1) * st for s, st in zip(size, stride)) >= elements:
        raise RefusedPayload(f"a tensor of size {size} and stride {stride} at offset {offset} lies beyond its "
                             f"storage of {elements} elements")
    flat = storage.data[: elements * itemsize].view(storage.dtype)
    return torch.as_strided(flat, size, stride, offset)


def _rebuild_parameter(data: Any, requires_grad: Any = False, backward_hooks: Any = None) -> torch.Tensor:
    if not isinstance(data, torch.Tensor) or backward_hooks:
        raise RefusedPayload("a parameter must hold a tensor and no backward hooks")
    return data


def _load_storage_bytes(blob: Any) -> _Storage:
    """A storage from torch.save's legacy layout (what a storage's `__reduce__` writes), read as data."""
    if not isinstance(blob, bytes):
        raise RefusedPayload("a storage's bytes must be bytes")
    stream = io.BytesIO(blob)
    try:
        header = [_Unpickler(stream, mode="data").load() for _ in range(3)]
        if header[0] != _LEGACY_MAGIC or header[1] != _LEGACY_PROTOCOL or not isinstance(header[2], dict) \
                or header[2].get("little_endian") is not True:
            raise RefusedPayload("a storage's bytes are not torch.save's little-endian storage layout")
        record = _Unpickler(stream, mode="record")
        if record.load() is not _RECORD or record.record is None:
            raise RefusedPayload("a storage's bytes must hold exactly one storage")
        keys = _Unpickler(stream, mode="data").load()
        dtype, key, numel = record.record
        if keys != [key]:
            raise RefusedPayload("a storage's bytes must hold exactly one storage")
        (count,) = struct.unpack("<q", stream.read(8))
        itemsize = torch.empty((), dtype=dtype).element_size()
        data = stream.read()
    except RequestError:
        raise
    except (pickle.UnpicklingError, EOFError, struct.error, ValueError, TypeError, OverflowError) as err:
        raise RefusedPayload(f"a storage's bytes could not be read: {str(err)[:200]}") from None
    if count != numel or len(data) != count * itemsize:
        raise RefusedPayload(f"a storage declares {numel} elements of {dtype} and holds {len(data)} bytes")
    return _Storage(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else
                    torch.empty(0, dtype=torch.uint8), dtype)


# ---------------------------------------------------------------------------------------------- CUDA IPC tensors
MAX_IPC_BYTES = 1 << 40
"""Largest CUDA storage a record may name (the endpoint also caps the tensor at its weights limit)."""
CUDA_IPC_HANDLE_SIZE = 64  # cudaIpcMemHandle_t, cudaIpcEventHandle_t
REF_COUNTERS = 10_000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters in one reference-counter file
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9]{1,10}_[0-9]{1,20}_[0-9]{1,20}")
_DEVICE_UUID = re.compile(r"(GPU-)?[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class _Marker:
    """A class a CUDA IPC reduction names (`torch.Tensor`, `torch.storage.TypedStorage`), answered as an inert
    token: a payload cannot call it, build it or reach its attributes."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"<{self.name}>"

    def __reduce__(self):
        raise TypeError("markers are read, not written")


TENSOR_CLASS, TYPED_STORAGE = _Marker("torch.Tensor"), _Marker("torch.storage.TypedStorage")


@dataclass(frozen=True)
class IpcTensor:
    """A CUDA tensor another process on this host shares by CUDA IPC, as read from the pickle: the arguments of
    torch's `rebuild_cuda_tensor`, checked as data. Nothing is opened until `open_ipc_tensor`."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: int | str  # an index, or the device's UUID (sglang's patched reduction)
    handle: bytes | None
    storage_bytes: int
    storage_offset_bytes: int
    ref_counter: bytes | None
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync: bool

    def numel(self) -> int:
        return math.prod(self.size)

    def dim(self) -> int:
        return len(self.size)


def _memory_handle(handle: Any) -> bytes:
    """The memory handle torch's caching allocator writes (`shareIpcHandle`): a version byte, `c` (a cudaMalloc
    block) and the 64-byte cudaIpcMemHandle; or, from torch before 2.2, the 64 bytes alone."""
    if not isinstance(handle, bytes):
        raise RefusedPayload("a CUDA IPC memory handle must be bytes")
    if len(handle) == CUDA_IPC_HANDLE_SIZE:
        return handle
    if len(handle) >= 2 and handle[1:2] == b"e":
        raise RefusedPayload("a CUDA IPC handle of an expandable segment (expandable_segments:True): opening it takes "
                             "file descriptors out of the process the handle names; share from a cudaMalloc block "
                             "(PYTORCH_CUDA_ALLOC_CONF without expandable_segments) or use /update_weights_from_disk")
    if len(handle) != CUDA_IPC_HANDLE_SIZE + 2 or handle[0] not in (1, 2) or handle[1:2] != b"c":
        raise RefusedPayload(f"a CUDA IPC memory handle of {len(handle)} bytes is not the layout torch writes")
    return handle


def _rebuild_cuda_tensor(*args: Any) -> IpcTensor:
    """torch's `rebuild_cuda_tensor(tensor_cls, size, stride, offset, storage_cls, dtype, device, handle,
    storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle, ref_counter_offset, event_handle,
    event_sync_required)`, read as a record; nothing is opened here."""
    if len(args) != 15:
        raise RefusedPayload(f"rebuild_cuda_tensor takes 15 arguments, the payload gives {len(args)}")
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset_bytes,
     requires_grad, ref_counter, ref_counter_offset, event_handle, event_sync) = args
    if tensor_cls is not TENSOR_CLASS or storage_cls is not TYPED_STORAGE:
        raise RefusedPayload("a CUDA IPC tensor must be a torch.Tensor over a torch.storage.TypedStorage")
    if dtype not in DTYPES.values():
        raise RefusedPayload(f"a CUDA IPC tensor of dtype {str(dtype)[:40]} is not read")
    if not isinstance(size, tuple) or not isinstance(stride, tuple) or len(size) != len(stride) or len(size) > 8:
        raise RefusedPayload("a tensor's size and stride must be tuples of one length (at most 8)")
    size = tuple(_check_int(s, "a tensor's size") for s in size)
    stride = tuple(_check_int(s, "a tensor's stride") for s in stride)
    offset = _check_int(offset, "a tensor's storage offset")
    if type(device) is int:
        if not 0 <= device < 1024:
            raise RefusedPayload(f"CUDA device index {device} is out of range")
    elif not (isinstance(device, str) and _DEVICE_UUID.fullmatch(device)):
        raise RefusedPayload("a CUDA IPC tensor's device must be an index or a device UUID")
    storage_bytes = _check_int(storage_bytes, "a CUDA storage's size")
    storage_offset_bytes = _check_int(storage_offset_bytes, "a CUDA storage's offset")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if storage_bytes > MAX_IPC_BYTES or storage_offset_bytes > MAX_IPC_BYTES or storage_bytes % itemsize:
        raise RefusedPayload(f"a CUDA storage of {storage_bytes} bytes at {storage_offset_bytes} is refused (whole "
                             f"{dtype} elements, at most {MAX_IPC_BYTES} bytes)")
    elements = storage_bytes // itemsize
    if math.prod(size) and offset + sum((s - 1) * st for s, st in zip(size, stride)) >= elements:
        raise RefusedPayload(f"a tensor of size {size} and stride {stride} at offset {offset} lies beyond its "
                             f"storage of {elements} elements")
    if type(requires_grad) is not bool:
        raise RefusedPayload("requires_grad must be a boolean")
    if handle is None or storage_bytes == 0:  # torch's empty storage: no memory is shared
        if storage_bytes or math.prod(size) or handle is not None:
            raise RefusedPayload("a CUDA IPC tensor without a memory handle must be empty")
        return IpcTensor(size, stride, offset, dtype, device, None, 0, 0, None, 0, None, False)
    handle = _memory_handle(handle)
    if not isinstance(ref_counter, bytes) or _REF_COUNTER_NAME.fullmatch(ref_counter) is None:
        raise RefusedPayload("a CUDA IPC reference counter must be named as torch names them (/torch_<pid>_<n>_<n>)")
    ref_counter_offset = _check_int(ref_counter_offset, "a reference counter's offset")
    if ref_counter_offset >= REF_COUNTERS:
        raise RefusedPayload(f"reference counter {ref_counter_offset} lies beyond the {REF_COUNTERS} of its file")
    if not isinstance(event_handle, bytes) or len(event_handle) != CUDA_IPC_HANDLE_SIZE or type(event_sync) is not bool:
        raise RefusedPayload("a CUDA IPC event handle must be 64 bytes, with a boolean event_sync_required")
    return IpcTensor(size, stride, offset, dtype, device, handle, storage_bytes, storage_offset_bytes, ref_counter,
                     ref_counter_offset, event_handle, event_sync)


def _device_index(device: int | str) -> int:
    count = torch.cuda.device_count()
    if isinstance(device, int):
        if device >= count:
            raise RefusedPayload(f"CUDA device {device} is not one of the {count} this server sees")
        return device
    for index in range(count):
        if str(torch.cuda.get_device_properties(index).uuid) == device.removeprefix("GPU-"):
            return index
    raise RefusedPayload(f"CUDA device {device[:60]} is not one of the {count} this server sees")


def _allocation(pointer: int) -> tuple[int, int]:
    """The base and size of the device allocation holding `pointer` (the driver's `cuMemGetAddressRange`)."""
    import ctypes

    libcuda = ctypes.CDLL("libcuda.so.1")
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = libcuda.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(pointer))
    if status != 0:
        raise RefusedPayload(f"the CUDA IPC storage is not inside a device allocation (CUDA driver error {status})")
    return base.value, size.value


def open_ipc_tensor(record: IpcTensor, max_bytes: int) -> torch.Tensor:
    """The tensor `record` shares, copied into this process's own device memory (the sender's memory is mapped only
    while it is copied). Call it only for a loopback peer: the memory belongs to a process on this host."""
    nbytes = record.numel() * torch.empty((), dtype=record.dtype).element_size()
    if nbytes > max_bytes:
        raise RefusedPayload(f"a CUDA IPC tensor of {nbytes} bytes, above this endpoint's limit of {max_bytes}")
    if not torch.cuda.is_available():
        raise RefusedPayload("a CUDA IPC tensor, but this server has no CUDA device: send CPU tensors pickled by "
                             "value or use /update_weights_from_disk")
    device = _device_index(record.device)
    if record.handle is None:
        return torch.empty(record.size, dtype=record.dtype, device=f"cuda:{device}")
    counter = "/dev/shm/" + record.ref_counter.decode("ascii").lstrip("/")
    try:
        info = os.stat(counter)
    except OSError:
        raise RefusedPayload("the CUDA IPC reference counter file does not exist (the sender has gone)") from None
    if not (info.st_mode & 0o170000 == 0o100000 and info.st_size >= 8 * REF_COUNTERS):
        raise RefusedPayload("the CUDA IPC reference counter is not a file of torch's counters")
    from torch.multiprocessing import reductions  # torch's own, not a patched copy

    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    with torch.cuda.device(device):
        try:
            shared = rebuild(torch.Tensor, torch.Size(record.size), record.stride, record.offset,
                             torch.storage.TypedStorage, record.dtype, device, record.handle, record.storage_bytes,
                             record.storage_offset_bytes, False, record.ref_counter, record.ref_counter_offset,
                             record.event_handle, record.event_sync)
        except (RuntimeError, TypeError, ValueError) as err:
            raise RefusedPayload(f"the CUDA IPC handle could not be opened: {str(err).splitlines()[0][:200]}") from None
        try:
            start = shared.untyped_storage().data_ptr()
            base, size = _allocation(start)
            if start + record.storage_bytes > base + size:
                raise RefusedPayload(f"the CUDA IPC storage ({record.storage_bytes} bytes at offset "
                                     f"{record.storage_offset_bytes}) lies beyond its allocation of {size} bytes")
            owned = shared.clone()
            torch.cuda.current_stream(device).synchronize()  # the copy is done before the sender's memory is let go
        finally:
            del shared
    return owned


_RECORD = object()  # what a storage record's persistent id stands for while its bytes are read

ADMITTED: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch.storage", "_load_from_bytes"): _load_storage_bytes,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch", "Size"): torch.Size,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): Metadata,
    ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"): Metadata,
    **{("torch", name): dtype for name, dtype in DTYPES.items()},
    # CUDA IPC (miles-diffusion's updater): torch's reduction and sglang's patched copy of it, read as records
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor,
    ("torch", "Tensor"): TENSOR_CLASS,
    ("torch.storage", "TypedStorage"): TYPED_STORAGE,
}


class _Unpickler(pickle.Unpickler):
    """`mode`: "payload" (`find_class` answers only `ADMITTED`, with this module's checked functions), "data"
    (no global at all: a storage's header and keys), or "record" (a storage's record: only the storage classes,
    and the one persistent id)."""

    def __init__(self, stream: io.BytesIO, *, mode: str = "payload"):
        super().__init__(stream)
        self.mode, self.record = mode, None

    def find_class(self, module: str, name: str) -> Any:
        key = (str(module), str(name))
        if self.mode == "record" and key in STORAGE_DTYPES:
            return STORAGE_DTYPES[key]
        if self.mode == "payload" and key in ADMITTED:
            return ADMITTED[key]
        why = REFUSED_WHY.get(key)
        label = f"{key[0][:100]}.{key[1][:100]}"
        raise RefusedPayload(f"refused global {label}: {why}" if why else
                             f"refused global {label}: only tensors pickled by value or shared by CUDA IPC, torch "
                             "dtypes and sizes, and sglang's FlattenedTensorMetadata are read")

    def persistent_load(self, pid: Any) -> Any:
        if self.mode != "record" or self.record is not None:
            raise RefusedPayload("refused persistent id: only a storage's own bytes may carry one")
        if (not isinstance(pid, tuple) or len(pid) != 6 or pid[0] != "storage"
                or not isinstance(pid[1], torch.dtype) or not isinstance(pid[2], str)
                or not isinstance(pid[3], str) or re.fullmatch(r"cpu|cuda(:[0-9]{1,3})?", pid[3]) is None
                or pid[5] is not None):
            raise RefusedPayload("refused persistent id: not a whole storage's record")
        self.record = (pid[1], pid[2], _check_int(pid[4], "a storage's size"))
        return _RECORD


def loads(data: bytes) -> Any:
    """The object a payload pickles, read with the restricted unpickler; `RefusedPayload` otherwise."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except RequestError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            RuntimeError, MemoryError, RecursionError, OverflowError, struct.error) as err:
        raise RefusedPayload(f"not a readable pickle of tensors: {type(err).__name__}: {str(err)[:200]}") from None


def decode(text: str) -> Any:
    """One entry of `serialized_named_tensors`: base64 (as sglang's `output_str=True` writes it), then `loads`."""
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise RefusedPayload("not base64") from None
    return loads(data)


OpenIpc = Callable[[IpcTensor], torch.Tensor]


def _no_ipc(record: IpcTensor) -> torch.Tensor:
    raise RefusedPayload("a CUDA IPC tensor is opened only for a request from this host (a loopback peer)")


def _tensor(value: Any, open_ipc: OpenIpc) -> Any:
    return open_ipc(value) if isinstance(value, IpcTensor) else value


def _bucket_tensors(payload: Any, open_ipc: OpenIpc = _no_ipc) -> list[tuple[str, torch.Tensor]]:
    """sglang's `flattened_bucket`: `{"flattened_tensor": 1-D tensor, "metadata": [FlattenedTensorMetadata]}`,
    each tensor the bytes (or elements) `start_idx:end_idx` viewed as its dtype, in its shape."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise RefusedPayload("a flattened_bucket payload is a dict of flattened_tensor and metadata")
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, (torch.Tensor, IpcTensor)) or flat.dim() != 1 or not isinstance(metadata, list):
        raise RefusedPayload("flattened_tensor must be a 1-D tensor and metadata a list")
    flat = _tensor(flat, open_ipc)
    tensors = []
    for meta in metadata:
        fields = meta.__dict__ if isinstance(meta, Metadata) else meta
        if not isinstance(fields, dict) or not set(Metadata.FIELDS) <= set(fields):
            raise RefusedPayload(f"each metadata entry needs {list(Metadata.FIELDS)}")
        name, dtype = fields["name"], fields["dtype"]
        if isinstance(dtype, str):
            dtype = DTYPES.get(dtype.removeprefix("torch."))
        if not isinstance(name, str) or not isinstance(dtype, torch.dtype):
            raise RefusedPayload(f"metadata of {str(name)[:100]!r}: a name and a torch dtype are needed")
        start, end = _check_int(fields["start_idx"], "start_idx"), _check_int(fields["end_idx"], "end_idx")
        shape = fields["shape"]
        if not isinstance(shape, (tuple, list)) or not all(type(s) is int and s >= 0 for s in shape):
            raise RefusedPayload(f"{name[:100]}: shape must be a list of sizes")
        if not start <= end <= flat.numel():
            raise RefusedPayload(f"{name[:100]}: start_idx:end_idx {start}:{end} outside the bucket "
                                 f"of {flat.numel()} elements")
        piece = flat[start:end]
        try:
            tensors.append((name, piece.view(dtype).reshape(tuple(shape))))
        except RuntimeError as err:
            raise RefusedPayload(f"{name[:100]}: {str(err)[:200]}") from None
    return tensors


def ipc_records(payload: Any, depth: int = 0) -> int:
    """How many CUDA IPC tensors an unpickled payload holds (dicts, lists and tuples searched, 6 levels deep)."""
    if isinstance(payload, IpcTensor):
        return 1
    if depth > 6:
        return 0
    items = payload.values() if isinstance(payload, dict) else payload if isinstance(payload, (list, tuple)) else ()
    return sum(ipc_records(item, depth + 1) for item in items)


def named_tensors(payload: Any, load_format: str | None, modules: dict[str, str],
                  open_ipc: OpenIpc = _no_ipc) -> dict[str, torch.Tensor]:
    """The transformer tensors an unpickled payload carries, by the names of the transformer's state. `open_ipc`
    opens a CUDA IPC tensor (`open_ipc_tensor`); the default refuses them.

    `modules`: the target modules and the prefix of their names in the transformer's state. As sglang reads it:
    a dict keyed by module name, or (one module) the module's payload itself; each module's payload a
    `flattened_bucket` dict (`load_format="flattened_bucket"`) or a list of `(name, tensor)` pairs."""
    if isinstance(payload, dict) and set(modules) <= set(payload) and set(payload) <= set(modules):
        by_module = payload
    elif len(modules) == 1 and not (isinstance(payload, dict) and set(payload) - {"flattened_tensor", "metadata"}):
        by_module = {next(iter(modules)): payload}
    else:
        provided = list(payload)[:8] if isinstance(payload, dict) else type(payload).__name__
        raise RequestError("target_modules", f"the payload holds {provided}, the update targets {list(modules)}")
    tensors: dict[str, torch.Tensor] = {}
    for module, prefix in modules.items():
        part = by_module[module]
        if load_format == "flattened_bucket":
            pairs = _bucket_tensors(part, open_ipc)
        elif load_format is None and isinstance(part, (list, tuple)):
            pairs = [(pair[0], _tensor(pair[1], open_ipc)) if isinstance(pair, (tuple, list)) and len(pair) == 2
                     else pair for pair in part]
        else:
            raise RequestError("load_format", f"{str(load_format)[:40]!r} with a {type(part).__name__} payload: "
                                              "flattened_bucket, or null with a list of (name, tensor) pairs")
        for pair in pairs:
            if (not isinstance(pair, (tuple, list)) or len(pair) != 2 or not isinstance(pair[0], str)
                    or not isinstance(pair[1], torch.Tensor)):
                raise RefusedPayload("each named tensor must be a (name, tensor) pair")
            tensors[prefix + pair[0]] = pair[1]
    if not tensors:
        raise RefusedPayload("the payload holds no tensors")
    return tensors
