"""The two ends of sampling that most families share around their VAE: the initial noise in the VAE's own latent
layout, and the decode of latents the family has already un-normalized.

- `latent_noise`: SD3, SANA, Lumina 2, Z-Image, CogView4, HiDream, Wan2.2, HunyuanVideo 1.5 and Cosmos3 hand their transformer the VAE's
  latents as they are (`[B, C, h, w]`, or `[B, C, f, h, w]` for video); the transformer patchifies and positions
  them itself, so the latent state carries no position ids. Each family says which channel count and grid its
  pipeline draws.
- `decode_images`: SD3, SANA, Lumina 2, Z-Image, CogView4, FLUX.1 and Chroma (`flux1.decode_packed`), FLUX.2 and
  FLUX 3 (`flux2_vae.decode_latents`), HiDream, HunyuanVideo 1.5, Wan2.2 and Cosmos3 (`wan2_2.decode_wan_latents`)
  end a decode the same way:
  the VAE in its own dtype over groups of rows (`decode_rows`), then the pipelines' `x/2 + 0.5` clamped to [0, 1].
  What comes before it (unpacking, the scaling and shift factors or the per-channel statistics, and whether the
  latents are cast to the VAE's dtype before or after that arithmetic) follows each pipeline to the bit and stays
  in the family.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.base import Latents
from diffrl.models.batch_invariance import decode_rows
from diffrl.sampling import randn_per_sample


def latent_noise(generators: Sequence[torch.Generator], shape: Sequence[int], device) -> Latents:
    """The pipeline's noise `[B, *shape]` (one stream per sample) as the latent state, with no position ids: the
    transformer patchifies and positions the latents itself."""
    noise = randn_per_sample((len(generators), *shape), generators, device=device)
    return Latents(noise, torch.zeros(0, 1, device=device))


def decode_images(vae, latents: torch.Tensor, *, per_call: int | None) -> torch.Tensor:
    """Latents `[B, C, H/f, W/f]` (video: `[B, C, F', H/f, W/f]`), already un-normalized as the family's pipeline
    does → images `[B, 3, H, W]` (videos `[B, 3, F, H, W]`) in [0, 1]: decoded in the VAE's dtype (`decode_rows`;
    `per_call`: see there), `x/2 + 0.5` clamped."""
    vae_dtype = next(vae.parameters()).dtype
    images = decode_rows(lambda rows: vae.decode(rows.to(vae_dtype), return_dict=False)[0], latents, per_call=per_call)
    return (images.float() / 2 + 0.5).clamp(0, 1)
