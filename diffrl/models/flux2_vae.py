"""The latent side shared by the families built on diffusers' `AutoencoderKLFlux2` (flux2, flux3_image): noise
drawn on the grid of 2×2-patchified VAE channels and packed to tokens, (t, h, w, l) position ids for image and text
tokens, and the decode through the VAE's latent BatchNorm statistics and the unpatchify, in the pipelines' own
arithmetic (bit-equal on CPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.batch_invariance import decode_rows
from diffrl.sampling import randn_per_sample


def image_position_ids(height_tokens: int, width_tokens: int, rope_scale: float = 1.0, device=None) -> torch.Tensor:
    """(t, h, w, l) of each image token, h and w scaled by the image RoPE scale (FLUX 3: 0.5; FLUX.2: 1), l = 0
    (the generated image)."""
    h = torch.arange(height_tokens, device=device, dtype=torch.float32).repeat_interleave(width_tokens)
    w = torch.arange(width_tokens, device=device, dtype=torch.float32).repeat(height_tokens)
    zeros = torch.zeros_like(h)
    return torch.stack([zeros, h * rope_scale, w * rope_scale, zeros], dim=1)


def text_position_ids(length: int, device=None) -> torch.Tensor:
    """(0, 0, 0, k) for text token k."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def noise_tokens(generators: Sequence[torch.Generator], channels: int, height_tokens: int, width_tokens: int,
                 device=None) -> torch.Tensor:
    """The pipelines' initial noise `[B, C, h, w]` (C: the patchified channels), one row per generator, packed
    to tokens `[B, h·w, C]`."""
    noise = randn_per_sample((len(generators), channels, height_tokens, width_tokens), generators, device=device)
    return noise.flatten(2).transpose(1, 2)


def decode_latents(vae, tokens: torch.Tensor, height_tokens: int, width_tokens: int,
                   per_call: int | None = None) -> torch.Tensor:
    """Packed tokens of an h×w token grid → images `[B, 3, H, W]` in [0, 1]: un-normalized with the VAE's BatchNorm
    statistics, unpatchified (`[B, 4C, h, w]` → `[B, C, 2h, 2w]`), decoded (`per_call`: see `decode_rows`)."""
    batch, _, channels = tokens.shape
    grid = tokens.view(batch, height_tokens, width_tokens, channels).permute(0, 3, 1, 2)
    bn = vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(grid.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(grid.dtype)
    grid = grid * std + mean
    grid = grid.reshape(batch, channels // 4, 2, 2, height_tokens, width_tokens).permute(0, 1, 4, 2, 5, 3)
    grid = grid.reshape(batch, channels // 4, height_tokens * 2, width_tokens * 2)
    vae_dtype = next(vae.parameters()).dtype
    images = decode_rows(lambda rows: vae.decode(rows.to(vae_dtype), return_dict=False)[0], grid, per_call=per_call)
    return (images.float() / 2 + 0.5).clamp(0, 1)
