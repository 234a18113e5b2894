"""A request's condition images (`image_path`), decoded: what an image-conditioned family encodes.

Each entry of `image_path` is one image, in one of three forms:
- a path on the engine's disk (sglang-diffusion's meaning of the field): read only under the engine's allowed
  roots (`EngineConfig.image_roots`, by default none), resolved (symlinks, `..`) before the check;
  an in-process engine (roots None) reads any path;
- a `data:` URL with base64 bytes (`data:image/png;base64,…`, the form sglang's OpenAI-style endpoints take):
  what a remote client sends in JSON;
- raw bytes (diffrl's msgpack request body, and in-process requests).
Every form carries an encoded file (PNG, JPEG, …), decoded here by `diffrl.data.condition_images.decode_image`,
so the engine sees the pixels the client's file holds, bit for bit.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from pathlib import Path

import torch

from diffrl.data.condition_images import decode_image
from diffrl.errors import RequestError

FIELD = "image_path"


def request_images(entries: Sequence[str | bytes] | None, roots: Sequence[Path] | None,
                   max_pixels: int | None) -> tuple[torch.Tensor, ...]:
    """Each entry decoded to `uint8 [3, H, W]`; a RequestError naming `image_path[i]` for one that cannot be read
    or decoded, or is larger than `max_pixels`."""
    images = []
    for i, entry in enumerate(entries or ()):
        what = f"{FIELD}[{i}]"
        data = _entry_bytes(entry, what, roots)
        try:
            images.append(decode_image(data, what, max_pixels))
        except ValueError as err:
            raise RequestError(FIELD, str(err)) from None
    return tuple(images)


def data_url(data: bytes) -> str:
    """Image bytes as a `data:` URL (what a JSON request carries); the media type from the file's signature."""
    kind = next((k for magic, k in _SIGNATURES if data.startswith(magic)), "application/octet-stream")
    return f"data:{kind};base64,{base64.b64encode(data).decode()}"


_SIGNATURES = ((b"\x89PNG", "image/png"), (b"\xff\xd8", "image/jpeg"), (b"RIFF", "image/webp"), (b"GIF8", "image/gif"))


def _entry_bytes(entry: str | bytes, what: str, roots: Sequence[Path] | None) -> bytes:
    if isinstance(entry, bytes):
        return entry
    if entry.startswith("data:"):
        head, sep, payload = entry.partition(",")
        if not sep or not head.endswith(";base64"):
            raise RequestError(FIELD, f"{what}: a data URL must be data:<type>;base64,<bytes>")
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(FIELD, f"{what}: the data URL's payload is not base64") from None
    if entry.startswith(("http://", "https://")):
        raise RequestError(FIELD, f"{what}: URLs are not fetched; send the image's bytes (a data: URL) instead")
    return _read_allowed(entry, what, roots)


def _read_allowed(name: str, what: str, roots: Sequence[Path] | None) -> bytes:
    if "\x00" in name or not Path(name).is_absolute():
        raise RequestError(FIELD, f"{what}: must be an absolute path on the server, or a data: URL, got {name[:200]!r}")
    path = Path(name).resolve()
    if roots is not None:
        if not roots:
            raise RequestError(FIELD, f"{what}: this engine reads no images from its disk (no image roots set); "
                                      "send the image's bytes as a data: URL")
        if not any(path == r or path.is_relative_to(r) for r in (Path(root).resolve() for root in roots)):
            raise RequestError(FIELD, f"{what}: {name[:200]!r} is not under a directory this engine reads images "
                                      "from (its image roots)")
    try:
        return path.read_bytes()
    except OSError as err:
        raise RequestError(FIELD, f"{what}: cannot read {name[:200]!r} ({err.strerror or err})") from None
