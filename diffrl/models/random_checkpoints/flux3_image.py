"""FLUX 3 Image Klein checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests,
`real()` (`Flux3Transformer2DModel`'s default configuration, 5.5 B parameters, with the real VAE) for
benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.flux3_image import DEFAULT_SHIFT, Flux3ImageFamily
from diffrl.models.random_checkpoints import qwen_vl
from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer


@dataclass
class Flux3Sizes:
    transformer: dict  # Flux3Transformer2DModel keywords (channels and text width are derived)
    text_hidden: int
    text_layers: int
    text_encoder_out_layers: tuple[int, ...]
    text_heads: int
    vae: dict  # AutoencoderKLFlux2 keywords
    default_size: int


def tiny() -> Flux3Sizes:
    return Flux3Sizes(
        transformer={"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                     "timestep_channels": 32, "axes_dims_rope": (4, 4, 4, 4)},
        text_hidden=32, text_layers=4, text_encoder_out_layers=(2, 4), text_heads=2,
        vae={"block_out_channels": (16, 16), "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 8,
             "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2},
        default_size=32)


def real() -> Flux3Sizes:
    """The transformer and VAE at the diffusers classes' defaults (20,480-wide text input = 8 stacked layers of a
    2,560-wide encoder). The text encoder keeps that width but only 8 layers. 1024² by default, as the family
    rolls out."""
    return Flux3Sizes(transformer={}, text_hidden=2560, text_layers=8, text_encoder_out_layers=tuple(range(1, 9)),
                      text_heads=20, vae={}, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: Flux3Sizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A FLUX 3 checkpoint in diffusers layout with random weights (default sizes: `tiny()`), including random
    latent BatchNorm statistics so that decoding exercises them; built on `device`, stored in `dtype`."""
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer()
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config={**qwen_vl.text_config(len(tokenizer), sizes.text_hidden, sizes.text_layers, sizes.text_heads),
                         "head_dim": sizes.text_hidden // sizes.text_heads},
            vision_config=qwen_vl.vision_config(sizes.text_hidden, deepstack_visual_indexes=[0])))
        vae = AutoencoderKLFlux2(**sizes.vae)
        with torch.no_grad():
            vae.bn.running_mean.normal_(0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
        channels = 4 * vae.config.latent_channels
        transformer = Flux3Transformer2DModel(
            in_channels=channels, cond_in_channels=channels,
            joint_attention_dim=sizes.text_hidden * len(sizes.text_encoder_out_layers), **sizes.transformer)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    (path / "scheduler").mkdir(parents=True, exist_ok=True)
    (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": DEFAULT_SHIFT}))
    index = {
        "_class_name": "Flux3ModularPipeline",
        "transformer": ["diffusers", "Flux3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "diffrl": {"family": Flux3ImageFamily.name, "text_encoder_out_layers": list(sizes.text_encoder_out_layers),
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
