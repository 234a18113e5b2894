"""`diffrl serve`: the engine behind HTTP (FastAPI + uvicorn), loopback by default.

- `POST /rollout/generate`: a `RolloutRequest` as JSON (every field of sglang-diffusion's request model).
  The answer is sglang-diffusion's post-training format by default (a JSON list, base64 safetensors
  tensors, full trajectories, conditioning on every record: `sglang.py`), so its clients work unchanged;
  `Accept: application/msgpack` negotiates diffrl's compact format instead (`wire.py`: msgpack, raw
  safetensors bytes, only the returned steps, conditioning once), which diffrl's own client asks for.
  Either body is written while it is sent (`streaming.py`), record by record, each tensor from its own
  memory, with its `Content-Length` known up front: the bytes are those of the body built in one piece,
  but the server never holds that piece (a video response is gigabytes), the client can decode output 0
  while the rest is on the wire, and a client that goes away mid-body stops the writing.
- `GET /health_generate`: sglang-diffusion's liveness probe (200 while the server is up); `GET /model_info` and
  `GET /server_info`: sglang-diffusion's worker description (task type, model path, parallelism, version).
- `POST /v1/images/generations`: OpenAI-style plain generation (PNG as base64), for eval and serving.
- `GET /health`: status, family, weight version and the in-flight count used for routing.
- `POST /update_weights`: named transformer tensors as a safetensors body (a trainer's update;
  `X-Weight-Version` header, 0 ≤ v < 2**63), all or nothing, checked in the model's dtypes.
- `POST /lora_adapter`: host the trainer's LoRA adapter (checked against the transformer first).
- sglang-diffusion's post-training endpoints (`post_training.py`), as miles-diffusion's trainer calls them:
  `/update_weights_from_disk` (from `--weights-roots` only), `/get_weights_checksum`,
  `/update_weights_from_tensor_checker`, `/release_memory_occupation` and `/resume_memory_occupation` (the
  engine's sleep and wake), and `/update_weights_from_tensor` (sglang's pickled tensors: off unless
  `--update-weights-from-tensor`, then for a loopback peer or with the update token, CUDA IPC tensors for a
  loopback peer only, and read by a restricted unpickler, `tensor_pickle.py`).
  Those that change the model or the engine's state (`STATE_CHANGING`) need `Authorization: Bearer <token>`
  when the server has a token (a server bound beyond loopback refuses them unless it has one), a loopback Host
  (DNS rebinding), no foreign `Origin` (web pages) and their own content type (`application/octet-stream` for
  `/update_weights`, `application/json` for the others).

A bad request gets a 4xx naming the field or header (`{"error": {"field", "message"}}`; schema errors
also carry FastAPI's `detail` list, without the input echo) and changes nothing. Bodies, prompts,
outputs × steps and time per request are bounded (`ServeConfig`, `config.py`; docs/wire-format.md "Limits"); a
request whose client goes away is abandoned. /docs and /openapi.json are off unless `--docs`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import ctypes
import dataclasses
import hmac
import io
import os
import re
import threading
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from PIL import Image
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from diffrl import __version__
from diffrl.serving import post_training, sglang
from diffrl.serving.config import ServeConfig
from diffrl.engine.engine import (
    INT64_MAX,
    Engine,
    EngineAsleep,
    EngineBusy,
    EngineConflict,
    RequestCancelled,
)
from diffrl.serving.http_errors import ServerLimits, _validation_response, error_response, loopback_peer
from diffrl.engine.protocol import RolloutRequest, json_number, utf8_text
from diffrl.engine.spec import EngineSpec
from diffrl.engine.spec import build_engine as build_spec_engine
from diffrl.serving.streaming import Body, stream
from diffrl.serving.wire import (
    MEDIA_TYPE,
    WireFormatError,
    decode_request,
    decode_weights,
    encode_outputs,
    output_body,
)
from diffrl.errors import RequestError
from diffrl.models.lora import LoraSpec
from diffrl.models.speed import SpeedOptions
from diffrl.utils.device import resolve_device
from diffrl.utils.images import to_uint8
from diffrl.utils.run_folders import find_run


class ImageGenerationRequest(BaseModel):
    """The subset of OpenAI's images API that makes sense here, plus seed and sampler knobs."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str
    n: int = Field(1, ge=1)
    size: str | None = Field(None, max_length=32)
    """"WIDTHxHEIGHT" in ASCII digits; default: the family's size."""
    response_format: Literal["b64_json"] = "b64_json"
    seed: int = Field(0, ge=0, lt=2**63)
    negative_prompt: str = ""
    num_inference_steps: int = Field(10, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    model: str | None = None  # accepted for client compatibility; the server has one model

    _text = field_validator("prompt", "negative_prompt")(utf8_text)

    @field_validator("*", mode="before")
    @classmethod
    def _numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return json_number(value, info, cls)


def _parse_size(size: str | None) -> tuple[int | None, int | None]:
    if size is None:
        return None, None
    # ASCII digits only: int() would also read other scripts' digits ("１２８").
    match = re.fullmatch(r"([0-9]{1,6})[xX]([0-9]{1,6})", size)
    if match is None:
        raise RequestError("size", f"expected 'WIDTHxHEIGHT' in ASCII digits, got {size!r}")
    return int(match[1]), int(match[2])


LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
# Endpoints that change the model, with the only body type each takes (a web page can send text/plain
# cross-origin without a preflight; it cannot send these).
TENSOR_PICKLE_PATH = "/update_weights_from_tensor"
STATE_CHANGING = {"/update_weights": "application/octet-stream", "/lora_adapter": "application/json",
                  # sglang-diffusion's post-training endpoints (`post_training.py`)
                  "/update_weights_from_tensor": "application/json", "/update_weights_from_disk": "application/json",
                  "/release_memory_occupation": "application/json", "/resume_memory_occupation": "application/json"}


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ("[::1]:30000" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    name, sep, port = host.rpartition(":")
    return name if sep and port.isdigit() else host


class _Guard:
    """ASGI middleware in front of every route. On state-changing endpoints: the token (before the body is
    read), Host (DNS rebinding), Origin (web pages) and content type. On every request: the body size,
    read here once with the limit (413 as soon as it is passed) and handed on."""

    def __init__(self, app, *, engine: Engine, limits: ServerLimits, update_token: str | None, exposed: bool):
        self.app, self.engine, self.limits = app, engine, limits
        self.token = None if update_token is None else f"Bearer {update_token}".encode()
        self.exposed = exposed

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", ())}
        path = scope.get("path", "")
        refusal = self._refusal(path, headers, scope.get("client")) if path in STATE_CHANGING else None
        if refusal is None:
            limit = (self._weights_limit() if path == "/update_weights" else
                     self._weights_limit() * 4 // 3 + self.limits.max_body_bytes if path == TENSOR_PICKLE_PATH else
                     self.limits.max_body_bytes)  # base64 of a pickle of the weights, in a JSON body
            declared = headers.get("content-length")
            if declared is not None and not declared.isdigit():
                refusal = error_response(400, "content-length", "not a byte count")
            elif declared is not None and int(declared) > limit:
                refusal = error_response(413, "body", f"{int(declared)} bytes, above this endpoint's limit of {limit}")
        if refusal is not None:
            return await refusal(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return await error_response(413, "body", f"more than this endpoint's limit of {limit} bytes")(
                    scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False
        del chunks  # a weight push is held once from here on, not twice

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect the endpoints watch for

        await self.app(scope, replay, send)

    def _weights_limit(self) -> int:
        return self.limits.weights_limit(self.engine.family.transformer.state_dict())

    def _refusal(self, path: str, headers: dict[str, bytes], client: tuple | None) -> Response | None:
        if path == TENSOR_PICKLE_PATH:  # pickles: off unless asked for, then a loopback peer or the token
            if not self.limits.tensor_updates:
                return error_response(404, "path", f"{path} is off: start diffrl serve with "
                                                    "--update-weights-from-tensor")
            if self.token is None and not loopback_peer(client):
                return error_response(403, "authorization", f"{path} is answered only for a loopback peer, or "
                                                            "with the server's --update-token")
        if self.token is None and self.exposed:
            return error_response(403, "authorization", "weight updates are disabled on an exposed server "
                                                        "without --update-token")
        if self.token is not None and not hmac.compare_digest(headers.get("authorization", b""), self.token):
            return error_response(401, "authorization", "missing or wrong bearer token")
        host = _host_name(headers.get("host", b"").decode("latin-1"))
        allowed = tuple(h.lower() for h in self.limits.allowed_hosts)
        if (not self.exposed or allowed) and host not in (allowed if self.exposed else LOOPBACK_HOSTS + allowed):
            return error_response(403, "host", f"{host[:100]!r} is not a host name this server answers "
                                               "state-changing requests for (--allowed-hosts)")
        origin = headers.get("origin")
        if origin is not None and origin.decode("latin-1") not in self.limits.allowed_origins:
            return error_response(403, "origin", "state-changing requests from web pages are refused (--allowed-origins)")
        kind = headers.get("content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        if kind != STATE_CHANGING[path]:
            return error_response(415, "content-type", f"{path} takes {STATE_CHANGING[path]}, got {kind[:100]!r}")
        return None


def create_app(engine: Engine, *, update_token: str | None = None, exposed: bool = False,
               limits: ServerLimits | None = None, docs: bool = False, trim_heap: bool = False,
               stream_responses: bool = True, model_path: str | None = None) -> FastAPI:
    """`exposed`: bound to a non-loopback address (weight updates then require `update_token`).
    `docs`: serve /docs and /openapi.json (off by default: they describe every endpoint to anyone).
    `trim_heap`: when the engine falls idle, hand freed heap pages back to the OS (`malloc_trim`).
    `stream_responses`: write rollout responses as they are sent (False: build each body first, then send
    it; the same bytes). `model_path`: what /model_info and /server_info report as the served model."""
    limits = limits or ServerLimits()
    trimming = {"pending": False}

    async def trim_when_idle() -> None:
        # A burst frees its memory into malloc's free lists, which keep the pages (RSS) otherwise.
        if not trim_heap or engine.in_flight or trimming["pending"]:
            return
        trimming["pending"] = True
        try:
            await asyncio.to_thread(trim_malloc_heap)
        finally:
            trimming["pending"] = False
    app = FastAPI(title="diffrl engine", docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    app.add_middleware(_Guard, engine=engine, limits=limits, update_token=update_token, exposed=exposed)

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, err: RequestError) -> Response:
        return error_response(400, err.field, err.message)

    @app.exception_handler(RequestValidationError)
    async def _schema_error(_: Request, err: RequestValidationError) -> Response:
        return _validation_response(list(err.errors()))

    @app.exception_handler(ValidationError)  # a request built inside an endpoint (/v1/images/generations)
    async def _inner_schema_error(_: Request, err: ValidationError) -> Response:
        return _validation_response(list(err.errors()))

    @app.exception_handler(StarletteHTTPException)  # 404, 405, a body FastAPI cannot parse (not UTF-8): same shape
    async def _http_error(_: Request, err: StarletteHTTPException) -> Response:
        field = {404: "path", 405: "method"}.get(err.status_code, "body")
        response = error_response(err.status_code, field, str(err.detail))
        response.headers.update(err.headers or {})
        return response

    @app.exception_handler(EngineAsleep)
    async def _asleep(_: Request, err: EngineAsleep) -> Response:
        return error_response(503, err.field, err.message)

    @app.exception_handler(EngineConflict)
    async def _conflict(_: Request, err: EngineConflict) -> Response:
        return error_response(409, err.field, err.message)

    @app.exception_handler(EngineBusy)
    async def _busy(_: Request, err: EngineBusy) -> Response:
        return error_response(429, "request", f"the engine is busy: {err}")

    @app.exception_handler(RequestCancelled)
    async def _cancelled(_: Request, err: RequestCancelled) -> Response:
        return error_response(503, "request", err.reason)

    async def generate(request: Request, req: RolloutRequest) -> list | None:
        """The engine's outputs, or None when the client went away first (the request is then abandoned:
        it leaves the queue, or its outputs leave their batch before the next step)."""
        cancel = threading.Event()
        work = asyncio.ensure_future(engine.agenerate(req, cancel))
        gone = asyncio.ensure_future(_disconnected(request))
        timeout = engine.config.request_timeout_s
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                return work.result()
            cancel.set()
            work.cancel()
            if gone in done:
                return None
            raise RequestCancelled(f"the request ran past the server's time limit of {timeout} s (request_timeout_s)")
        finally:
            gone.cancel()
            asyncio.ensure_future(trim_when_idle())

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "family": engine.family.name, "in_flight": engine.in_flight,
                "weight_version": engine.weight_version, "asleep": engine.asleep,
                "max_outputs_per_request": engine.config.max_outputs_per_request}

    @app.get("/health_generate")
    async def health_generate() -> dict:
        return {"status": "ok"}

    @app.get("/model_info")
    async def model_info() -> dict:
        # The keys sglang-diffusion answers with (what sglang's model gateway reads to discover a worker).
        video = engine.family.generates_video
        return {"model_path": model_path, "is_generation": True, "model_type": "diffusion", "architectures": None,
                "has_image_understanding": engine.family.accepts_image_conditioning, "has_audio_understanding": False,
                "task_type": engine.family.task_type, "is_image_gen": not video}

    @app.get("/server_info")
    async def server_info() -> dict:
        return {"model_path": model_path, "served_model_name": model_path or engine.family.name, "tp_size": 1,
                "dp_size": 1, "version": __version__}

    @app.post("/rollout/generate")
    async def rollout_generate(req: Annotated[RolloutRequest, BeforeValidator(_compact_request)],
                               request: Request) -> Response:
        if "num_inference_steps" not in req.model_fields_set:  # null or left out: the model's default, as sglang's
            req = req.model_copy(update={"num_inference_steps": engine.family.default_num_inference_steps})
        if wants_compact(request.headers.get("accept")):
            if (outputs := await generate(request, req)) is None:
                return Response(status_code=499)
            if stream_responses:
                return streamed(output_body(outputs), MEDIA_TYPE)
            body = await asyncio.to_thread(encode_outputs, outputs)  # serialization off the event loop
            return Response(content=body, media_type=MEDIA_TYPE)
        engine.plan(req)  # refuse bad input by the client's own field values before rewriting the request
        if (outputs := await generate(request, sglang.engine_request(req))) is None:
            return Response(status_code=499)
        if stream_responses:  # the shared conditioning is base64-encoded here, once: off the event loop
            body = await asyncio.to_thread(sglang.response_body, outputs, req, engine.family, uuid.uuid4().hex)
            return streamed(body, sglang.JSON_MEDIA_TYPE)
        body = await asyncio.to_thread(sglang.encode_response, outputs, req, engine.family, uuid.uuid4().hex)
        return Response(content=body, media_type=sglang.JSON_MEDIA_TYPE)

    def streamed(body: Body, media_type: str) -> StreamingResponse:
        # Content-Length is known before a byte is written: clients see the framing a built body has.
        # Once it is sent (or its client left), the heap goes back as after any request.
        return StreamingResponse(stream(body), media_type=media_type, headers={"content-length": str(body.length)},
                                 background=BackgroundTask(trim_when_idle))

    @app.post("/lora_adapter")
    async def lora_adapter(spec: LoraSpec) -> Response:  # token, host, origin, content type: `_Guard`
        added = await asyncio.to_thread(engine.add_lora_adapter, spec)
        return JSONResponse({"added": added, "lora": spec.model_dump()})

    @app.post("/update_weights")
    async def update_weights(request: Request) -> Response:  # token, host, origin, content type: `_Guard`
        header = request.headers.get("x-weight-version")
        version = None
        if header is not None:
            if re.fullmatch(r"[0-9]{1,19}", header.strip()) is None or int(header) > INT64_MAX:
                raise RequestError("x-weight-version", f"must be an integer between 0 and {INT64_MAX}, "
                                                       f"got {header[:40]!r}")
            version = int(header)
        body = await request.body()
        try:
            tensors = decode_weights(body, views=True)  # safetensors: plain tensors, never pickle; read only
        except WireFormatError as err:
            raise RequestError("weights", str(err)) from None
        new_version = await asyncio.to_thread(engine.update_weights, tensors, version)
        return JSONResponse({"weight_version": new_version, "tensors": len(tensors)})

    @app.post("/v1/images/generations")
    async def images_generations(req: ImageGenerationRequest, request: Request) -> Response:
        width, height = _parse_size(req.size)
        video = engine.family.generates_video  # an image of a video family: its one-frame video
        rollout_req = RolloutRequest(
            prompt=req.prompt, negative_prompt=req.negative_prompt, seed=req.seed, num_outputs_per_prompt=req.n,
            width=width, height=height, num_inference_steps=req.num_inference_steps, guidance_scale=req.guidance_scale,
            num_frames=1 if video else None,
        )
        if (outputs := await generate(request, rollout_req)) is None:
            return Response(status_code=499)
        images = to_uint8(torch.stack([o.generated_output[:, 0] if video else o.generated_output for o in outputs]))
        return JSONResponse({"created": int(time.time()), "data": [{"b64_json": _png_b64(img)} for img in images]})

    post_training.add_routes(app, engine, limits)
    return app


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body is read by then, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _compact_request(body: Any) -> Any:
    """A /rollout/generate body FastAPI did not read as JSON (its Content-Type is not JSON) is read as diffrl's
    compact msgpack request (`Content-Type: application/msgpack`: condition images as raw bytes)."""
    if not isinstance(body, bytes):
        return body
    try:
        return decode_request(body)
    except WireFormatError as err:
        raise ValueError(f"the body is neither JSON (Content-Type: application/json) nor a msgpack map "
                         f"(Content-Type: {MEDIA_TYPE}): {err}") from None


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
    if "application/json" in weights:  # named: JSON, sglang-diffusion's own answer, wins a tie
        return compact > weights["application/json"]
    return compact > 0 and compact >= weights.get("application/*", weights.get("*/*", 0.0))


def _png_b64(array) -> str:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def engine_spec(cfg: ServeConfig) -> EngineSpec:
    """The served engine: the model (a trained checkpoint on its run's base and family unless given), its speed
    options and the server's limits."""
    from diffrl.models.demo import SHIPPED_DEMO_MODEL  # deferred: the family modules import diffusers (seconds)

    limits = dataclasses.asdict(cfg.engine_config())
    limits.pop("max_outputs_per_request"), limits.pop("max_batch_outputs")
    common = dict(device=str(resolve_device(cfg.device)), max_outputs_per_request=cfg.max_outputs_per_request,
                  max_batch_outputs=cfg.max_batch_outputs, limits=limits, flow_shift=cfg.flow_shift,
                  condition_image_size=cfg.condition_image_size, offload_text_encoder=cfg.offload_text_encoder,
                  **dataclasses.asdict(SpeedOptions.of(cfg)))  # eager numerics kept with --compile, as in training
    if cfg.checkpoint is not None:
        run = find_run(cfg.checkpoint)
        model_path = cfg.model_path or Path(run.get("model_path", SHIPPED_DEMO_MODEL))
        name = cfg.diffusion_model_family or (run.get("diffusion_model_family") if cfg.model_path is None else None)
        return EngineSpec(model_path=str(model_path), family=name, checkpoint=str(run.checkpoint), **common)
    return EngineSpec(model_path=str(cfg.model_path or SHIPPED_DEMO_MODEL), family=cfg.diffusion_model_family,
                      **common)


def build_engine(cfg: ServeConfig) -> Engine:
    spec = engine_spec(cfg)
    spec.speed().check()  # before the model loads
    if spec.checkpoint is not None:
        print(f"serving {spec.checkpoint} (base {spec.model_path})")
    return build_spec_engine(spec)


def limit_malloc_arenas(arenas: int) -> bool:
    """Cap glibc's malloc arenas for this process (`mallopt(M_ARENA_MAX)`); it applies to arenas created
    from now on, so call it before the server's threads start. False where there is no glibc to ask, or
    MALLOC_ARENA_MAX is set (glibc has read it already)."""
    if arenas <= 0 or "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(-8, arenas))  # -8: M_ARENA_MAX in glibc's malloc.h
    except (OSError, AttributeError):
        return False


def trim_malloc_heap() -> bool:
    """`malloc_trim(0)`: return free heap pages of every arena to the OS (False without glibc)."""
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except (OSError, AttributeError):
        return False


@contextlib.contextmanager
def serving_in_thread(app, start_timeout_s: float = 20.0, keep_alive_s: float = 5.0):
    """`app` under uvicorn on a free loopback port in a daemon thread (tests and benchmarks); yields its
    URL and stops the server on exit. `keep_alive_s`: how long an idle connection stays open (uvicorn's
    default, 5 s)."""
    import socket

    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                            timeout_keep_alive=keep_alive_s))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError(f"the server on port {port} did not start within {start_timeout_s} s")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def check_tensor_updates(enabled: bool, *, exposed: bool, token: str | None) -> None:
    """Refuse to start a server that would take pickled tensor updates from beyond loopback without a token."""
    if enabled and exposed and not token:
        raise ValueError("--update-weights-from-tensor on a --host beyond loopback needs --update-token "
                         "(or DIFFRL_ENGINE_TOKEN); on 127.0.0.1 it answers loopback peers without one")


def serve(cfg: ServeConfig) -> None:
    import uvicorn

    token = cfg.update_token or os.environ.get("DIFFRL_ENGINE_TOKEN")
    exposed = cfg.host not in LOOPBACK_HOSTS
    check_tensor_updates(cfg.update_weights_from_tensor, exposed=exposed, token=token)
    limit_malloc_arenas(cfg.malloc_arena_max)
    engine = build_engine(cfg)
    app = create_app(engine, update_token=token, exposed=exposed, limits=cfg.server_limits(), docs=cfg.docs,
                     trim_heap=cfg.malloc_arena_max > 0, stream_responses=cfg.stream_responses,
                     model_path=str(cfg.checkpoint or cfg.model_path) if (cfg.checkpoint or cfg.model_path) else None)
    uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="info")
