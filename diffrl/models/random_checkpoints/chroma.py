"""Chroma checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()` (Chroma's
published transformer shape, 8.9 B, and FLUX.1's VAE, with a shallow T5 of the real width) for benchmarks. The T5
and VAE sizes are FLUX.1's (`random_checkpoints.flux1`): Chroma keeps both."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.chroma import ChromaFamily
from diffrl.models.random_checkpoints import flux1
from diffrl.models.random_checkpoints.tokenizers import build_word_tokenizer


@dataclass
class ChromaSizes:
    transformer: dict  # ChromaTransformer2DModel keywords (channels and the text width are derived)
    t5: dict  # T5Config keywords (d_model is the transformer's joint_attention_dim)
    vae: dict  # AutoencoderKL keywords
    max_sequence_length: int
    default_size: int


def tiny() -> ChromaSizes:
    flux = flux1.tiny()
    return ChromaSizes(
        transformer={"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                     "joint_attention_dim": 32, "axes_dims_rope": (4, 6, 6), "approximator_num_channels": 16,
                     "approximator_hidden_dim": 32, "approximator_layers": 2},
        t5=flux.t5, vae=flux.vae, max_sequence_length=16, default_size=32)


def real() -> ChromaSizes:
    """Chroma1-HD: FLUX.1 [schnell]'s 19 double and 38 single blocks of width 3072 (24 heads of 128) with the
    modulation MLP of 5 layers of 5,120 (diffusers' defaults), T5-XXL's width 4096 (shallow), FLUX.1's VAE; 1024²
    and 512 T5 tokens, as the pipeline's defaults."""
    flux = flux1.real()
    return ChromaSizes(
        transformer={"num_layers": 19, "num_single_layers": 38, "attention_head_dim": 128, "num_attention_heads": 24,
                     "joint_attention_dim": 4096, "axes_dims_rope": (16, 56, 56)},
        t5=flux.t5, vae=flux.vae, max_sequence_length=512, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: ChromaSizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Chroma checkpoint in diffusers layout with random weights (default sizes: `tiny()`), its T5 tokenizer made
    in code, FLUX.1 [dev]'s resolution-dependent scheduler. Built on `device`, stored in `dtype`."""
    from diffusers import AutoencoderKL, ChromaTransformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import T5Config, T5EncoderModel

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(flux1.T5_WORDS, 512)
    tokenizer.save_pretrained(path / "tokenizer")
    latent_channels = sizes.vae["latent_channels"]
    with torch.device(device):  # build where it is fast
        modules = {
            "text_encoder": T5EncoderModel(T5Config(vocab_size=len(tokenizer), d_model=sizes.transformer[
                "joint_attention_dim"], decoder_start_token_id=0, pad_token_id=0, **sizes.t5)),
            "transformer": ChromaTransformer2DModel(in_channels=4 * latent_channels, **sizes.transformer),
            "vae": AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=0.3611, shift_factor=0.1159,
                                 **sizes.vae),
        }
    for folder, module in modules.items():
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                    base_image_seq_len=256, max_image_seq_len=4096).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "ChromaPipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "T5EncoderModel"], "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "ChromaTransformer2DModel"],
        "image_encoder": [None, None], "feature_extractor": [None, None],
        "diffrl": {"family": ChromaFamily.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
