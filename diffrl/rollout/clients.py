"""Engine clients: one interface over an in-process engine and an engine behind HTTP.

The rollout manager only sees `EngineClient.generate(request) -> list[RolloutOutput]`. A refused
request raises `RequestError` (not retried: another engine would refuse it too); an engine that
cannot answer raises `EngineUnavailable` (retried on another engine).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Protocol

import httpx
import torch

from diffrl.engine.engine import Engine
from diffrl.engine.protocol import RolloutOutput, RolloutRequest
from diffrl.engine.wire import MEDIA_TYPE, decode_outputs, encode_weights
from diffrl.errors import RequestError
from diffrl.models.lora import LoraSpec


class EngineUnavailable(RuntimeError):
    """The engine failed or could not be reached; the request may be retried elsewhere."""


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
    """An engine behind `diffrl serve` (or sglang-diffusion's `/rollout/generate`)."""

    def __init__(self, base_url: str, *, executor: Executor | None = None, timeout_s: float = 600.0):
        self.name = base_url
        self._base_url, self._timeout_s = base_url, timeout_s
        self._http: httpx.AsyncClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor = executor  # msgpack/safetensors decoding runs here, off the event loop

    def _client(self) -> httpx.AsyncClient:
        # An httpx client's connections belong to one event loop; a training loop may call
        # asyncio.run once per rollout, so each new loop gets its own client.
        loop = asyncio.get_running_loop()
        if self._http is None or self._loop is not loop:
            self._http = httpx.AsyncClient(base_url=self._base_url, timeout=self._timeout_s)
            self._loop = loop
        return self._http

    async def generate(self, request: RolloutRequest) -> list[RolloutOutput]:
        try:
            response = await self._client().post(
                "/rollout/generate", json=request.model_dump(exclude_none=True), headers={"accept": MEDIA_TYPE},
            )
        except httpx.HTTPError as err:
            raise EngineUnavailable(f"{self.name}: {err.__class__.__name__}: {err}") from err
        if response.status_code in (400, 422):
            raise RequestError(*_field_and_message(response))
        if response.status_code != 200:
            raise EngineUnavailable(f"{self.name}: HTTP {response.status_code}: {response.text[:200]}")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, decode_outputs, response.content)

    def push_weights(self, tensors: dict[str, torch.Tensor], version: int, token: str | None = None) -> None:
        """Send named transformer tensors to the engine (`POST /update_weights`), synchronously:
        the trainer pushes between rollouts, outside any event loop."""
        headers = {"x-weight-version": str(version), "content-type": "application/octet-stream"}
        self._post("/update_weights", "weight push", token, content=encode_weights(tensors), headers=headers)

    def add_lora_adapter(self, spec: LoraSpec, token: str | None = None) -> None:
        """Have the engine host the trainer's LoRA adapter (`POST /lora_adapter`; idempotent)."""
        self._post("/lora_adapter", "LoRA adapter", token, json=spec.model_dump())

    def _post(self, path: str, what: str, token: str | None, headers: dict | None = None, **body) -> None:
        headers = dict(headers or {})
        if token:
            headers["authorization"] = f"Bearer {token}"
        try:
            response = httpx.post(f"{self._base_url}{path}", headers=headers, timeout=self._timeout_s, **body)
        except httpx.HTTPError as err:
            raise EngineUnavailable(f"{self.name}: {what} failed: {err.__class__.__name__}: {err}") from err
        if response.status_code != 200:
            raise EngineUnavailable(f"{self.name}: {what} refused: HTTP {response.status_code}: {response.text[:200]}")

    async def aclose(self) -> None:
        if self._http is not None and self._loop is asyncio.get_running_loop():
            await self._http.aclose()
        self._http = None


def _field_and_message(response: httpx.Response) -> tuple[str, str]:
    try:
        body = response.json()
    except ValueError:
        return "request", response.text[:200]
    if "error" in body:  # our 400: {"error": {"field", "message"}}
        return body["error"].get("field", "request"), body["error"].get("message", "")
    detail = body.get("detail") or [{}]  # FastAPI's 422: [{"loc": [...], "msg": ...}]
    first = detail[0] if isinstance(detail, list) and detail else {}
    loc = [str(part) for part in first.get("loc", []) if part != "body"]
    return ".".join(loc) or "request", first.get("msg", str(detail))
