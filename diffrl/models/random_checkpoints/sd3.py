"""Stable Diffusion 3 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests,
`real()` (SD3.5-Medium's transformer and VAE, 2.24 B; `real("large")`: SD3.5-Large's, 8.06 B) for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.random_checkpoints.tokenizers import build_word_tokenizer
from diffrl.models.sd3 import CLIP_TOKENS

T5_WORDS = "a an the red blue green cat dog circle square of on".split()  # noqa: SIM905


def build_clip_tokenizer(path: Path):
    """A CLIP BPE tokenizer over lowercase letters (no merges), written to `path` and loaded from it."""
    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for code in range(97, 123):
        vocab[chr(code)] = len(vocab)
        vocab[chr(code) + "</w>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=CLIP_TOKENS)


@dataclass
class SD3Sizes:
    transformer: dict  # SD3Transformer2DModel keywords (the pooled width is derived)
    clip_widths: tuple[int, int]
    clip_layers: tuple[int, int]
    t5: dict  # T5Config keywords (d_model is the transformer's joint_attention_dim)
    vae: dict  # AutoencoderKL keywords


def tiny() -> SD3Sizes:
    return SD3Sizes(
        transformer={"sample_size": 16, "patch_size": 2, "in_channels": 4, "out_channels": 4, "num_layers": 2,
                     "attention_head_dim": 8, "num_attention_heads": 2, "joint_attention_dim": 32,
                     "caption_projection_dim": 16, "pos_embed_max_size": 32},
        clip_widths=(8, 16), clip_layers=(2, 3), t5={"d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 2},
        vae={"down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2,
             "block_out_channels": (8, 16), "latent_channels": 4, "norm_num_groups": 4})


# SD3.5-Large's transformer beside Medium's: 38 blocks of width 2432 (38 heads of 64), QK RMSNorm, no dual-attention
# (MMDiT-X) layers, a 192-patch position table.
LARGE_TRANSFORMER = {"num_layers": 38, "num_attention_heads": 38, "caption_projection_dim": 2432,
                     "pos_embed_max_size": 192, "dual_attention_layers": ()}


def real(model: str = "medium") -> SD3Sizes:
    """SD3.5-Medium: 24 MMDiT blocks of width 1536, dual attention in the first 13, QK RMSNorm; `model="large"`:
    SD3.5-Large (`LARGE_TRANSFORMER`). Shallow CLIPs and T5 of the real widths."""
    if model not in ("medium", "large"):
        raise ValueError(f"unknown SD3.5 size {model!r}; expected 'medium' or 'large'")
    return SD3Sizes(
        transformer={"sample_size": 128, "patch_size": 2, "in_channels": 16, "out_channels": 16, "num_layers": 24,
                     "attention_head_dim": 64, "num_attention_heads": 24, "joint_attention_dim": 4096,
                     "caption_projection_dim": 1536, "pos_embed_max_size": 384,
                     "dual_attention_layers": tuple(range(13)), "qk_norm": "rms_norm",
                     **(LARGE_TRANSFORMER if model == "large" else {})},
        clip_widths=(768, 1280), clip_layers=(2, 2),
        t5={"d_kv": 64, "d_ff": 2 * 4096, "num_layers": 1, "num_heads": 64},
        vae={"down_block_types": ("DownEncoderBlock2D",) * 4, "up_block_types": ("UpDecoderBlock2D",) * 4,
             "block_out_channels": (128, 256, 512, 512), "layers_per_block": 2, "latent_channels": 16,
             "norm_num_groups": 32, "use_quant_conv": False, "use_post_quant_conv": False})


def save_random_checkpoint(path: str | Path, sizes: SD3Sizes | None = None, *, seed: int = 0, with_t5: bool = True,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """An SD3 checkpoint in diffusers layout with random weights (default sizes: `tiny()`) and tokenizers made in
    code, built on `device` and stored in `dtype`; `with_t5=False` leaves T5 out, as diffusers allows."""
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
    )
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        T5Config,
        T5EncoderModel,
    )

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    width = sizes.transformer["joint_attention_dim"]

    def save(module, folder: str) -> None:
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)

    with torch.device(device):
        for index, (encoder_dir, tokenizer_dir) in enumerate(
                zip(("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"))):
            tokenizer = build_clip_tokenizer(path / tokenizer_dir)
            tokenizer.save_pretrained(path / tokenizer_dir)
            hidden = sizes.clip_widths[index]
            save(CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=sizes.clip_layers[index], num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
                projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)), encoder_dir)
        if with_t5:
            t5_tokenizer = build_word_tokenizer(T5_WORDS, 256)
            t5_tokenizer.save_pretrained(path / "tokenizer_3")
            save(T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=width, decoder_start_token_id=0,
                                         pad_token_id=0, **sizes.t5)), "text_encoder_3")
        save(SD3Transformer2DModel(pooled_projection_dim=sum(sizes.clip_widths), **sizes.transformer), "transformer")
        save(AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=1.5305, shift_factor=0.0609, **sizes.vae),
             "vae")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(path / "scheduler")
    # What StableDiffusion3Pipeline.from_pretrained reads first. Without T5 the pipeline is opened as diffusers
    # documents it: text_encoder_3 and tokenizer_3 are listed as absent ([null, null]).
    clip_tokenizer = ["transformers", type(tokenizer).__name__]
    index = {"_class_name": "StableDiffusion3Pipeline",
             "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKL"],
             "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
             "text_encoder": ["transformers", "CLIPTextModelWithProjection"], "tokenizer": clip_tokenizer,
             "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "tokenizer_2": clip_tokenizer,
             "image_encoder": [None, None], "feature_extractor": [None, None],
             "text_encoder_3": [None, None], "tokenizer_3": [None, None]}
    if with_t5:
        index.update(text_encoder_3=["transformers", "T5EncoderModel"],
                     tokenizer_3=["transformers", type(t5_tokenizer).__name__])
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
