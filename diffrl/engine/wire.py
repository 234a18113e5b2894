"""The wire format of rollout responses: msgpack, tensors as safetensors bytes. Never pickle.

The body is a list with one map per output; each tensor is
`{"__tensor__": true, "data": <safetensors bytes>, "shape": [...], "dtype": "..."}` — the
convention sglang-diffusion uses, so its clients parse our responses and ours parse its.
"""

from __future__ import annotations

import dataclasses

import msgpack
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from diffrl.engine.protocol import DitTrajectory, RolloutOutput

MEDIA_TYPE = "application/msgpack"
_TENSOR_KEY = "data"


class WireFormatError(ValueError):
    """A payload that is not a well-formed rollout response."""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def encode_tensor(tensor: torch.Tensor) -> dict:
    tensor = tensor.detach().contiguous().cpu()
    return {"__tensor__": True, "data": save_safetensors({_TENSOR_KEY: tensor}),
            "shape": list(tensor.shape), "dtype": dtype_name(tensor.dtype)}


def decode_tensor(obj: dict) -> torch.Tensor:
    try:
        tensor = load_safetensors(obj["data"])[_TENSOR_KEY]
    except Exception as err:  # safetensors raises several types for malformed bytes
        raise WireFormatError(f"tensor payload is not valid safetensors: {err}") from None
    if list(tensor.shape) != list(obj.get("shape", [])) or dtype_name(tensor.dtype) != obj.get("dtype"):
        raise WireFormatError(f"tensor header {tuple(tensor.shape)}/{dtype_name(tensor.dtype)} does not match "
                              f"declared {obj.get('shape')}/{obj.get('dtype')}")
    return tensor


def encode_weights(tensors: dict[str, torch.Tensor]) -> bytes:
    """Named tensors (a weight update) as one safetensors body."""
    return save_safetensors({k: v.detach().cpu().contiguous() for k, v in tensors.items()})


def decode_weights(body: bytes) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(body)
    except Exception as err:  # safetensors raises several types for malformed bytes
        raise WireFormatError(f"body is not valid safetensors: {err}") from None


def _to_wire(value):
    if isinstance(value, torch.Tensor):
        return encode_tensor(value)
    if dataclasses.is_dataclass(value):
        return {f.name: _to_wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _to_wire(v) for k, v in value.items()}
    return value


def _from_wire_hook(obj: dict):
    return decode_tensor(obj) if obj.get("__tensor__") is True else obj


def encode_outputs(outputs: list[RolloutOutput]) -> bytes:
    return msgpack.packb([_to_wire(o) for o in outputs], use_bin_type=True)


def decode_outputs(payload: bytes) -> list[RolloutOutput]:
    try:
        records = msgpack.unpackb(payload, raw=False, object_hook=_from_wire_hook, strict_map_key=True)
    except WireFormatError:
        raise
    except Exception as err:
        raise WireFormatError(f"response is not valid msgpack: {err}") from None
    if not isinstance(records, list):
        raise WireFormatError("response body must be a list with one record per output")
    outputs = []
    for record in records:
        try:
            trajectory = record.get("dit_trajectory")
            outputs.append(RolloutOutput(**{**record, "dit_trajectory": DitTrajectory(**trajectory) if trajectory else None}))
        except (TypeError, AttributeError) as err:
            raise WireFormatError(f"malformed output record: {err}") from None
    return outputs
