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

Refused, with the reason in the message (`REFUSED_WHY`): torch.multiprocessing's sharing reductions, what
`MultiprocessingSerializer` (torch's ForkingPickler) writes for a tensor by default. `rebuild_cuda_tensor`
opens a CUDA IPC handle and a reference-counting shared-memory file named by the payload, and writes a counter
at an offset the payload gives; `rebuild_storage_fd` connects to a socket address the payload gives
(`multiprocessing.resource_sharer.DupFd`) and only works with the sender's multiprocessing key;
`rebuild_storage_filename` maps a shared-memory file the payload names. None of them is data, and none can be
checked from here. Protocol 0/1 object pickles (`copyreg._reconstructor`), persistent ids outside a storage's
bytes, and every other global are refused too.
"""

from __future__ import annotations

import base64
import binascii
import collections
import io
import math
import pickle
import re
import struct
from typing import Any

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

_SHARED = ("a tensor shared by torch.multiprocessing (MultiprocessingSerializer's default): its storage is a CUDA "
           "IPC handle or shared memory of the sending process; send CPU tensors pickled by value (pickle.dumps)")
REFUSED_WHY = {
    ("torch.multiprocessing.reductions", "rebuild_tensor"): _SHARED,
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"): _SHARED,
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
        "a CUDA IPC handle (MultiprocessingSerializer's CUDA tensor): it opens device memory and a shared-memory "
        "counter the payload names; send CPU tensors pickled by value (pickle.dumps) instead",
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"):
        "a shared-memory file descriptor (MultiprocessingSerializer's CPU tensor): it connects to a socket the "
        "payload names; send CPU tensors pickled by value (pickle.dumps) instead",
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
                             f"refused global {label}: only tensors pickled by value, torch dtypes and sizes, "
                             "and sglang's FlattenedTensorMetadata are read")

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


def _bucket_tensors(payload: Any) -> list[tuple[str, torch.Tensor]]:
    """sglang's `flattened_bucket`: `{"flattened_tensor": 1-D tensor, "metadata": [FlattenedTensorMetadata]}`,
    each tensor the bytes (or elements) `start_idx:end_idx` viewed as its dtype, in its shape."""
    if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
        raise RefusedPayload("a flattened_bucket payload is a dict of flattened_tensor and metadata")
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or not isinstance(metadata, list):
        raise RefusedPayload("flattened_tensor must be a 1-D tensor and metadata a list")
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


def named_tensors(payload: Any, load_format: str | None, modules: dict[str, str]) -> dict[str, torch.Tensor]:
    """The transformer tensors an unpickled payload carries, by the names of the transformer's state.

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
            pairs = _bucket_tensors(part)
        elif load_format is None and isinstance(part, (list, tuple)):
            pairs = list(part)
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
