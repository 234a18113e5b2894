"""Rollout responses written while they are sent, and read record by record as they arrive.

A video response is large (LTX-2.3 at 512 × 768 × 121 frames: 0.57 GB of float32 pixels per output), so
the server does not build the body in memory: `Body` is the response as a list of parts, small byte strings
(the msgpack or JSON structure) and tensors to be written as safetensors files, straight from the tensors'
memory (base64 for JSON). Its length is known before any tensor is encoded, so the answer keeps its
`Content-Length` framing, and its bytes are exactly what `wire.encode_outputs` / `sglang.encode_response`
build in one piece (tests check it). Peak memory per response is a chunk, not the body.

On the client, `JsonListSplitter` cuts a JSON list into its elements as bytes arrive (msgpack's own
`Unpacker` does it for the compact format), so each output is decoded and handed on before the next one
is on the wire.
"""

from __future__ import annotations

import asyncio
import binascii
import dataclasses
import json
import re
import struct
import sys
from collections.abc import AsyncIterator, Iterator

import msgpack
import torch
from safetensors.torch import save as save_safetensors


class WireFormatError(ValueError):
    """A payload that is not a well-formed rollout response."""


CHUNK_BYTES = 4 << 20
"""Bytes handed to the server per send: large enough that the per-chunk overhead (a thread hop) is noise,
small enough to bound what one response holds beyond its tensors."""

# safetensors' dtype codes for what the wire carries; any other dtype is written by safetensors itself.
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
    torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}
# The order safetensors lays a file's tensors out in (its dtype enum, descending; then by name).
_LAYOUT_RANK = {dtype: rank for rank, dtype in enumerate((
    torch.int64, torch.float64, torch.float32, torch.int32, torch.bfloat16, torch.float16, torch.int16, torch.int8,
    torch.uint8, torch.bool))}


class SafetensorsFile:
    """Named tensors as one safetensors file (little-endian header length, the JSON header padded with spaces
    to 8 bytes, the raw data), produced slice by slice from each tensor's own memory: a device tensor is
    copied to the host one at a time, as its turn comes, so writing the file holds one tensor beyond the
    tensors. Tensors are laid out as `safetensors.torch.save` lays them out (the same bytes), widest element
    first, which keeps every tensor aligned to its element size. Its length needs only shapes and dtypes
    (meta tensors will do for sizing)."""

    __slots__ = ("tensors", "head", "length", "_whole")

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tensors = sorted(((name, t.detach()) for name, t in tensors.items()),
                              key=lambda item: (_LAYOUT_RANK.get(item[1].dtype, 0), item[0]))
        self._whole = None
        if sys.byteorder != "little" or any(t.dtype not in SAFETENSORS_DTYPES for _, t in self.tensors):
            # rare: let safetensors write it, in one piece
            self._whole = save_safetensors({name: t.contiguous().cpu() for name, t in self.tensors})
            self.head, self.length = b"", len(self._whole)
            return
        header, offset = {}, 0
        for name, t in self.tensors:
            nbytes = t.numel() * t.element_size()
            header[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.head = struct.pack("<Q", len(text)) + text
        self.length = len(self.head) + offset

    def pieces(self, size: int = CHUNK_BYTES) -> Iterator[bytes | memoryview]:
        if self._whole is not None:
            yield self._whole
            return
        yield self.head
        for _, tensor in self.tensors:
            data = tensor.contiguous().cpu().reshape(-1)
            if data.numel():
                raw = memoryview(data.view(torch.uint8).numpy())
                for start in range(0, len(raw), size):
                    yield raw[start:start + size]


class TensorFile(SafetensorsFile):
    """One tensor as a safetensors file holding it under `name`: what a wire tensor map carries."""

    __slots__ = ()

    def __init__(self, tensor: torch.Tensor, name: str):
        super().__init__({name: tensor})


class Base64:
    """The base64 text of a `TensorFile` (as `base64.b64encode` of the whole file gives it), encoded piece by
    piece: each piece is cut at a multiple of 3 bytes and the 1-2 bytes left over lead the next one."""

    __slots__ = ("file", "length")

    def __init__(self, file: TensorFile):
        self.file = file
        self.length = 4 * -(-file.length // 3)

    def pieces(self, size: int = CHUNK_BYTES) -> Iterator[bytes]:
        carry = b""
        for piece in self.file.pieces(size):
            if carry:
                take = 3 - len(carry)
                head = carry + bytes(piece[:take])
                piece = piece[take:]
                if len(head) < 3:
                    carry = head
                    continue
                yield binascii.b2a_base64(head, newline=False)
            cut = len(piece) - len(piece) % 3
            if cut:
                yield binascii.b2a_base64(piece[:cut], newline=False)
            carry = bytes(piece[cut:])
        if carry:
            yield binascii.b2a_base64(carry, newline=False)


Part = bytes | SafetensorsFile | Base64


class Body:
    """A response body as parts, with its exact length; `chunks()` writes it (`b"".join(body.chunks())` is the
    whole body)."""

    def __init__(self, parts: list[Part]):
        merged: list[Part] = []
        for part in parts:  # adjacent byte strings as one
            if isinstance(part, bytes) and merged and isinstance(merged[-1], bytes):
                merged[-1] += part
            elif not (isinstance(part, bytes) and not part):
                merged.append(part)
        self.parts = merged
        self.length = sum(len(p) if isinstance(p, bytes) else p.length for p in merged)

    def chunks(self, size: int = CHUNK_BYTES) -> Iterator[bytes | memoryview]:
        """Pieces of about `size` bytes: small parts are gathered, a tensor's slices go out as they are."""
        pending = bytearray()
        for part in self.parts:
            for piece in ((part,) if isinstance(part, bytes) else part.pieces(size)):
                if not pending and len(piece) >= size // 2:
                    yield piece
                    continue
                pending += piece
                if len(pending) >= size:
                    yield bytes(pending)
                    pending.clear()
        if pending:
            yield bytes(pending)

    def __bytes__(self) -> bytes:
        return b"".join(self.chunks())


async def stream(body: Body, size: int = CHUNK_BYTES) -> AsyncIterator[bytes | memoryview]:
    """`body.chunks()` for an ASGI response: each chunk is made off the event loop (base64 and copies cost
    milliseconds), and the next one only once the server has taken this one (its flow control holds the
    chunks back from a slow reader). A response abandoned mid-way stops between two chunks."""
    chunks = body.chunks(size)
    while (chunk := await asyncio.to_thread(next, chunks, None)) is not None:
        yield chunk


# ---------------------------------------------------------------------------- msgpack
def _msgpack_header(n: int, small: int, tag8: bytes | None, tag16: bytes, tag32: bytes, fix: int | None) -> bytes:
    if fix is not None and n < small:
        return bytes([fix | n])
    if tag8 is not None and n < 256:
        return tag8 + n.to_bytes(1, "big")
    if n < 1 << 16:
        return tag16 + n.to_bytes(2, "big")
    return tag32 + n.to_bytes(4, "big")


def msgpack_array_header(n: int) -> bytes:
    return _msgpack_header(n, 16, None, b"\xdc", b"\xdd", 0x90)


def _msgpack_map_header(n: int) -> bytes:
    return _msgpack_header(n, 16, None, b"\xde", b"\xdf", 0x80)


def _msgpack_bin_header(n: int) -> bytes:
    return _msgpack_header(n, 0, b"\xc4", b"\xc5", b"\xc6", None)


def _packb(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def msgpack_parts(value, tensor_map) -> list[Part]:
    """`value` as msgpack parts, byte for byte what `msgpack.packb(..., use_bin_type=True)` makes of the wire
    form of `value`: tensors become maps through `tensor_map(tensor) -> dict` (whose "data" entry, a
    `TensorFile`, is written as a bin), dataclasses and dicts maps, anything else as msgpack packs it."""
    if isinstance(value, torch.Tensor):
        parts: list[Part] = [_msgpack_map_header(len(fields := tensor_map(value)))]
        for key, item in fields.items():
            parts.append(_packb(key))
            if isinstance(item, TensorFile):
                parts += [_msgpack_bin_header(item.length), item]
            else:
                parts.append(_packb(item))
        return parts
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        parts = [_msgpack_map_header(len(value))]
        for key, item in value.items():
            parts += [_packb(key), *msgpack_parts(item, tensor_map)]
        return parts
    return [_packb(value)]


# ---------------------------------------------------------------------------- JSON
_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def json_parts(value) -> list[Part]:
    """`value` as JSON parts, byte for byte what `json.dumps(value, separators=(",", ":"), allow_nan=False)`
    writes, where a `Base64` stands for its text (written as a JSON string) and `bytes` for JSON text
    already encoded (a fragment repeated on every record is encoded once)."""
    if isinstance(value, Base64):
        return [b'"', value, b'"']
    if isinstance(value, bytes):
        return [value]
    if isinstance(value, dict):
        parts: list[Part] = [b"{"]
        for k, (key, item) in enumerate(value.items()):
            parts += [b"," if k else b"", _json.encode(key).encode() + b":", *json_parts(item)]
        return [*parts, b"}"]
    if isinstance(value, list | tuple):
        parts = [b"["]
        for k, item in enumerate(value):
            parts += [b"," if k else b"", *json_parts(item)]
        return [*parts, b"]"]
    return [_json.encode(value).encode()]


class JsonListSplitter:
    """Cuts a JSON list of objects into its elements' bytes as the text arrives: `feed(data)` returns the
    elements completed by `data`; `finish()` checks the list was closed. Only the structure is scanned
    (brackets, strings and their escapes, with the state kept across pieces); each element is left to
    `json.loads`. An element's pieces are joined once, when it closes."""

    _SYNTAX = re.compile(rb'[{}\[\]"]')
    _SPACE = b" \t\r\n"

    def __init__(self):
        self._state = "open"  # open: before "["; first/item: before an element; inside: in one; after; done
        self._pieces: list[bytes] = []  # the open element's text so far
        self._depth = 0
        self._string = self._escape = False
        self.count = 0

    def feed(self, data: bytes | memoryview) -> list[bytes]:
        data = bytes(data)
        elements, pos, start = [], 0, 0
        while True:
            if self._state == "inside":
                end = self._scan(data, pos)
                if end is None:
                    self._pieces.append(data[start:])
                    break
                elements.append(b"".join([*self._pieces, data[start:end]]))
                self._pieces, self._state, pos = [], "after", end
                self.count += 1
                continue
            if pos >= len(data):
                break
            byte = data[pos]
            if byte in self._SPACE:
                pos += 1
                continue
            char = chr(byte)
            if self._state == "open" and char == "[":
                self._state = "first"
            elif self._state in ("first", "item") and char == "{":
                self._state, self._depth, self._string, self._escape, start = "inside", 1, False, False, pos
            elif self._state in ("first", "after") and char == "]":
                self._state = "done"
            elif self._state == "after" and char == ",":
                self._state = "item"
            else:
                raise WireFormatError(f"response is not a JSON list of records: unexpected {char!r} "
                                      f"({self._state} element {self.count})")
            pos += 1
        return elements

    def _scan(self, data: bytes, pos: int) -> int | None:
        """Where the open element ends in `data` (the index after its closing brace), or None: it goes on."""
        while True:
            if self._escape:
                if pos >= len(data):
                    return None
                pos, self._escape = pos + 1, False
            if self._string:  # two memchr scans: most of a record is one long base64 string
                quote = data.find(b'"', pos)
                slash = data.find(b"\\", pos, len(data) if quote < 0 else quote)
                if slash >= 0:
                    pos, self._escape = slash + 1, True
                    continue
                if quote < 0:
                    return None
                pos, self._string = quote + 1, False
                continue
            match = self._SYNTAX.search(data, pos)
            if match is None:
                return None
            pos, char = match.end(), match[0]
            if char == b'"':
                self._string = True
            elif char in (b"{", b"["):
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    return pos

    def finish(self) -> None:
        if self._state != "done":
            raise WireFormatError(f"the JSON list ended early (after {self.count} complete records)")
