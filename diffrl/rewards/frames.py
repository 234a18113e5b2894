"""Videos for image rewards: a video `[B, C, F, H, W]` scores as the mean of its frames' scores."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from diffrl.rewards.registry import weighted_sum


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


def on_frames(score: Callable, count: int | None) -> Callable:
    """`score` shown only `count` evenly spaced frames of each video (first and last included), as published
    video recipes score PickScore on a few frames; images and videos of at most `count` frames pass whole.
    None: every frame. Works for sync and async scorers alike (it only changes the input). A reward that reads
    a whole video (`whole_video`: the temporal rewards compare consecutive frames) keeps every frame, also as a
    part of a `multi:` sum, whose other parts still see `count` frames."""
    if count is None:
        return score
    if count < 1:
        raise ValueError(f"reward frames: expected a count >= 1, got {count}")
    if getattr(score, "whole_video", False):
        return score
    parts = getattr(score, "weighted_parts", None)
    if parts is not None:  # a multi: sum: each part decides for itself
        return weighted_sum([(on_frames(fn, count), w) for fn, w in parts], names=getattr(score, "part_names", None))

    @functools.wraps(score)
    def scored(images, prompts, metadata=None):
        return score(pick_frames(images, count), prompts, metadata)

    if hasattr(score, "close"):  # a worker pool: its owner still ends its processes
        scored.close = score.close
    return scored


def pick_frames(images: torch.Tensor, count: int | None) -> torch.Tensor:
    """`count` evenly spaced frames of each video `[B, C, F, H, W]` (first and last included); images, videos
    of at most `count` frames and None pass whole."""
    if count is not None and images.dim() == 5 and images.shape[2] > count:
        picks = torch.linspace(0, images.shape[2] - 1, count).round().long()
        images = images.index_select(2, picks.to(images.device))
    return images


def reads_whole_videos(score: Callable) -> bool:
    """Whether `score`, or a part of its `multi:` sum, is a reward `on_frames` leaves every frame."""
    return getattr(score, "whole_video", False) or any(
        reads_whole_videos(fn) for fn, _ in getattr(score, "weighted_parts", ()))


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
