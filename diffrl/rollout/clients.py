"""Engine clients: one interface over an in-process engine and an engine behind HTTP.

The rollout manager only sees `EngineClient.generate(request) -> list[RolloutOutput]`. A refused
request raises `RequestError` (not retried: another engine would refuse it too); an engine that
cannot answer raises `EngineUnavailable` (retried on another engine). A client whose `streams_outputs`
is true also takes `on_output(i, output)`, called on the event loop as each output of the response
arrives, before `generate` returns them all.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol
from urllib.parse import urlsplit

import torch

from diffrl.serving import sglang
from diffrl.engine.engine import Engine
from diffrl.engine.condition_images import data_url
from diffrl.engine.protocol import RolloutOutput, RolloutRequest
from diffrl.serving.streaming import Body
from diffrl.serving.wire import (
    MEDIA_TYPE,
    OutputStreamDecoder,
    WireFormatError,
    decode_outputs,
    encode_request,
    weights_body,
)
from diffrl.errors import EngineUnavailable, RequestError
from diffrl.models.base import FamilyAdapter
from diffrl.models.lora import LoraSpec
from diffrl.models.registry import get_family

# Compact msgpack first; sglang-diffusion's JSON (what its servers always send) is read as well.
_ACCEPT = {"compact": f"{MEDIA_TYPE}, {sglang.JSON_MEDIA_TYPE};q=0.5", "sglang": sglang.JSON_MEDIA_TYPE}
# Most bytes one read of a streamed response takes: a read returns what has arrived, up to this.
_READ_BYTES = 4 << 20
OnOutput = Callable[[int, RolloutOutput], None]


class EngineClient(Protocol):
    name: str

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]: ...


class InProcessEngineClient:
    """The embedded default: no server, no serialization."""

    def __init__(self, engine: Engine, name: str = "local"):
        self.engine = engine
        self.name = name

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        try:
            return await self.engine.agenerate(request)
        except RequestError:
            raise
        except Exception as err:
            raise EngineUnavailable(f"{self.name}: {err.__class__.__name__}: {err}") from err


class HttpEngineClient:
    """An engine behind `diffrl serve` (or sglang-diffusion's `/rollout/generate`).

    Each request runs in a worker thread over a kept-alive `http.client` connection, and its
    response is decoded there: reading a multi-megabyte body is several times faster that way
    than through httpx's async client, which capped one trainer's intake from several engines
    (BENCHMARKS.md, the one-client ceiling). `max_in_flight` threads: a request waiting for a
    thread is not yet at the engine, so give at least the rollout's in-flight cap per engine.

    It asks for the compact msgpack format (`Accept: application/msgpack`) and reads sglang-diffusion's
    JSON when that is what comes back (an sglang server ignores the header); both decode to the same
    in-process `RolloutOutput`s. Requests go as JSON (condition images as `data:` URLs) until the server has
    answered in the compact format (a diffrl server, which reads compact requests too), then as msgpack
    (`Content-Type: application/msgpack`, condition images as raw bytes). Reading JSON conditioning needs the model family's mapping of sglang's
    cond kwargs: `family` (a name or adapter class); else the server's `/health` family (a diffrl
    server), else env `DIFFRL_MODEL_FAMILY`, else the FLUX-style default. `wire_format="sglang"` asks a
    diffrl server for the JSON format too (to measure or check it).

    `stream` (default): read a response as it arrives and decode each output as soon as its last byte is
    in (either format), handing it to `generate`'s `on_output` while the rest is still on the wire: a
    video response is large, so the scorer starts on output 0 long before output M − 1 has landed.
    False: read the whole body, then decode it."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0, max_in_flight: int = 64,
                 family: str | type[FamilyAdapter] | None = None, wire_format: str = "compact",
                 stream: bool = True):
        url = urlsplit(base_url)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"engine URL {base_url!r}: expected http://host:port")
        if wire_format not in _ACCEPT:
            raise ValueError(f"wire_format {wire_format!r}: expected one of {sorted(_ACCEPT)}")
        self._accept = _ACCEPT[wire_format]
        self._sends_compact = False  # set once the server has answered in the compact format
        self.name = base_url
        self._timeout_s = timeout_s
        self._url = url
        self._threads = ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix=f"engine {url.netloc}")
        self._local = threading.local()  # each worker thread's connection
        self._family = family
        self._family_lock = threading.Lock()
        self.streams_outputs = stream

    def _new_connection(self, timeout_s: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self._url.scheme == "https" else http.client.HTTPConnection
        return kind(self._url.hostname, self._url.port, timeout=timeout_s)

    def _connection(self) -> http.client.HTTPConnection:
        connection = getattr(self._local, "connection", None)
        if connection is None:
            connection = self._local.connection = self._new_connection(self._timeout_s)
        return connection

    def _send(self, method: str, path: str, body: bytes | Body | None, headers: dict) -> http.client.HTTPResponse:
        """Send a request on this thread's kept-alive connection and return its response (headers read).

        A server closes a kept-alive connection that sits idle (uvicorn after 5 s), and a trainer's next
        weight push or rollout request comes a whole rollout later: on such a connection the request fails
        before any answer (a broken pipe while the body is written, or a closed socket instead of a status
        line). The server never saw it, so it goes once more on a new connection. A connection that has
        carried nothing yet gets no second try: its failure is the server's."""
        connection = self._connection()
        reused = connection.sock is not None
        target = f"{self._url.path.rstrip('/')}{path}"
        if isinstance(body, Body):  # written as it is sent, with its length known up front
            headers = {**headers, "content-length": str(body.length)}

        def payload():  # a Body's chunks start over on the second try
            return body.chunks() if isinstance(body, Body) else body

        try:
            connection.request(method, target, body=payload(), headers=headers)
            return connection.getresponse()
        except (BrokenPipeError, ConnectionResetError):  # RemoteDisconnected is a ConnectionResetError
            if not reused:
                raise
        self._drop()
        connection = self._connection()
        connection.request(method, target, body=payload(), headers=headers)
        return connection.getresponse()

    def _request_blocking(self, method: str, path: str, body: bytes | Body | None, headers: dict,
                          what: str) -> tuple[int, bytes, str]:
        """One request over this thread's kept-alive connection: (status, body, content type). A broken
        connection is dropped, not reused."""
        try:
            response = self._send(method, path, body, headers)
            return response.status, response.read(), response.getheader("content-type") or ""
        except (OSError, http.client.HTTPException) as err:
            self._drop()
            raise EngineUnavailable(f"{self.name}: {what}{err.__class__.__name__}: {err}") from err

    def _post_blocking(self, path: str, body: bytes | Body, headers: dict, what: str) -> tuple[int, bytes]:
        status, content, _ = self._request_blocking("POST", path, body, headers, what)
        return status, content

    def _request_body(self, request: RolloutRequest) -> tuple[bytes, dict]:
        """The request's body and headers: msgpack once the server has answered in it, else JSON."""
        if self._sends_compact:
            return encode_request(request_fields(request, image_bytes=True)), {"content-type": MEDIA_TYPE}
        return json.dumps(request_fields(request)).encode(), {"content-type": "application/json"}

    def _generate_blocking(self, request: RolloutRequest, deliver: OnOutput | None = None) -> list[RolloutOutput]:
        body, headers = self._request_body(request)  # built here, off the event loop (images may be megabytes)
        headers["accept"] = self._accept
        if not self.streams_outputs:
            status, content, kind = self._request_blocking("POST", "/rollout/generate", body, headers, what="")
            self._check_status(status, content)
            try:
                if _is_compact(kind):
                    self._sends_compact = True
                    return decode_outputs(content)
                return sglang.decode_response(content, request, self._family_class())
            except WireFormatError as err:  # a garbled answer: another engine may give a good one
                raise EngineUnavailable(f"{self.name}: malformed response: {err}") from err
        try:
            response = self._send("POST", "/rollout/generate", body, headers)
            if response.status != 200:
                self._check_status(response.status, response.read())
            if _is_compact(response.getheader("content-type") or ""):
                self._sends_compact = True
                decoder = OutputStreamDecoder()
            else:  # this thread's connection is busy with the response: /health goes on another
                decoder = sglang.ResponseStreamDecoder(request, self._family_class(spare_connection=True))
            outputs: list[RolloutOutput] = []
            while chunk := response.read1(_READ_BYTES):
                for output in decoder.feed(chunk):
                    if deliver is not None:
                        deliver(len(outputs), output)
                    outputs.append(output)
            decoder.finish()
            # read1 leaves a fully read response open (it only closes on a read that asks for bytes): close it, or
            # the kept-alive connection's next request fails with ResponseNotReady.
            response.close()
            return outputs
        except (OSError, http.client.HTTPException) as err:
            self._drop()
            raise EngineUnavailable(f"{self.name}: {err.__class__.__name__}: {err}") from err
        except WireFormatError as err:  # a garbled answer: another engine may give a good one
            self._drop()  # the rest of the body is unread
            raise EngineUnavailable(f"{self.name}: malformed response: {err}") from err
        except BaseException:
            self._drop()
            raise

    def _check_status(self, status: int, content: bytes) -> None:
        if status in (400, 422):
            raise RequestError(*_field_and_message(content))
        if status != 200:
            raise EngineUnavailable(f"{self.name}: HTTP {status}: {content[:200].decode(errors='replace')}")

    def _drop(self) -> None:
        """Close this thread's connection: a response left part-read cannot be followed by another request."""
        connection = getattr(self._local, "connection", None)
        if connection is not None:
            connection.close()
        self._local.connection = None

    def _family_class(self, spare_connection: bool = False) -> type[FamilyAdapter]:
        """The family whose cond-kwargs mapping reads this engine's JSON conditioning (resolved once).
        `spare_connection`: ask /health on a connection of its own."""
        with self._family_lock:
            if isinstance(self._family, type):
                return self._family
            name = self._family or os.environ.get("DIFFRL_MODEL_FAMILY")
            if name is None:
                try:
                    if spare_connection:
                        status, content = self._health_on_new_connection()
                    else:
                        status, content, _ = self._request_blocking("GET", "/health", None, {}, what="health: ")
                    name = json.loads(content).get("family") if status == 200 else None
                except (EngineUnavailable, OSError, http.client.HTTPException, ValueError, AttributeError):
                    name = None
            self._family = get_family(name) if name else FamilyAdapter
            return self._family

    def _health_on_new_connection(self) -> tuple[int, bytes]:
        connection = self._new_connection(min(self._timeout_s, 30.0))
        try:
            connection.request("GET", f"{self._url.path.rstrip('/')}/health")
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    async def generate(self, request: RolloutRequest, on_output: OnOutput | None = None) -> list[RolloutOutput]:
        """The request's outputs; with `stream`, `on_output(i, output)` runs on this event loop as output i
        arrives (for every output, before this returns)."""
        loop = asyncio.get_running_loop()
        deliver = None
        if on_output is not None:
            def deliver(i: int, output: RolloutOutput) -> None:
                with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits for the output
                    loop.call_soon_threadsafe(on_output, i, output)
        return await loop.run_in_executor(self._threads, self._generate_blocking, request, deliver)

    def push_weights(self, tensors: dict[str, torch.Tensor], version: int, token: str | None = None) -> None:
        """Send named transformer tensors to the engine (`POST /update_weights`), synchronously:
        the trainer pushes between rollouts, outside any event loop."""
        headers = {"x-weight-version": str(version), "content-type": "application/octet-stream"}
        self._post("/update_weights", "weight push", token, weights_body(tensors), headers)

    def add_lora_adapter(self, spec: LoraSpec, token: str | None = None) -> None:
        """Have the engine host the trainer's LoRA adapter (`POST /lora_adapter`; idempotent)."""
        self._post("/lora_adapter", "LoRA adapter", token, json.dumps(spec.model_dump()).encode(),
                   {"content-type": "application/json"})

    def _post(self, path: str, what: str, token: str | None, body: bytes | Body, headers: dict) -> None:
        if token:
            headers = {**headers, "authorization": f"Bearer {token}"}
        status, content = self._post_blocking(path, body, headers, what=f"{what} failed: ")
        if status != 200:
            raise EngineUnavailable(f"{self.name}: {what} refused: HTTP {status}: "
                                    f"{content[:200].decode(errors='replace')}")

    def close(self) -> None:
        """Stop the worker threads (their connections close with them)."""
        self._threads.shutdown(wait=False)


def request_fields(request: RolloutRequest, image_bytes: bool = False) -> dict:
    """The JSON body of `request` as both servers read it. sglang-diffusion's request model does not declare
    `guidance_scale_2` (Wan2.2's second-expert scale) and drops a field it does not declare without a word, but
    it merges `extra_sampling_params` into its sampling params, which do declare it: the scale goes there, where
    a diffrl server reads it too. Condition images given as bytes go as `data:` URLs (`image_bytes`: stay bytes,
    for a msgpack body)."""
    fields = request.model_dump(exclude_none=True)
    for extension in ("rollout_return_negative_env", "rollout_return_uncond_velocity"):
        if not fields.get(extension):  # diffrl's extensions, sent only when asked: sglang lacks them
            fields.pop(extension, None)
    if "image_path" in fields and not image_bytes:  # image bytes travel in JSON as data: URLs (paths stay paths on the server's disk)
        fields["image_path"] = [data_url(i) if isinstance(i, bytes) else i for i in fields["image_path"]]
    if "guidance_scale_2" in fields:
        fields["extra_sampling_params"] = {**fields.get("extra_sampling_params", {}),
                                           "guidance_scale_2": fields.pop("guidance_scale_2")}
    return fields


def _is_compact(content_type: str) -> bool:
    return content_type.split(";")[0].strip().lower() in (MEDIA_TYPE, "application/x-msgpack")


def _field_and_message(content: bytes) -> tuple[str, str]:
    try:
        body = json.loads(content)
    except ValueError:
        return "request", content[:200].decode(errors="replace")
    if "error" in body:  # our 400: {"error": {"field", "message"}}
        return body["error"].get("field", "request"), body["error"].get("message", "")
    detail = body.get("detail") or [{}]  # FastAPI's 422: [{"loc": [...], "msg": ...}]
    first = detail[0] if isinstance(detail, list) and detail else {}
    loc = [str(part) for part in first.get("loc", []) if part != "body"]
    return ".".join(loc) or "request", first.get("msg", str(detail))
