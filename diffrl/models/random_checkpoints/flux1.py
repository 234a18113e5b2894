"""FLUX.1 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()` (FLUX.1
[dev]'s published transformer and VAE, 11.9 B, with shallow CLIP-L and T5 of the real widths) for benchmarks.
`guidance_embeds=False` with a static-shift scheduler makes the [schnell] variant; `kontext=True` the image-conditioned
FLUX.1 Kontext (the same components, its pipeline named in model_index.json)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.flux1 import CLIP_TOKENS, Flux1Family
from diffrl.models.random_checkpoints.sd3 import build_clip_tokenizer
from diffrl.models.random_checkpoints.tokenizers import build_word_tokenizer

T5_WORDS = "a an the red blue green cat dog circle square of on mat blurry ugly".split()  # noqa: SIM905


@dataclass
class Flux1Sizes:
    transformer: dict  # FluxTransformer2DModel keywords (channels and text widths are derived)
    clip_width: int
    clip_layers: int
    t5: dict  # T5Config keywords (d_model is the transformer's joint_attention_dim)
    vae: dict  # AutoencoderKL keywords
    max_sequence_length: int
    default_size: int


def tiny() -> Flux1Sizes:
    return Flux1Sizes(
        transformer={"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                     "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6)},
        clip_width=16, clip_layers=2, t5={"d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 2},
        vae={"down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
             "block_out_channels": (8, 16), "latent_channels": 4, "norm_num_groups": 4},
        max_sequence_length=16, default_size=32)


def real() -> Flux1Sizes:
    """FLUX.1 [dev]: 19 double and 38 single blocks of width 3072 (24 heads of 128), T5-XXL's width 4096 for the
    text, CLIP-L's 768 pooled, the 16-channel VAE; CLIP-L and T5 shallow (2 and 1 layers) at their real widths.
    1024² and 512 T5 tokens, as the pipeline's defaults."""
    return Flux1Sizes(
        transformer={"num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
                     "joint_attention_dim": 4096, "axes_dims_rope": (16, 56, 56)},
        clip_width=768, clip_layers=2, t5={"d_kv": 64, "d_ff": 10240, "num_layers": 1, "num_heads": 64},
        vae={"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
             "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "latent_channels": 16,
             "norm_num_groups": 32, "use_quant_conv": False, "use_post_quant_conv": False},
        max_sequence_length=512, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: Flux1Sizes | None = None, *, seed: int = 0,
                           guidance_embeds: bool = True, kontext: bool = False, device: str | torch.device = "cpu",
                           dtype: torch.dtype = torch.float32) -> Path:
    """A FLUX.1 checkpoint in diffusers layout with random weights (default sizes: `tiny()`), tokenizers made in
    code. `guidance_embeds=False`: the [schnell] layout (no guidance embedding, static shift 1). Built on
    `device`, stored in `dtype`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    width = sizes.transformer["joint_attention_dim"]
    clip_tokenizer = build_clip_tokenizer(path / "tokenizer")
    clip_tokenizer.save_pretrained(path / "tokenizer")
    t5_tokenizer = build_word_tokenizer(T5_WORDS, 512)
    t5_tokenizer.save_pretrained(path / "tokenizer_2")
    latent_channels = sizes.vae["latent_channels"]
    with torch.device(device):  # build where it is fast
        modules = {
            "text_encoder": CLIPTextModel(CLIPTextConfig(
                vocab_size=len(clip_tokenizer), hidden_size=sizes.clip_width, intermediate_size=2 * sizes.clip_width,
                num_hidden_layers=sizes.clip_layers, num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
                bos_token_id=0, eos_token_id=1, pad_token_id=1)),
            "text_encoder_2": T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=width,
                                                      decoder_start_token_id=0, pad_token_id=0, **sizes.t5)),
            "transformer": FluxTransformer2DModel(in_channels=4 * latent_channels,
                                                  pooled_projection_dim=sizes.clip_width,
                                                  guidance_embeds=guidance_embeds, **sizes.transformer),
            "vae": AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=0.3611, shift_factor=0.1159,
                                 **sizes.vae),
        }
    for folder, module in modules.items():
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    if guidance_embeds:  # FLUX.1 [dev]'s scheduler: a resolution-dependent shift
        scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
    else:  # FLUX.1 [schnell]'s: no shift
        scheduler = FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=False)
    scheduler.save_pretrained(path / "scheduler")
    index = {
        "_class_name": "FluxKontextPipeline" if kontext else "FluxPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", type(clip_tokenizer).__name__],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer_2": ["transformers", type(t5_tokenizer).__name__],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "image_encoder": [None, None], "feature_extractor": [None, None],
        "diffrl": {"family": Flux1Family.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
