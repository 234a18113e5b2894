"""JPEG file size as a reward (the simplest non-learned rewards of the Flow-GRPO / DDPO line): the size
in kB of the image saved as JPEG at quality 95; `jpeg_compressibility` is its negative. A video scores the
mean over its frames."""

from __future__ import annotations

import io

from PIL import Image

from diffrl.rewards.registry import register_reward
from diffrl.rewards.frames import mean_over_frames
from diffrl.utils.images import to_uint8


def jpeg_kilobytes(images) -> list[float]:
    sizes = []
    for pixels in to_uint8(images):
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=95)
        sizes.append(buffer.tell() / 1000)
    return sizes


@register_reward("jpeg_incompressibility")
@mean_over_frames
def jpeg_incompressibility(images, prompts, metadata=None) -> list[float]:
    return jpeg_kilobytes(images)


@register_reward("jpeg_compressibility")
@mean_over_frames
def jpeg_compressibility(images, prompts, metadata=None) -> list[float]:
    return [-size for size in jpeg_kilobytes(images)]
