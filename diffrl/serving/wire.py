"""diffrl's compact wire format: msgpack, tensors as safetensors bytes. Never pickle.

A response body is a list with one map per output; each tensor is
`{"__tensor__": true, "data": <safetensors bytes>, "shape": [...], "dtype": "..."}` — the
convention sglang-diffusion uses, so its clients parse our responses and ours parse its.
`output_body` writes them as they are sent (`encode_outputs`: in one piece), and `OutputStreamDecoder` reads them
output by output as they arrive (`streaming.py`).

A request body (`encode_request`, `decode_request`) is one map of the JSON request's fields, with condition images
(`image_path` entries) as raw bytes instead of base64 `data:` URLs; plain msgpack types only (no ext types).
"""

from __future__ import annotations

import json
import math
import struct
import warnings
from typing import NoReturn

import msgpack
import torch
from safetensors.torch import load as load_safetensors

from diffrl.engine.protocol import DitTrajectory, RolloutOutput
from diffrl.serving.streaming import (
    SAFETENSORS_DTYPES,
    Body,
    SafetensorsFile,
    TensorFile,
    WireFormatError,
    msgpack_array_header,
    msgpack_parts,
)
from diffrl.serving.weight_sync import dtype_name

MEDIA_TYPE = "application/msgpack"
_TENSOR_KEY = "data"


def decode_tensor(obj: dict) -> torch.Tensor:
    try:
        tensor = load_safetensors(obj["data"])[_TENSOR_KEY]
    except Exception as err:  # safetensors raises several types for malformed bytes
        raise WireFormatError(f"tensor payload is not valid safetensors: {err}") from None
    if list(tensor.shape) != list(obj.get("shape", [])) or dtype_name(tensor.dtype) != obj.get("dtype"):
        raise WireFormatError(f"tensor header {tuple(tensor.shape)}/{dtype_name(tensor.dtype)} does not match "
                              f"declared {obj.get('shape')}/{obj.get('dtype')}")
    return tensor


def weights_body(tensors: dict[str, torch.Tensor]) -> Body:
    """Named tensors (a weight update) as one safetensors body, written as it is sent: a full model's
    weights are never gathered into one host buffer."""
    return Body([SafetensorsFile(tensors)])


def encode_weights(tensors: dict[str, torch.Tensor]) -> bytes:
    """`weights_body` in one piece."""
    return bytes(weights_body(tensors))


def decode_weights(body: bytes, *, views: bool = False) -> dict[str, torch.Tensor]:
    """Named tensors from a safetensors body. `views`: the tensors share the body's memory instead of copying
    it (a server reading a full model's weights holds them once, not twice); they are then to be read,
    not written, since `bytes` are immutable."""
    if views:
        return _safetensors_views(body)
    try:
        return load_safetensors(body)
    except Exception as err:  # safetensors raises several types for malformed bytes
        raise WireFormatError(f"body is not valid safetensors: {err}") from None


_DTYPES = {code: dtype for dtype, code in SAFETENSORS_DTYPES.items()}
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def _safetensors_views(body: bytes) -> dict[str, torch.Tensor]:
    """The safetensors layout checked as safetensors checks it (header within the body and its limit, known
    dtypes, sizes that match shapes, offsets that tile the data exactly), then each tensor made over its
    bytes. A tensor whose offset does not suit its element size, and a bool tensor (whose bytes may hold
    values other than 0 and 1), are copied instead."""
    def refuse(why: str) -> NoReturn:
        raise WireFormatError(f"body is not valid safetensors: {why}")

    if len(body) < 8:
        refuse("shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > _MAX_HEADER_BYTES or 8 + header_len > len(body):
        refuse(f"a header of {header_len} bytes does not fit the body ({len(body)} bytes) or the limit")
    try:
        header = json.loads(bytes(body[8:8 + header_len]))
    except ValueError:
        refuse("the header is not JSON")
    if not isinstance(header, dict):
        refuse("the header is not a JSON object")
    header.pop("__metadata__", None)
    start, data_len = 8 + header_len, len(body) - 8 - header_len
    entries = []
    for name, entry in header.items():
        if not (isinstance(entry, dict) and entry.keys() == {"dtype", "shape", "data_offsets"}):
            refuse(f"{name[:80]!r}: an entry needs exactly dtype, shape and data_offsets")
        dtype, shape, offsets = _DTYPES.get(entry["dtype"]), entry["shape"], entry["data_offsets"]
        if dtype is None:
            refuse(f"{name[:80]!r}: unknown dtype {str(entry['dtype'])[:20]!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            refuse(f"{name[:80]!r}: the shape is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= data_len):
            refuse(f"{name[:80]!r}: data_offsets outside the data")
        numel = math.prod(shape)
        if offsets[1] - offsets[0] != numel * dtype.itemsize:
            refuse(f"{name[:80]!r}: {offsets[1] - offsets[0]} bytes for {numel} elements of {entry['dtype']}")
        entries.append((offsets[0], offsets[1], name, dtype, shape, numel))
    entries.sort()
    end = 0
    for begin, stop, name, *_ in entries:
        if begin != end:
            refuse(f"{name[:80]!r}: its data overlaps another's or leaves a gap")
        end = stop
    if end != data_len:
        refuse(f"the tensors cover {end} of the {data_len} data bytes")
    tensors = {}
    with warnings.catch_warnings():  # frombuffer of immutable bytes: the tensors are only read
        warnings.simplefilter("ignore", UserWarning)
        for begin, _, name, dtype, shape, numel in entries:
            offset = start + begin
            if numel == 0:
                tensor = torch.empty(shape, dtype=dtype)
            elif dtype == torch.bool:
                tensor = torch.frombuffer(body, dtype=torch.uint8, count=numel, offset=offset).ne(0).view(shape)
            elif offset % dtype.itemsize:
                tensor = torch.frombuffer(bytearray(body[offset:offset + numel * dtype.itemsize]), dtype=dtype).view(shape)
            else:
                tensor = torch.frombuffer(body, dtype=dtype, count=numel, offset=offset).view(shape)
            tensors[name] = tensor
    return tensors


def _from_wire_hook(obj: dict):
    return decode_tensor(obj) if obj.get("__tensor__") is True else obj


def _tensor_map(tensor: torch.Tensor) -> dict:
    """A tensor's wire map: {"__tensor__": true, "data": a safetensors file holding it as "t", "shape", "dtype"},
    the data left to be written (`streaming.TensorFile`)."""
    return {"__tensor__": True, "data": TensorFile(tensor, _TENSOR_KEY), "shape": list(tensor.shape),
            "dtype": dtype_name(tensor.dtype)}


def output_body(outputs: list[RolloutOutput]) -> Body:
    """The compact response, a msgpack list with one map per output (its dataclass fields, tensors as
    `_tensor_map`s), as a `streaming.Body`: each tensor is written from its own memory as the body is sent."""
    parts = [msgpack_array_header(len(outputs))]
    for output in outputs:
        parts += msgpack_parts(output, _tensor_map)
    return Body(parts)


def encode_outputs(outputs: list[RolloutOutput]) -> bytes:
    """The compact response in one piece (`output_body`'s bytes)."""
    return bytes(output_body(outputs))


def encode_request(fields: dict) -> bytes:
    """A rollout request's fields (`RolloutRequest.model_dump`: condition images as bytes) as a compact body."""
    return msgpack.packb(fields, use_bin_type=True)


def decode_request(body: bytes) -> dict:
    """The fields of a compact request body, to be validated as a `RolloutRequest`; a WireFormatError when the body
    is not one msgpack map of plain values (strings, bytes, numbers, booleans, nil, lists, maps with string keys)."""
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext_types)
    except WireFormatError:
        raise
    except Exception as err:  # msgpack raises several types for malformed bytes
        raise WireFormatError(f"not valid msgpack ({str(err)[:120] or type(err).__name__})") from None
    if not isinstance(fields, dict):
        raise WireFormatError(f"a request body must be one map of fields, got a msgpack {type(fields).__name__}")
    return fields


def _no_ext_types(code: int, data: bytes) -> NoReturn:
    raise WireFormatError(f"msgpack extension type {code} is not part of a request")


def decode_outputs(payload: bytes) -> list[RolloutOutput]:
    try:
        records = msgpack.unpackb(payload, raw=False, object_hook=_from_wire_hook, strict_map_key=True)
    except WireFormatError:
        raise
    except Exception as err:
        raise WireFormatError(f"response is not valid msgpack: {err}") from None
    if not isinstance(records, list):
        raise WireFormatError("response body must be a list with one record per output")
    return [_output(record) for record in records]


def _output(record) -> RolloutOutput:
    try:
        trajectory = record.get("dit_trajectory")
        return RolloutOutput(**{**record, "dit_trajectory": DitTrajectory(**trajectory) if trajectory else None})
    except (TypeError, AttributeError) as err:
        raise WireFormatError(f"malformed output record: {err}") from None


class OutputStreamDecoder:
    """Reads a compact response as its bytes arrive: `feed(data)` returns the outputs completed by `data`
    (each decoded as soon as its last byte is in); `finish()` checks that every announced output came."""

    def __init__(self):
        # No buffer cap below msgpack's own (4 GiB): one video output is hundreds of MB.
        self._unpacker = msgpack.Unpacker(raw=False, object_hook=_from_wire_hook, strict_map_key=True,
                                          max_buffer_size=0)
        self.expected: int | None = None
        self.count = 0
        self._received = 0

    def feed(self, data: bytes | memoryview) -> list[RolloutOutput]:
        outputs = []
        self._received += len(data)
        try:
            self._unpacker.feed(data)
            if self.expected is None:
                self.expected = self._unpacker.read_array_header()
            while self.count < self.expected:
                outputs.append(_output(self._unpacker.unpack()))
                self.count += 1
        except msgpack.OutOfData:
            pass
        except WireFormatError:
            raise
        except Exception as err:
            if self.expected is None:
                raise WireFormatError("response body must be a list with one record per output") from None
            raise WireFormatError(f"response is not valid msgpack: {err}") from None
        if self.count == self.expected and self._unpacker.tell() < self._received:
            raise WireFormatError("bytes after the last output record")
        return outputs

    def finish(self) -> None:
        if self.expected is None or self.count < self.expected:
            raise WireFormatError(f"the response ended after {self.count} of "
                                  f"{'?' if self.expected is None else self.expected} output records")
