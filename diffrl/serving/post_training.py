"""sglang-diffusion's post-training endpoints on `diffrl serve`: weight sync and memory, as a miles-diffusion
trainer calls them on its engines (Rockdu/sglang 0372158dd, `entrypoints/post_training/weights_api.py`).

- `POST /update_weights_from_tensor`: `{"serialized_named_tensors": [base64 pickle], "load_format":
  "flattened_bucket" | null, "target_modules", "weight_version"}`, miles-diffusion's weight sync. Off unless
  `diffrl serve --update-weights-from-tensor` (404), then for a loopback peer or with the update token (the
  guard, `server._Guard`). The pickle is read by `tensor_pickle`'s restricted unpickler (CPU tensors by value,
  CUDA IPC records, dtypes, sizes, sglang's bucket metadata; anything else refused by name before it runs); CUDA
  IPC tensors are opened only for a loopback peer (403 otherwise) and copied at once; then the tensors are
  loaded as `/update_weights` loads a push: all or nothing, checked.
- `POST /update_weights_from_disk`: `{"model_path", "flush_cache", "target_modules"}` (+ `weight_version`):
  `<model_path>/<module>/*.safetensors` into the transformer (Wan2.2: its experts), all or nothing and checked
  as `/update_weights` checks a push, from directories under `--weights-roots` only.
- `POST /get_weights_checksum`: `{"module_names": [...] | null}` -> `{name: sha256 hex | "not_found"}`.
- `POST /update_weights_from_tensor_checker`: `{"target_module", "expected_named_tensors_sha256": [{name: sha}]}`.
- `POST /release_memory_occupation`, `POST /resume_memory_occupation`: the engine's sleep (level 2 by default:
  weights to host memory, as sglang moves its modules to the CPU) and wake, bit for bit.

Answers are sglang's: `{"success", "message", ...}` (200 on success); a refusal adds diffrl's `error` and
FastAPI's `detail` (`server.error_response`) and changes nothing. Those that change the engine sit behind the
same guard as `/update_weights` (`server.STATE_CHANGING`: token, Host, Origin, `application/json`).
"""

from __future__ import annotations

import asyncio
import functools
import re
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from diffrl.serving import tensor_pickle
from diffrl.serving.disk_weights import allowed_directory, read_module_weights
from diffrl.engine.engine import INT64_MAX, Engine, EngineAsleep, EngineConflict
from diffrl.serving.http_errors import ServerLimits, _validation_response, error_response, loopback_peer
from diffrl.errors import RequestError

class _Body(BaseModel):
    # Strict: a string where a list belongs, or 1 for true, is refused by name rather than read as something else.
    model_config = ConfigDict(extra="forbid", strict=True)


class WeightsFromDisk(_Body):
    model_path: str = Field(max_length=4096)
    flush_cache: bool = True
    """Accepted as sglang takes it; a new weight version always drops the engine's cached prompt encodings."""
    target_modules: list[str] | None = Field(None, max_length=64)
    """Pipeline components to update; null: every one the engine can (the transformer; Wan2.2's two experts)."""
    weight_version: int | str | None = None
    """diffrl's extension: the version the engine reports from now on (as `X-Weight-Version`); null: one more."""


class WeightsFromTensor(_Body):
    serialized_named_tensors: list[str] = Field(min_length=1, max_length=64)
    """One base64 pickle per tensor-parallel rank, as sglang takes it: this engine is one rank and reads the first."""
    load_format: str | None = Field(None, max_length=64)
    """"flattened_bucket" (miles: one flat tensor and sglang's FlattenedTensorMetadata list) or null ((name,
    tensor) pairs)."""
    target_modules: list[str] | None = Field(None, max_length=64)
    """Pipeline components the payload updates; null: the transformer (sglang's default)."""
    weight_version: int | str | None = None
    """The version the engine reports from now on (miles sends it with every bucket); null: one more."""


class ChecksumQuery(_Body):
    module_names: list[str] | None = Field(None, max_length=64)


class TensorChecksums(_Body):
    target_module: str = Field(max_length=200)
    expected_named_tensors_sha256: list[dict[str, str]] = Field(max_length=1)
    """One manifest per tensor-parallel rank, as sglang takes it: this engine is one rank."""


class MemoryRelease(_Body):
    tags: list[str] | None = Field(None, max_length=16)
    """Accepted as sglang's clients send them; every module is released (as sglang-diffusion does)."""
    level: Literal[1, 2] = 2
    """diffrl's extension: 1 frees caches only; 2 (sglang-diffusion's behaviour) also moves the weights to host memory."""


class MemoryResume(_Body):
    tags: list[str] | None = Field(None, max_length=16)
    """Accepted; everything released comes back."""


def _refusal(err: RequestError) -> Response:
    status = 503 if isinstance(err, EngineAsleep) else 409 if isinstance(err, EngineConflict) else 400
    return error_response(status, err.field, err.message, success_shape=True)


async def _parse(request: Request, model: type[_Body]) -> _Body | Response:
    """The JSON body as `model` (an empty body is `{}`), or the 422 naming the field."""
    body = await request.body()
    try:
        return model.model_validate_json(body if body.strip() else b"{}")
    except ValidationError as err:
        return _validation_response(list(err.errors()), success_shape=True)


def _version(value: int | str | None) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    if re.fullmatch(r"[0-9]{1,19}", text) is None or int(text) > INT64_MAX:
        raise RequestError("weight_version", f"must be an integer between 0 and {INT64_MAX}, got {str(value)[:40]!r}")
    return int(text)


def transformer_modules(engine: Engine) -> dict[str, str]:
    """The pipeline components the transformer holds, each with the prefix of its names in the transformer's state:
    `{"transformer": ""}`, or Wan2.2's `{"transformer": "transformer.", "transformer_2": "transformer_2."}`."""
    family = engine.family
    if not family.lora_components:
        return {"transformer": ""}
    return {name: f"{name}." for name in family.lora_components if getattr(family.transformer, name, None) is not None}


def add_routes(app: FastAPI, engine: Engine, limits: ServerLimits) -> None:
    @app.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(request: Request) -> Response:  # off unless enabled; loopback, token: `_Guard`
        req = await _parse(request, WeightsFromTensor)
        if isinstance(req, Response):
            return req
        try:
            version = _version(req.weight_version)
            available = transformer_modules(engine)
            names = ["transformer"] if req.target_modules is None else req.target_modules
            unknown = [n for n in names if n not in available]
            if unknown or not names:
                raise RequestError("target_modules", f"this engine updates {', '.join(available)} from tensors; got "
                                                     f"{', '.join(n[:100] for n in unknown) if unknown else 'none'}")
            if engine.asleep:  # before reading the payload: the update would be refused after
                raise EngineAsleep("weights", "the engine is asleep: wake it first (POST /resume_memory_occupation)")
            prefixes = {name: available[name] for name in dict.fromkeys(names)}
            payload = await asyncio.to_thread(tensor_pickle.decode, req.serialized_named_tensors[0])
            if tensor_pickle.ipc_records(payload) and not loopback_peer(request.scope.get("client")):
                return error_response(403, tensor_pickle.FIELD, "CUDA IPC tensors are opened only for a request from "
                                      "this host (a loopback peer); send CPU tensors pickled by value or use "
                                      "/update_weights_from_disk", success_shape=True)
            opener = functools.partial(tensor_pickle.open_ipc_tensor,
                                       max_bytes=limits.weights_limit(engine.family.transformer.state_dict()))
            tensors = await asyncio.to_thread(tensor_pickle.named_tensors, payload, req.load_format, prefixes, opener)
            new_version = await asyncio.to_thread(engine.update_weights, tensors, version)
        except RequestError as err:
            return _refusal(err)
        return JSONResponse({"success": True, "message": f"updated {', '.join(prefixes)} from tensors "
                                                         f"({len(tensors)} tensors)",
                             "weight_version": new_version})

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request) -> Response:  # guarded: `_Guard`
        req = await _parse(request, WeightsFromDisk)
        if isinstance(req, Response):
            return req
        try:
            version = _version(req.weight_version)
            available = transformer_modules(engine)
            names = list(available) if req.target_modules is None else req.target_modules
            unknown = [n for n in names if n not in available]
            if unknown or not names:
                raise RequestError("target_modules", f"this engine updates {', '.join(available)} from disk; got "
                                                     f"{', '.join(n[:100] for n in unknown) if unknown else 'none'}")
            if engine.asleep:  # before reading gigabytes: the update would be refused after
                raise EngineAsleep("weights", "the engine is asleep: wake it first (POST /resume_memory_occupation)")
            directory = allowed_directory(req.model_path, limits.weights_roots)
            prefixes = {name: available[name] for name in dict.fromkeys(names)}
            tensors = await asyncio.to_thread(read_module_weights, directory, prefixes, limits.weights_roots)
            new_version = await asyncio.to_thread(engine.update_weights, tensors, version)
        except RequestError as err:
            return _refusal(err)
        return JSONResponse({"success": True, "message": f"updated {', '.join(prefixes)} from {req.model_path[:200]} "
                                                         f"({len(tensors)} tensors)",
                             "weight_version": new_version})

    @app.post("/get_weights_checksum")
    async def get_weights_checksum(request: Request) -> Response:
        req = await _parse(request, ChecksumQuery)
        if isinstance(req, Response):
            return req
        return JSONResponse(await asyncio.to_thread(engine.weights_checksums, req.module_names))

    @app.post("/update_weights_from_tensor_checker")
    async def update_weights_from_tensor_checker(request: Request) -> Response:
        req = await _parse(request, TensorChecksums)
        if isinstance(req, Response):
            return req
        if not req.expected_named_tensors_sha256 or not req.expected_named_tensors_sha256[0]:
            return _refusal(RequestError("expected_named_tensors_sha256", "one manifest of tensor checksums is needed"))
        success, message = await asyncio.to_thread(engine.check_tensor_checksums, req.target_module,
                                                   req.expected_named_tensors_sha256[0])
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/release_memory_occupation")
    async def release_memory_occupation(request: Request) -> Response:  # guarded: `_Guard`
        req = await _parse(request, MemoryRelease)
        if isinstance(req, Response):
            return req
        before = engine.asleep
        try:
            moved = await asyncio.to_thread(engine.sleep, req.level)
        except RequestError as err:
            return _refusal(err)
        message = (f"already asleep at level {before}" if before >= req.level else
                   f"asleep at level {engine.asleep}: {moved} bytes of weights moved to host memory" if moved else
                   f"asleep at level {engine.asleep}: caches released")
        return JSONResponse({"success": True, "sleeping": True, "message": message, "level": engine.asleep,
                             "moved_bytes": moved})

    @app.post("/resume_memory_occupation")
    async def resume_memory_occupation(request: Request) -> Response:  # guarded: `_Guard`
        req = await _parse(request, MemoryResume)
        if isinstance(req, Response):
            return req
        was = engine.asleep
        moved = await asyncio.to_thread(engine.wake)
        message = "already awake" if not was else f"awake: {moved} bytes of weights back on the device"
        return JSONResponse({"success": True, "sleeping": False, "message": message, "level": 0,
                             "moved_bytes": moved})
