"""Image tokens carried inside a prompt's conditioning: the editing families fold a condition image's tokens into
the rows of the text embedding (zero-padded to the text width), so the engine's denoising env, the trainer and
replay carry the source unchanged, and each family's forward unfolds them."""

from __future__ import annotations

import torch


def pack_image_rows(tokens: torch.Tensor, width: int) -> torch.Tensor:
    """`[B, S, C]` image tokens laid row-major into `[B, ceil(S·C / width), width]` rows, zero-padded at the end."""
    flat = tokens.reshape(tokens.shape[0], -1)
    flat = torch.nn.functional.pad(flat, (0, -flat.shape[1] % width))
    return flat.view(tokens.shape[0], -1, width)


def unpack_image_rows(rows: torch.Tensor, count: int, channels: int) -> torch.Tensor:
    """The inverse of `pack_image_rows` for `count` tokens of `channels`: `[B, R, width]` → `[B, count, channels]`."""
    return rows.reshape(rows.shape[0], -1)[:, : count * channels].view(rows.shape[0], count, channels)
