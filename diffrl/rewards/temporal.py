"""Temporal consistency of videos `[B, C, F, H, W]` (an optional reward, meant to be weighed in with a
prompt reward through `multi:`): how alike consecutive frames are.

- `temporal_consistency`: 1 − the mean absolute pixel change between consecutive frames, in [0, 1].
  Needs no checkpoint; flicker and noise lower it.
- `temporal_clip@PATH[,processor=DIR]`: the mean cosine similarity of consecutive frames' CLIP image
  embeddings (a local CLIP checkpoint, as `clipscore`), in [−1, 1]; insensitive to small pixel motion,
  sensitive to the subject or the scene changing identity.

Both are maximal for a still video: alone they reward no motion at all, which is why they are a term of
a sum and not a target. An image (`[B, C, H, W]`, or a one-frame video) scores the maximum, 1.
"""

from __future__ import annotations

import torch

from diffrl.rewards.clip_scores import _Clip
from diffrl.rewards.registry import register_reward


def _videos(images: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """`images` as videos `[B, C, F, H, W]` (an image is a one-frame video), checked against the prompts."""
    if images.dim() == 4:
        images = images.unsqueeze(2)
    if images.dim() != 5:
        raise ValueError(f"temporal reward: expected videos [B, C, F, H, W] or images [B, C, H, W], "
                         f"got shape {tuple(images.shape)}")
    if images.shape[0] != len(prompts):
        raise ValueError(f"temporal reward: {images.shape[0]} videos but {len(prompts)} prompts")
    return images


@register_reward("temporal_consistency")
def temporal_consistency(images, prompts, metadata=None) -> list[float]:
    videos = _videos(images, list(prompts)).float()
    if videos.shape[2] < 2:
        return [1.0] * videos.shape[0]
    change = (videos[:, :, 1:] - videos[:, :, :-1]).abs().mean(dim=(1, 2, 3, 4))
    return (1.0 - change).tolist()


temporal_consistency.whole_video = True  # --reward-frames leaves it every frame (frames.on_frames)


def temporal_clip(path: str, device: torch.device, processor: str | None = None):
    clip = _Clip(path, device, processor)

    def score(images, prompts, metadata=None) -> list[float]:
        videos = _videos(images, list(prompts))
        b, c, f, h, w = videos.shape
        if f < 2:
            return [1.0] * b
        frames = videos.permute(0, 2, 1, 3, 4).reshape(b * f, c, h, w)
        embeds = clip.image_embeds(frames).view(b, f, -1)
        # A cosine of unit vectors, kept in [-1, 1] where float rounding of identical frames gives 1 + 2e-7.
        return (embeds[:, 1:] * embeds[:, :-1]).sum(-1).clamp(-1.0, 1.0).mean(-1).tolist()

    score.modules = (clip.model,)  # what --reward-colocate moves
    score.whole_video = True  # --reward-frames leaves it every frame (frames.on_frames)
    return score
