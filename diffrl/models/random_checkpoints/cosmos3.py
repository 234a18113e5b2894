"""Cosmos3 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests (a two-layer
transformer, a Wan VAE of a few channels: 4× in time, 8× in space), `real()` for benchmarks
(`Cosmos3OmniTransformer`'s defaults: 15 B parameters, about Cosmos3-Nano's announced 16 B; a Wan2.2-style VAE:
48 channels, 16× in space). The tokenizer is the random checkpoints' character-level chat tokenizer plus the
`<|vision_start|>` token the pipeline ends a prompt with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer
from diffrl.models.random_checkpoints.wan2_2 import flow_scheduler


def build_tokenizer():
    """The chat tokenizer of the random checkpoints, plus the token the pipeline ends a prompt with."""
    tokenizer = build_chat_tokenizer()
    tokenizer.add_tokens(["<|vision_start|>"], special_tokens=True)
    return tokenizer


@dataclass
class Cosmos3Sizes:
    transformer: dict  # Cosmos3OmniTransformer keywords
    vae: dict  # AutoencoderKLWan keywords (the latent statistics are drawn)


def tiny() -> Cosmos3Sizes:
    """About 54 k parameters: 8 × 8 pixels are one latent pixel, 16 × 16 one patch token."""
    transformer = {"vocab_size": len(build_tokenizer()), "hidden_size": 32, "head_dim": 16,
                   "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
                   "num_hidden_layers": 2, "latent_channel": 4, "latent_patch_size": 2, "patch_latent_dim": 16,
                   "rope_axes_dim": [4, 2, 2]}
    vae = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
           "temperal_downsample": [False, True, True]}
    return Cosmos3Sizes(transformer, vae)


def real() -> Cosmos3Sizes:
    """`Cosmos3OmniTransformer`'s defaults and a VAE of Wan2.2's shape (patch 2, 16× in space, 48 channels)."""
    vae = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
           "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4}
    return Cosmos3Sizes({}, vae)


def save_random_checkpoint(path: str | Path, sizes: Cosmos3Sizes | None = None, *, seed: int = 0,
                           scheduler: str = "euler", shift: float = 3.0, native_flow_schedule: bool = False,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Cosmos3 checkpoint written by `Cosmos3OmniPipeline.save_pretrained` (default sizes: `tiny()`), with random
    latent statistics so that decoding exercises them. `scheduler`: "euler" (FlowMatchEulerDiscreteScheduler,
    which our Euler steps reproduce exactly) or "unipc" (the published kind, flow σ's)."""
    from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    sizes = sizes or tiny()
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    z_dim = sizes.vae.get("z_dim", 16)
    generator = torch.Generator().manual_seed(seed)
    latents_mean = (0.3 * torch.randn(z_dim, generator=generator)).tolist()
    latents_std = (0.5 + torch.rand(z_dim, generator=generator)).tolist()

    def stored(module):  # fp32 as built; another dtype cast as a whole
        return module if dtype == torch.float32 else module.to(dtype)

    with torch.device(device):
        transformer = stored(Cosmos3OmniTransformer(**sizes.transformer))
        vae = stored(AutoencoderKLWan(latents_mean=latents_mean, latents_std=latents_std, **sizes.vae))
    sched = flow_scheduler(scheduler, shift)
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=sched,
                               enable_safety_checker=False, use_native_flow_schedule=native_flow_schedule)
    pipe.save_pretrained(path, safe_serialization=True)
    return Path(path)
