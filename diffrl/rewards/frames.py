"""Videos for image rewards: a video `[B, C, F, H, W]` scores as the mean of its frames' scores."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


def as_frames(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None):
    """Frames `[B·F, C, H, W]` of videos `[B, C, F, H, W]` (video by video), each frame with its video's
    prompt and metadata, and F. Images `[B, C, H, W]` pass through with F = 1."""
    if images.dim() == 4:
        return images, list(prompts), metadata, 1
    if images.dim() != 5:
        raise ValueError(f"reward: expected images [B, C, H, W] or videos [B, C, F, H, W], got shape {tuple(images.shape)}")
    b, c, f, h, w = images.shape
    if len(prompts) != b:
        raise ValueError(f"reward: {b} videos but {len(prompts)} prompts")
    frames = images.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
    prompts = [p for p in prompts for _ in range(f)]
    if metadata is not None:
        metadata = [m for m in metadata for _ in range(f)]
    return frames, prompts, metadata, f


def mean_over_frames(score: Callable) -> Callable:
    """`score` (a sync image scorer) extended to videos: all frames in one call, then each video's mean."""

    @functools.wraps(score)
    def scored(images, prompts, metadata=None) -> list[float]:
        frames, frame_prompts, frame_metadata, f = as_frames(images, prompts, metadata)
        values = [float(v) for v in score(frames, frame_prompts, frame_metadata)]
        if f == 1:
            return values
        return [sum(values[i:i + f]) / f for i in range(0, len(values), f)]

    return scored
