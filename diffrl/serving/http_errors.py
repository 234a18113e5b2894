"""What every HTTP endpoint of `diffrl serve` shares: the limits it enforces and the shape of its refusals.

Kept apart from the server so that the post-training endpoints (`post_training.py`) use the same error shapes
without importing the server, which adds their routes.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from fastapi.responses import Response

from diffrl.engine.protocol import EXTRA_KEY_ERROR


@dataclass(frozen=True)
class ServerLimits:
    """What the HTTP layer refuses before the engine sees a request (docs/wire-format.md, "Limits")."""

    max_body_bytes: int = 1 << 20
    """Largest JSON body (a prompt is capped by the engine's `max_prompt_chars` as well)."""
    max_weights_bytes: int | None = None
    """Largest `/update_weights` body; None: 8 bytes per element of the transformer's state (float64)
    plus room for the safetensors header."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names state-changing endpoints accept besides loopback ones (a loopback server accepts only
    those: DNS rebinding); an exposed server checks Host only when this is set."""
    allowed_origins: tuple[str, ...] = ()
    """`Origin`s state-changing endpoints accept; a request with any other Origin (a web page) is refused."""
    weights_roots: tuple[Path, ...] = ()
    """Directories `/update_weights_from_disk` may read checkpoints from (and what lies under them); empty: none."""
    tensor_updates: bool = False
    """Answer `/update_weights_from_tensor` (sglang's pickled tensors, `tensor_pickle.py`); off: 404. On: for a
    loopback peer, or with the update token when the server has one (then always with it); CUDA IPC tensors only
    for a loopback peer."""

    def weights_limit(self, transformer_state: dict) -> int:
        """Largest weight push in bytes: `max_weights_bytes`, or 8 bytes per element of the transformer's state
        (float64) plus room for names and headers."""
        if self.max_weights_bytes is not None:
            return self.max_weights_bytes
        return 8 * sum(t.numel() for t in transformer_state.values()) + 1024 * len(transformer_state) + (1 << 20)


def loopback_peer(client: tuple | None) -> bool:
    """Whether an ASGI `client` (the TCP peer's address and port) is this host's loopback (127.0.0.0/8, ::1, or
    IPv4-mapped 127.x). A test client or a Unix socket without an address is not."""
    if not client:
        return False
    try:
        address = ipaddress.ip_address(str(client[0]))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


def error_response(status: int, field: str, message: str, detail: list | None = None, *,
                   success_shape: bool = False) -> Response:
    """A one-line error naming the field. Encoded as ASCII JSON, so input that cannot be encoded (lone
    surrogates, NaN) is never what turns a refusal into a 500. `detail` is FastAPI's, what sglang-diffusion's
    clients read: the schema errors' list, else the same line as text. `success_shape`: also sglang-diffusion's
    post-training answer keys, `"success": false` and `message` (the same line)."""
    message = " ".join(str(message).split())[:400]
    body = {"error": {"field": field[:200], "message": message},
            "detail": detail if detail is not None else f"{field[:200]}: {message}"}
    if success_shape:
        line = message if message.startswith(f"{field[:200]}: ") else f"{field[:200]}: {message}"
        body = {"success": False, "message": line, **body}
    return Response(json.dumps(body, ensure_ascii=True, allow_nan=False), status_code=status,
                    media_type="application/json")


def _validation_response(errors: list[dict], *, success_shape: bool = False) -> Response:
    """422 for a schema error, in FastAPI's `detail` shape (loc, msg, type) plus `error`, but without the
    `input`/`ctx` echo (which may hold what JSON cannot encode)."""
    detail = []
    for err in errors[:10]:
        loc = [part if isinstance(part, int) else str(part)[:100] for part in err.get("loc", ())]
        if err.get("type") == EXTRA_KEY_ERROR:  # a refused extra_sampling_params key: name it, not the body
            loc += ["extra_sampling_params", str((err.get("ctx") or {}).get("key", ""))[:100]]
        detail.append({"loc": loc, "msg": " ".join(str(err.get("msg", "")).split())[:300],
                       "type": str(err.get("type", ""))[:60]})
    first = detail[0] if detail else {"loc": [], "msg": "invalid request"}
    field = ".".join(str(p) for p in first["loc"] if p != "body") or "body"
    message = first["msg"] if first["msg"].startswith(f"{field}: ") else f"{field}: {first['msg']}"
    return error_response(422, field, message, detail, success_shape=success_shape)
