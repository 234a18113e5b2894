"""Krea 2 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests (grouped-query
attention in the blocks, two fused text layers), `real()` (`Krea2Transformer2DModel`'s default configuration,
Krea 2's 12 B transformer, with the real VAE) for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.krea2 import Krea2Family
from diffrl.models.random_checkpoints import fill_normal_, qwen_vl
from diffrl.models.random_checkpoints.tokenizers import build_qwen_word_tokenizer

# Words of Krea 2's prompt template and of the tests' prompts (cased as the template writes them).
VOCABULARY = (  # noqa: SIM905 (a sentence of words reads better than a list)
    "system user assistant Describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background a an on in at to left right above below with one two three four "
    "circle circles square squares triangle triangles red green blue yellow purple orange black white cat cats "
    "dog dogs mat fox snow blurry ugly low quality picture photo very long prompt about").split()


def build_template_tokenizer():
    """Splits Krea 2's template into the 34 + 5 tokens the pipeline cuts at (see `build_qwen_word_tokenizer`)."""
    return build_qwen_word_tokenizer(VOCABULARY, (",", ".", ":", "'"), lowercase=False)


@dataclass
class Krea2Sizes:
    transformer: dict  # Krea2Transformer2DModel keywords (channels and text sizes are derived)
    text_hidden: int
    text_layers: int
    text_heads: int
    select_layers: tuple[int, ...]
    vae: dict  # AutoencoderKLQwenImage keywords
    max_sequence_length: int
    default_size: int


def tiny() -> Krea2Sizes:
    return Krea2Sizes(
        transformer={"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
                     "intermediate_size": 64, "timestep_embed_dim": 32, "text_num_attention_heads": 2,
                     "text_num_key_value_heads": 2, "text_intermediate_size": 64, "num_layerwise_text_blocks": 1,
                     "num_refiner_text_blocks": 1, "axes_dims_rope": (4, 6, 6)},
        text_hidden=32, text_layers=4, text_heads=2, select_layers=(2, 4),
        vae={"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2], "num_res_blocks": 1, "temperal_downsample": [False]},
        max_sequence_length=24, default_size=32)


def real() -> Krea2Sizes:
    """The transformer and VAE at the diffusers classes' defaults; a text encoder of Qwen3-VL-4B's width (2,560)
    with 12 layers, one per fused tap. 1024² and 512 text tokens, as the pipeline."""
    return Krea2Sizes(transformer={}, text_hidden=2560, text_layers=12, text_heads=20,
                      select_layers=tuple(range(1, 13)), vae={}, max_sequence_length=512, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: Krea2Sizes | None = None, *, seed: int = 0,
                           is_distilled: bool = False, device: str | torch.device = "cpu",
                           dtype: torch.dtype = torch.float32) -> Path:
    """A Krea 2 checkpoint in diffusers layout with random weights (default sizes: `tiny()`): random latent
    statistics, modulation tables and norm scales (zeros at init) so that every one of them is exercised; the
    scheduler is Krea 2's (dynamic shift). Built on `device`, stored in `dtype`."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        Krea2Transformer2DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLModel

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_template_tokenizer()
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config={**qwen_vl.text_config(len(tokenizer), sizes.text_hidden, sizes.text_layers, sizes.text_heads),
                         "head_dim": sizes.text_hidden // sizes.text_heads, **qwen_vl.special_token_ids(tokenizer)},
            vision_config=qwen_vl.vision_config(sizes.text_hidden, deepstack_visual_indexes=[0])))
        z_dim = sizes.vae.get("z_dim", 16)
        generator = torch.Generator().manual_seed(seed)
        # Drawn on the CPU (the generator's device) whatever `device` builds the modules.
        latents_mean = (0.5 * torch.randn(z_dim, generator=generator, device="cpu")).tolist()
        latents_std = (0.5 + 1.5 * torch.rand(z_dim, generator=generator, device="cpu")).tolist()
        vae = AutoencoderKLQwenImage(latents_mean=latents_mean, latents_std=latents_std, **sizes.vae)
        transformer = Krea2Transformer2DModel(in_channels=4 * z_dim, text_hidden_dim=sizes.text_hidden,
                                              num_text_layers=len(sizes.select_layers), **sizes.transformer)
        with torch.no_grad():  # at init the tables and norm scales are zeros; the text's effect is then faint
            for name, p in transformer.named_parameters():
                if name.endswith("scale_shift_table"):
                    fill_normal_(p, 1.0, generator)
                elif "norm" in name:
                    fill_normal_(p, 0.1, generator)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    # Krea 2's scheduler settings (Krea2Pipeline's docstring).
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400,
                                    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "Krea2Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen3VLModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Krea2Transformer2DModel"],
        "text_encoder_select_layers": list(sizes.select_layers), "is_distilled": is_distilled, "patch_size": 2,
        "diffrl": {"family": Krea2Family.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
