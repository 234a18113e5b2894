"""Z-Image checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()`
(`ZImageTransformer2DModel`'s default configuration, Z-Image's published 6.15 B transformer, with the 16-channel
VAE and a shallow text encoder of Qwen3-4B's width) for benchmarks. `turbo=True` marks the few-step checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.random_checkpoints import fill_normal_
from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer
from diffrl.models.z_image import ZImageFamily


@dataclass
class ZImageSizes:
    transformer: dict  # ZImageTransformer2DModel keywords (channels and the text width are derived)
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    vae: dict  # AutoencoderKL keywords
    max_sequence_length: int
    default_size: int


def tiny() -> ZImageSizes:
    return ZImageSizes(
        transformer={"dim": 32, "n_layers": 2, "n_refiner_layers": 1, "n_heads": 2, "n_kv_heads": 2,
                     "axes_dims": [4, 6, 6], "axes_lens": [128, 128, 128]},
        text_hidden=32, text_layers=3, text_heads=2, text_kv_heads=1,
        vae={"down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
             "block_out_channels": (8, 16), "latent_channels": 4, "norm_num_groups": 4},
        max_sequence_length=64, default_size=32)


def real() -> ZImageSizes:
    """The transformer at the class defaults (30 blocks and 2 + 2 refiners of width 3840, 30 heads, 2560-wide text:
    6.15 B); the FLUX-style 16-channel VAE; a 2-layer text encoder of Qwen3-4B's width (2560, 32 heads, 8 KV heads).
    1024² and 512 text tokens, as the pipeline."""
    return ZImageSizes(
        transformer={}, text_hidden=2560, text_layers=2, text_heads=32, text_kv_heads=8,
        vae={"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
             "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "latent_channels": 16,
             "norm_num_groups": 32, "use_quant_conv": False, "use_post_quant_conv": False},
        max_sequence_length=512, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: ZImageSizes | None = None, *, seed: int = 0, turbo: bool = False,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Z-Image checkpoint in diffusers layout with random weights (default sizes: `tiny()`) and a chat tokenizer
    made in code; the transformer's pad tokens and norm scales are drawn at random so that each is exercised.
    `turbo`: marked as the few-step checkpoint. Built on `device`, stored in `dtype`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer()
    latent_channels = sizes.vae["latent_channels"]
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen3Model(Qwen3Config(
            vocab_size=len(tokenizer), hidden_size=sizes.text_hidden, intermediate_size=2 * sizes.text_hidden,
            num_hidden_layers=sizes.text_layers, num_attention_heads=sizes.text_heads,
            num_key_value_heads=sizes.text_kv_heads, head_dim=sizes.text_hidden // sizes.text_heads,
            max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id))
        transformer = ZImageTransformer2DModel(in_channels=latent_channels, cap_feat_dim=sizes.text_hidden,
                                               **sizes.transformer)
        vae = AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=0.3611, shift_factor=0.1159, **sizes.vae)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():  # zeros at init: the pad tokens would all look alike
            for name, p in transformer.named_parameters():
                if name.endswith("pad_token"):
                    fill_normal_(p, 1.0, generator)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False,
                                    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "ZImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "Qwen3Model"], "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "ZImageTransformer2DModel"],
        "diffrl": {"family": ZImageFamily.name, "turbo": turbo, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
