"""Condition images: the input images of an image-conditioned prompt (an edit's source), from a prompt file's row to
the decoded pixels a family encodes and a reward sees.

A `.jsonl` row names its images under `image` (one path, or a list) or `images` (a list, or one path), as
Flow-Factory's datasets do. A relative path is read from the `.jsonl` file's folder, else from its `images/` folder
(Flow-Factory's layout: `<dataset>/images/<file>`). Each image is decoded once when the file is read, so a missing
or undecodable one is refused at start-up, in one line naming the file and the row; the record keeps its path and
the sha256 of its bytes (`ConditionImage`), and `read()` refuses a file changed since.

On the wire an image travels as its file's bytes (PNG, JPEG, …, never re-encoded), so the engine decodes exactly
the pixels the data loader checked; `decode_image` is that one decoder: RGB, `uint8 [3, H, W]`.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError

# The keys of a prompt row that name its condition images (Flow-Factory's spellings).
IMAGE_KEYS = ("image", "images")
# Where the reward's metadata holds a prompt's condition images: a list of float [3, H, W] in [0, 1], beside the
# prompt's own keys (rewards/README in docs/rewards.md).
CONDITION_IMAGES_KEY = "condition_images"
# Decoding refuses images larger than this (a decompression bomb is a small file of a huge image).
MAX_IMAGE_PIXELS = 64 * 2**20


@dataclass(frozen=True)
class ConditionImage:
    """One condition image of a prompt record: its file and the sha256 of its bytes when it was read; or, made in
    memory (`in_memory`: a rendered source), its bytes, with `path` naming what made them."""

    path: Path
    sha256: str
    data: bytes | None = field(default=None, repr=False, compare=False)

    @classmethod
    def in_memory(cls, data: bytes, name: str) -> ConditionImage:
        return cls(Path(name), hashlib.sha256(data).hexdigest(), data)

    def read(self) -> bytes:
        """The file's bytes; a ValueError naming the file when it has changed since the prompt file was read."""
        if self.data is not None:
            return self.data
        data = self.path.read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise ValueError(f"condition image {self.path}: changed since the prompt data was read")
        return data


def decode_image(data: bytes, what: str, max_pixels: int | None = MAX_IMAGE_PIXELS) -> torch.Tensor:
    """The RGB pixels of an encoded image as `uint8 [3, H, W]`; a ValueError starting with `what` when the bytes are
    not an image PIL decodes, or one of more than `max_pixels` pixels."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise ValueError(f"{what}: {image.width}x{image.height} pixels, above the limit of {max_pixels}")
            image.load()
            rgb = image.convert("RGB")
    except UnidentifiedImageError:  # PIL's message names the in-memory buffer's address: the same bytes, new words
        raise ValueError(f"{what}: not a decodable image (no image format recognized)") from None
    except (OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise ValueError(f"{what}: not a decodable image ({str(err)[:120]})") from None
    return torch.from_numpy(np.asarray(rgb).copy()).permute(2, 0, 1).contiguous()


def encode_png(pixels: np.ndarray) -> bytes:
    """`uint8 [H, W, 3]` pixels as PNG bytes (lossless: `decode_image` gives them back bit for bit)."""
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def to_unit(image: torch.Tensor) -> torch.Tensor:
    """`uint8 [3, H, W]` → float `[3, H, W]` in [0, 1] (what rewards see of images)."""
    return image.float() / 255


def with_condition_images(meta: dict, images) -> dict:
    """A prompt's reward metadata with its condition images (encoded files) decoded under `CONDITION_IMAGES_KEY`
    (float `[3, H, W]` in [0, 1]); unchanged without any."""
    if not images:
        return meta
    decoded = [to_unit(decode_image(data, f"condition image {i}")) for i, data in enumerate(images)]
    return {**meta, CONDITION_IMAGES_KEY: decoded}


def row_images(row: dict, folder: Path, where: str) -> tuple[ConditionImage, ...]:
    """Pop the condition images of a prompt row (`IMAGE_KEYS`) and check each decodes; `where` (`file:line`)
    starts every error. A row with none gives ()."""
    keys = [k for k in IMAGE_KEYS if k in row]
    if len(keys) > 1:
        raise ValueError(f"{where}: both 'image' and 'images' are set; list every condition image under one of them")
    if not keys:
        return ()
    value = row.pop(keys[0])
    paths = [value] if isinstance(value, str) else value
    if not isinstance(paths, list) or not paths or not all(isinstance(p, str) and p for p in paths):
        raise ValueError(f"{where}: {keys[0]!r} must be a path or a non-empty list of paths, got {value!r:.80}")
    return tuple(_checked(p, folder, where) for p in paths)


def _checked(name: str, folder: Path, where: str) -> ConditionImage:
    path = _resolve(name, folder)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{where}: condition image {name!r}: no such file ({path})") from None
    except OSError as err:
        raise ValueError(f"{where}: condition image {name!r}: cannot read {path} ({err.strerror})") from None
    decode_image(data, f"{where}: condition image {name!r} ({path})")
    return ConditionImage(path, hashlib.sha256(data).hexdigest())


def _resolve(name: str, folder: Path) -> Path:
    path = Path(name)
    if path.is_absolute():
        return path
    for base in (folder, folder / "images"):
        if (base / path).is_file():
            return (base / path).resolve()
    return (folder / path).resolve()
