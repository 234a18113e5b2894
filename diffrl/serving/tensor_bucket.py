"""Writing sglang's `POST /update_weights_from_tensor` payload as miles-diffusion sends it: the sender's side of
`tensor_pickle` (which reads it), for the tests and the GPU script (scripts/device/ipc_weight_sync.py); the server
never calls it.

miles' `DiffusionUpdateWeightFromTensor.update_bucket_weights` groups a state dict's tensors by dtype, flattens each
group into one uint8 tensor with sglang's `FlattenedTensorBucket` (metadata: `FlattenedTensorMetadata` dataclasses
of name, shape, dtype, start_idx, end_idx, numel), wraps it as `{"transformer": {"flattened_tensor", "metadata"}}`,
and posts its base64 pickle as `{"serialized_named_tensors": [...], "load_format": "flattened_bucket",
"target_modules": ["transformer"], "weight_version": "N"}`, one request per dtype (`flattened_buckets`,
`request_body`).

sglang is not installed here: a pickle names a class or function by its module, so `sglang_modules` puts stand-ins
for sglang's modules in `sys.modules` while a payload is pickled, with `FlattenedTensorMetadata` (this module's
dataclass, of sglang's fields) and any functions of `sglang.srt.utils.patch_torch` the caller gives (sglang's
`_rebuild_cuda_tensor_modified`, which a CUDA IPC tensor names after `monkey_patch_torch_reductions`).
"""

from __future__ import annotations

import base64
import contextlib
import sys
import types
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

METADATA_MODULE = "sglang.srt.weight_sync.tensor_bucket"
PATCH_MODULE = "sglang.srt.utils.patch_torch"
_PACKAGES = ("sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.utils")


@dataclass
class FlattenedTensorMetadata:
    """sglang's `FlattenedTensorMetadata` (pickled under `METADATA_MODULE` inside `sglang_modules`)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


FlattenedTensorMetadata.__module__ = METADATA_MODULE


@contextlib.contextmanager
def sglang_modules(**patch_functions: Callable) -> Iterator[types.ModuleType]:
    """Stand-ins for sglang's modules in `sys.modules` (those already there are put back on exit):
    `METADATA_MODULE` with `FlattenedTensorMetadata`, and `PATCH_MODULE` with each of `patch_functions` under its
    keyword (renamed to it, so pickle writes `sglang.srt.utils.patch_torch.<keyword>`). Yields the patch module."""
    names = (*_PACKAGES, METADATA_MODULE, PATCH_MODULE)
    saved = {name: sys.modules.get(name) for name in names}
    modules = {name: types.ModuleType(name) for name in names}
    modules[METADATA_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata
    for name, fn in patch_functions.items():
        fn.__module__, fn.__qualname__, fn.__name__ = PATCH_MODULE, name, name
        setattr(modules[PATCH_MODULE], name, fn)
    sys.modules.update(modules)
    try:
        yield modules[PATCH_MODULE]
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def flattened_buckets(named: Iterable[tuple[str, torch.Tensor]], module: str = "transformer") -> list[dict]:
    """One `{module: {"flattened_tensor", "metadata"}}` per dtype, in the order the dtypes first appear, as miles
    builds them (`FlattenedTensorBucket(named_tensors=...)`): each tensor's bytes, concatenated on its device."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for name, tensor in named:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets = []
    for group in by_dtype.values():
        flats, metadata, start = [], [], 0
        for name, tensor in group:
            flat = tensor.detach().flatten().view(torch.uint8)
            metadata.append(FlattenedTensorMetadata(name=name, shape=tensor.shape, dtype=tensor.dtype,
                                                    start_idx=start, end_idx=start + flat.numel(), numel=flat.numel()))
            flats.append(flat)
            start += flat.numel()
        buckets.append({module: {"flattened_tensor": torch.cat(flats), "metadata": metadata}})
    return buckets


def request_body(pickled: bytes | memoryview, weight_version: str | int | None = "1", *,
                 load_format: str | None = "flattened_bucket", target_modules: tuple[str, ...] = ("transformer",)
                 ) -> dict:
    """The JSON body of one request: `pickled` (a pickle of a bucket, `pickle.dumps` or sglang's
    `MultiprocessingSerializer`, i.e. torch's ForkingPickler) in base64, as `output_str=True` writes it."""
    return {"serialized_named_tensors": [base64.b64encode(pickled).decode()], "load_format": load_format,
            "target_modules": list(target_modules),
            "weight_version": None if weight_version is None else str(weight_version)}
