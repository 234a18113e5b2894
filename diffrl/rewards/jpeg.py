"""JPEG file size as a reward (the simplest non-learned rewards of the Flow-GRPO / DDPO line): the size
in kB of the image saved as JPEG at quality 95; `jpeg_compressibility` is its negative."""

from __future__ import annotations

import io

from PIL import Image

from diffrl.rewards import register_reward
from diffrl.utils.images import to_uint8


def jpeg_kilobytes(images) -> list[float]:
    sizes = []
    for pixels in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return sizes


@register_reward("jpeg_incompressibility")
def jpeg_incompressibility(images, prompts, metadata=None) -> list[float]:
    return jpeg_kilobytes(images)


@register_reward("jpeg_compressibility")
def jpeg_compressibility(images, prompts, metadata=None) -> list[float]:
    return [-size for size in jpeg_kilobytes(images)]
