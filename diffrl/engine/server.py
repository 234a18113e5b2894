"""`diffrl serve`: the engine behind HTTP (FastAPI + uvicorn), loopback by default.

- `POST /rollout/generate`: a `RolloutRequest` as JSON (every field of sglang-diffusion's request model).
  The answer is sglang-diffusion's post-training format by default (a JSON list, base64 safetensors
  tensors, full trajectories, conditioning on every record: `sglang.py`), so its clients work unchanged;
  `Accept: application/msgpack` negotiates diffrl's compact format instead (`wire.py`: msgpack, raw
  safetensors bytes, only the returned steps, conditioning once), which diffrl's own client asks for.
- `GET /health_generate`: sglang-diffusion's liveness probe (200 while the server is up).
- `POST /v1/images/generations`: OpenAI-style plain generation (PNG as base64), for eval and serving.
- `GET /health`: status, family, weight version and the in-flight count used for routing.
- `POST /update_weights`: named transformer tensors as a safetensors body (a trainer's update;
  `X-Weight-Version` header). Needs `Authorization: Bearer <token>` when the server has a token;
  a server bound beyond loopback refuses updates unless it has one.

A bad request gets 400 (engine checks) or 422 (schema) naming the field, and changes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import io
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from PIL import Image
from pydantic import BaseModel, ConfigDict, Field

from diffrl.engine import sglang
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.engine.wire import MEDIA_TYPE, WireFormatError, decode_weights, encode_outputs
from diffrl.errors import RequestError
from diffrl.models.lora import LoraSpec
from diffrl.utils.images import to_uint8


class ImageGenerationRequest(BaseModel):
    """The subset of OpenAI's images API that makes sense here, plus seed and sampler knobs."""

    model_config = ConfigDict(extra="forbid")

    prompt: str
    n: int = 1
    size: str | None = None
    """"WIDTHxHEIGHT"; default: the family's size."""
    response_format: Literal["b64_json"] = "b64_json"
    seed: int = Field(0, ge=0, lt=2**63)
    negative_prompt: str = ""
    num_inference_steps: int = Field(10, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    model: str | None = None  # accepted for client compatibility; the server has one model


def _parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    try:
        width, height = (int(v) for v in size.lower().split("x"))
    except ValueError:
        raise RequestError("size", f"expected 'WIDTHxHEIGHT', got {size!r}") from None
    return width, height


def create_app(engine: Engine, *, update_token: str | None = None, exposed: bool = False) -> FastAPI:
    """`exposed`: bound to a non-loopback address (weight updates then require `update_token`)."""
    app = FastAPI(title="diffrl engine")

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> JSONResponse:
        return JSONResponse(status_code=400, content={"error": {"field": err.field, "message": err.message}})

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "family": engine.family.name, "in_flight": engine.in_flight,
                "weight_version": engine.weight_version,
                "max_outputs_per_request": engine.config.max_outputs_per_request}

    @app.get("/health_generate")
    async def health_generate() -> dict:
        return {"status": "ok"}

    @app.post("/rollout/generate")
    async def rollout_generate(req: RolloutRequest, request: Request) -> Response:
        if wants_compact(request.headers.get("accept")):
            outputs = await engine.agenerate(req)
            body = await asyncio.to_thread(encode_outputs, outputs)  # serialization off the event loop
            return Response(content=body, media_type=MEDIA_TYPE)
        engine.plan(req)  # refuse bad input by the client's own field values before rewriting the request
        outputs = await engine.agenerate(sglang.engine_request(req))
        body = await asyncio.to_thread(sglang.encode_response, outputs, req, engine.family, uuid.uuid4().hex)
        return Response(content=body, media_type=sglang.JSON_MEDIA_TYPE)

    def refused(request: Request) -> JSONResponse | None:
        """Weight-changing endpoints: a token when one is set; none at all when exposed without one."""
        if update_token is None and exposed:
            return JSONResponse(status_code=403, content={"error": {"field": "authorization", "message":
                                "weight updates are disabled on an exposed server without --update-token"}})
        if update_token is not None and not hmac.compare_digest(
                request.headers.get("authorization", ""), f"Bearer {update_token}"):
            return JSONResponse(status_code=401, content={"error": {"field": "authorization",
                                                                    "message": "missing or wrong bearer token"}})
        return None

    @app.post("/lora_adapter")
    async def lora_adapter(spec: LoraSpec, request: Request) -> JSONResponse:
        if (refusal := refused(request)) is not None:
            return refusal
        added = await asyncio.to_thread(engine.add_lora_adapter, spec)
        return JSONResponse({"added": added, "lora": spec.model_dump()})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        if (refusal := refused(request)) is not None:
            return refusal
        body = await request.body()
        try:
            tensors = decode_weights(body)  # safetensors: plain tensors, never pickle
        except WireFormatError as err:
            raise RequestError("weights", str(err)) from None
        header = request.headers.get("x-weight-version")
        try:
            version = int(header) if header is not None else None
        except ValueError:
            raise RequestError("x-weight-version", f"not an integer: {header!r}") from None
        new_version = await asyncio.to_thread(engine.update_weights, tensors, version)
        return JSONResponse({"weight_version": new_version, "tensors": len(tensors)})

    @app.post("/v1/images/generations")
    async def images_generations(req: ImageGenerationRequest) -> dict:
        width, height = _parse_size(req.size)
        rollout_req = RolloutRequest(
            prompt=req.prompt, negative_prompt=req.negative_prompt, seed=req.seed, num_outputs_per_prompt=req.n,
            width=width, height=height, num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
        )
        outputs = await engine.agenerate(rollout_req)
        images = to_uint8(torch.stack([o.generated_output for o in outputs]))
        return {"created": int(time.time()), "data": [{"b64_json": _png_b64(img)} for img in images]}

    return app


def wants_compact(accept: str | None) -> bool:
    """Whether an `Accept` header prefers diffrl's msgpack format over JSON (the default: no header, `*/*`,
    or JSON ranked at least as high). An explicit msgpack entry beats a wildcard of the same weight."""
    if not accept:
        return False
    weights: dict[str, float] = {}
    for item in accept.split(","):
        kind, *params = (part.strip() for part in item.split(";"))
        q = 1.0
        for param in params:
            name, _, value = param.partition("=")
            if name.strip() == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0
        weights[kind.lower()] = max(q, weights.get(kind.lower(), 0.0))
    compact = max(weights.get(MEDIA_TYPE, 0.0), weights.get("application/x-msgpack", 0.0))
    json_q = weights.get("application/json", weights.get("application/*", weights.get("*/*", 0.0)))
    return compact > 0 and compact >= json_q


def _png_b64(array) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


@dataclass
class ServeConfig:
    model_path: Path | None = None
    """Local diffusers-format model directory (default: the shipped demo model)."""
    diffusion_model_family: str | None = None
    host: str = "127.0.0.1"
    """Loopback by default; binding elsewhere exposes the engine to the network."""
    port: int = 30000
    device: str = "auto"
    max_outputs_per_request: int = 64
    max_batch_outputs: int = 64
    """Outputs of waiting requests denoised together in one batch (requests with equal settings)."""
    update_token: str | None = None
    """Bearer token for POST /update_weights (default: env DIFFRL_ENGINE_TOKEN). Without one, only a
    loopback server accepts weight updates."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks (as `diffrl train --compile`, with eager's bf16
    roundings kept); a LoRA adapter hosted later recompiles them once."""


def build_engine(cfg: ServeConfig) -> Engine:
    from diffrl.models import resolve_family
    from diffrl.models.compile import compile_blocks
    from diffrl.models.demo import SHIPPED_DEMO_MODEL
    from diffrl.utils.device import resolve_device

    model_path = cfg.model_path or SHIPPED_DEMO_MODEL
    family = resolve_family(cfg.diffusion_model_family, model_path).load(model_path, device=resolve_device(cfg.device))
    if cfg.compile:
        compile_blocks(family.transformer, family.block_lists)
    return Engine(family, EngineConfig(max_outputs_per_request=cfg.max_outputs_per_request,
                                       max_batch_outputs=cfg.max_batch_outputs))


def serve(cfg: ServeConfig) -> None:
    import uvicorn

    engine = build_engine(cfg)
    token = cfg.update_token or os.environ.get("DIFFRL_ENGINE_TOKEN")
    exposed = cfg.host not in ("127.0.0.1", "localhost", "::1")
    uvicorn.run(create_app(engine, update_token=token, exposed=exposed), host=cfg.host, port=cfg.port, log_level="info")
