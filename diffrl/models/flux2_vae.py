"""The latent side shared by the families built on diffusers' `AutoencoderKLFlux2` (flux2, flux3_image): noise
drawn on the grid of 2×2-patchified VAE channels and packed to tokens, (t, h, w, l) position ids for image and text
tokens, and the decode through the VAE's latent BatchNorm statistics and the unpatchify, in the pipelines' own
arithmetic (bit-equal on CPU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.base import PromptEmbeds
from diffrl.models.condition_rows import pack_image_rows, unpack_image_rows
from diffrl.models.vae_latents import decode_images
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
    return decode_images(vae, grid, per_call=per_call)


# ---------------------------------------------------------------- reference images (image-conditioned requests)
# FLUX.2 (Flux2Pipeline / Flux2KleinPipeline with `image`) and FLUX 3 (its modular pipeline with `image`) both
# VAE-encode each reference, patchify and BatchNorm-normalize it as the generated latents are, and pack it to tokens;
# they differ in how a reference is sized (`crop_reference`, `fill_reference`) and in its position ids (FLUX.2: time
# axis t = 10, 20, …; FLUX 3: l = -1, -2, …). The tokens travel inside the prompt's conditioning (`fold_references`),
# so the engine, the denoising env and the trainer carry them unchanged; each forward reads them back
# (`split_references`).
MAX_REFERENCE_IMAGES = 10  # diffrl's cap (the pipelines set none): every reference's tokens join every forward


def _pil(image: torch.Tensor):
    from PIL import Image

    return Image.fromarray(image.permute(1, 2, 0).contiguous().numpy())


def _tensor(pil) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(pil.convert("RGB")).copy()).permute(2, 0, 1)


def _lanczos_to_area(pil, area: int):
    """`Flux2ImageProcessor._resize_to_target_area`: the sides scaled by sqrt(area / pixels), truncated."""
    import math

    from PIL import Image

    scale = math.sqrt(area / (pil.width * pil.height))
    return pil.resize((int(pil.width * scale), int(pil.height * scale)), Image.Resampling.LANCZOS)


def downscale_to_area(image: torch.Tensor, max_area: int) -> torch.Tensor:
    """`uint8 [3, H, W]` above `max_area` pixels downscaled to that area (Lanczos, aspect kept, sides truncated);
    otherwise unchanged."""
    if image.shape[1] * image.shape[2] <= max_area:
        return image
    return _tensor(_lanczos_to_area(_pil(image), max_area))


def crop_reference(image: torch.Tensor, step: int, max_area: int = 1024 * 1024) -> torch.Tensor:
    """`uint8 [3, H, W]` sized as FLUX.2's pipelines size every reference (and FLUX 3's each of several): above
    `max_area` pixels downscaled to it (Lanczos), then center-cropped to multiples of `step` (one token's pixels)."""
    image = downscale_to_area(image, max_area)
    height, width = image.shape[1] // step * step, image.shape[2] // step * step
    if not height or not width:
        raise ValueError(f"a {image.shape[2]}x{image.shape[1]} condition image is smaller than one {step}x{step} token")
    top, left = (image.shape[1] - height) // 2, (image.shape[2] - width) // 2
    return image[:, top:top + height, left:left + width]


def fill_reference(image: torch.Tensor, step: int, max_area: int = 4 * 1024 * 1024, max_side: int = 4096,
                   min_side: int = 64) -> torch.Tensor:
    """`uint8 [3, H, W]` sized as FLUX 3's `Flux3ImageProcessor(resize_mode="fill")` sizes a single reference: kept
    whole, downscaled (Lanczos) until its canvas (its sides rounded up to multiples of `step`, clamped to
    [`min_side`, `max_side`]) fits `max_area` and `max_side`, then reflect-padded (centered) to the canvas."""
    import math

    import numpy as np
    from PIL import Image

    def canvas(height: int, width: int) -> tuple[int, int]:
        return tuple(min(max_side, max(min_side, -(-side // step) * step)) for side in (height, width))

    if min_side * min_side > max_area:  # no canvas would fit: the search below would never end
        raise ValueError(f"a reference area of {max_area} pixels is below the smallest canvas, {min_side}x{min_side}")
    src_h, src_w = image.shape[1:]
    scale = min(1.0, math.sqrt(max_area / (src_w * src_h)), max_side / max(src_h, src_w))
    while True:
        height, width = (max(1, round(side * scale)) for side in (src_h, src_w))
        canvas_h, canvas_w = canvas(height, width)
        if canvas_h * canvas_w <= max_area:
            break
        scale *= 0.995
    if (height, width) != (src_h, src_w):
        image = _tensor(_pil(image).resize((width, height), Image.Resampling.LANCZOS))
    if (height, width) == (canvas_h, canvas_w):
        return image
    top, left = (canvas_h - height) // 2, (canvas_w - width) // 2
    padding = ((top, canvas_h - height - top), (left, canvas_w - width - left), (0, 0))
    mode = "reflect" if min(height, width) > step else "symmetric"  # reflection excludes the edge pixel
    return torch.from_numpy(np.pad(image.permute(1, 2, 0).numpy(), padding, mode=mode)).permute(2, 0, 1)


@torch.no_grad()
def encode_reference(vae, image: torch.Tensor, device=None) -> torch.Tensor:
    """A sized reference `uint8 [3, H, W]` → its normalized latents `[1, 4C, H/s, W/s]` (s: one token's pixels): the
    VAE's mode, 2×2-patchified, normalized by the VAE's BatchNorm statistics, in the pipelines' arithmetic."""
    pixels = (image.float() / 255 * 2 - 1)[None]  # the image processor's arithmetic
    latents = vae.encode(pixels.to(device, next(vae.parameters()).dtype)).latent_dist.mode()
    batch, channels, height, width = latents.shape
    latents = latents.view(batch, channels, height // 2, 2, width // 2, 2).permute(0, 1, 3, 5, 2, 4)
    latents = latents.reshape(batch, channels * 4, height // 2, width // 2)
    bn = vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(latents.device, latents.dtype)
    return ((latents - mean) / std).float()


def reference_ids(height_tokens: int, width_tokens: int, t: float = 0.0, l: float = 0.0, rope_scale: float = 1.0,
                  device=None) -> torch.Tensor:
    """(t, h, w, l) of a reference's tokens: `image_position_ids` with the reference's own t (FLUX.2) or l (FLUX 3)."""
    ids = image_position_ids(height_tokens, width_tokens, rope_scale, device=device)
    ids[:, 0], ids[:, 3] = t, l
    return ids


def pack_references(latents: Sequence[torch.Tensor], ids: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each reference's latents `[1, C, h, w]` packed to tokens and concatenated: `[1, S, C]` and ids `[S, 4]`."""
    return torch.cat([x.flatten(2).transpose(1, 2) for x in latents], dim=1), torch.cat(list(ids))


def fold_references(cond, references: tuple[torch.Tensor, torch.Tensor]):
    """One prompt's conditioning with its references' tokens `[1, S, C]` laid row-major into rows of the text width
    after the text tokens (zero-padded), and their ids after the text's: one tensor carries both."""
    tokens, ids = references
    width = cond.embeds.shape[-1]
    rows = pack_image_rows(tokens.to(cond.embeds), width).expand(len(cond), -1, -1)
    if rows.shape[1] == len(ids):  # `split_references` tells the references apart by rows against ids
        raise ValueError(f"{len(ids)} reference tokens of {tokens.shape[-1]} channels fill as many rows of the "
                         f"{width}-wide text: they cannot travel in the conditioning")
    return PromptEmbeds(torch.cat([cond.embeds, rows], dim=1), torch.cat([cond.ids, ids.to(cond.ids)]))


def split_references(cond, channels: int, text_lengths: Sequence[int]):
    """(the text's conditioning, (reference tokens `[B, S, C]`, ids `[S, 4]`) or None) from a folded conditioning.
    The text length is the one of `text_lengths` (the family's possible windows, ascending) that the row and id
    counts agree on (decided from shapes alone: no read of a device tensor)."""
    rows, count, width = cond.embeds.shape[1], cond.ids.shape[0], cond.embeds.shape[-1]
    if rows == count:
        return cond, None
    for length in text_lengths:
        if length < count and length + -(-(count - length) * channels // width) == rows:
            break
    else:
        raise ValueError(f"a conditioning of {rows} rows and {count} ids holds no text window of this family")
    text = PromptEmbeds(cond.embeds[:, :length], cond.ids[:length])
    return text, (unpack_image_rows(cond.embeds[:, length:], count - length, channels), cond.ids[length:])
