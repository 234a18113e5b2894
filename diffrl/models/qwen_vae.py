"""The latent side shared by the families built on diffusers' `AutoencoderKLQwenImage` (qwen_image, krea2):
p×p patch packing of the VAE's 16-channel latents into transformer tokens, and the decode with the VAE's
per-channel `latents_mean` / `latents_std`, in the pipelines' own arithmetic (bit-equal on CPU)."""

from __future__ import annotations

import torch

from diffrl.models.batch_invariance import decode_rows


def pack_latents(grid: torch.Tensor, patch: int) -> torch.Tensor:
    """`[B, C, H, W]` latents → `[B, (H/p)·(W/p), C·p²]` tokens (p×p patches, channel-major in a patch)."""
    batch, channels, height, width = grid.shape
    grid = grid.reshape(batch, channels, height // patch, patch, width // patch, patch).permute(0, 2, 4, 1, 3, 5)
    return grid.reshape(batch, (height // patch) * (width // patch), channels * patch * patch)


def unpack_latents(tokens: torch.Tensor, h: int, w: int, patch: int) -> torch.Tensor:
    """The inverse of `pack_latents`, with the VAE's frame axis: `[B, h·w, C·p²]` → `[B, C, 1, h·p, w·p]`."""
    batch, _, channels = tokens.shape
    grid = tokens.view(batch, h, w, channels // patch**2, patch, patch).permute(0, 3, 1, 4, 2, 5)
    return grid.reshape(batch, channels // patch**2, 1, h * patch, w * patch)


def decode_latents(vae, tokens: torch.Tensor, h: int, w: int, patch: int, per_call: int | None = None) -> torch.Tensor:
    """Packed tokens of an h×w token grid → images `[B, 3, H, W]` in [0, 1] (`per_call`: see `decode_rows`)."""
    grid = unpack_latents(tokens, h, w, patch)
    config = vae.config
    vae_dtype = next(vae.parameters()).dtype
    grid = grid.to(vae_dtype)
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean).view(shape).to(grid.device, vae_dtype)
    inverse_std = 1.0 / torch.tensor(config.latents_std).view(shape).to(grid.device, vae_dtype)
    grid = grid / inverse_std + mean  # the pipelines' arithmetic, to the bit
    images = decode_rows(lambda rows: vae.decode(rows, return_dict=False)[0][:, :, 0], grid, per_call=per_call)
    return (images.float() / 2 + 0.5).clamp(0, 1)
