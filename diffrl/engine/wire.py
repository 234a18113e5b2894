"""The wire format of rollout responses: msgpack, tensors as safetensors bytes. Never pickle.

The body is a list with one map per output; each tensor is
`{"__tensor__": true, "data": <safetensors bytes>, "shape": [...], "dtype": "..."}` — the
convention sglang-diffusion uses, so its clients parse our responses and ours parse its.
`output_body` writes them as they are sent (`encode_outputs`: in one piece), and `OutputStreamDecoder` reads them
output by output as they arrive (`streaming.py`).
"""

from __future__ import annotations

import msgpack
import torch
from safetensors.torch import load as load_safetensors

from diffrl.engine.protocol import DitTrajectory, RolloutOutput
from diffrl.engine.streaming import Body, SafetensorsFile, TensorFile, msgpack_array_header, msgpack_parts

MEDIA_TYPE = "application/msgpack"
_TENSOR_KEY = "data"


class WireFormatError(ValueError):
    """A payload that is not a well-formed rollout response."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


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


def decode_weights(body: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(body)
    except Exception as err:  # safetensors raises several types for malformed bytes
        raise WireFormatError(f"body is not valid safetensors: {err}") from None


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
