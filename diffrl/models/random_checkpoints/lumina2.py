"""Lumina-Image 2.0 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()`
(Lumina-Image 2.0's published transformer shape, 2.6 B, FLUX.1's 16-channel VAE, and a shallow Gemma2 of
Gemma-2-2B's width) for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.lumina2 import SYSTEM_PROMPT, Lumina2Family
from diffrl.models.random_checkpoints import flux1

BOS, EOS, PAD, UNK = "<bos>", "<eos>", "<pad>", "<unk>"
# The system prompt's words (so that it reaches the text encoder as distinct tokens) and a few prompt words.
WORDS = tuple(dict.fromkeys(
    [w.lower() for w in SYSTEM_PROMPT.replace("-", " - ").replace(".", " . ").split()]
    + ["<", ">", "prompt", "start", *flux1.T5_WORDS]))


@dataclass
class Lumina2Sizes:
    transformer: dict  # Lumina2Transformer2DModel keywords (channels and the text width are derived)
    text_hidden: int  # Gemma2: the transformer's cap_feat_dim
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_head_dim: int
    text_intermediate: int
    vae: dict  # AutoencoderKL keywords
    max_sequence_length: int


def tiny() -> Lumina2Sizes:
    return Lumina2Sizes(
        transformer={"hidden_size": 32, "num_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 2,
                     "num_kv_heads": 1, "multiple_of": 16, "axes_dim_rope": (4, 6, 6), "axes_lens": (64, 32, 32),
                     "sample_size": 4},
        text_hidden=32, text_layers=2, text_heads=2, text_kv_heads=1, text_head_dim=16, text_intermediate=64,
        vae=flux1.tiny().vae, max_sequence_length=48)


def real() -> Lumina2Sizes:
    """Lumina-Image 2.0: 26 blocks and 2 + 2 refiners of width 2304 (24 heads, 8 KV heads), 2304-wide text (the
    class defaults but the text width); FLUX.1's VAE; a 2-layer Gemma2 of Gemma-2-2B's width (2304, 8 heads of 256,
    4 KV heads, MLP 9216; 26 layers in the real one). 1024² and 256 Gemma tokens, as the pipeline's defaults."""
    return Lumina2Sizes(
        transformer={}, text_hidden=2304, text_layers=2, text_heads=8, text_kv_heads=4, text_head_dim=256,
        text_intermediate=9216, vae=flux1.real().vae, max_sequence_length=256)


def build_gemma_word_tokenizer(words, max_length: int):
    """A word-level tokenizer in the Gemma tokenizer's format, made in code: `<bos>` first and no end token, as
    Gemma's own; lowercase, split on whitespace and punctuation, unknown words → `<unk>`."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {PAD: 0, EOS: 1, BOS: 2, UNK: 3}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token=UNK))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, unk_token=UNK, eos_token=EOS, bos_token=BOS,
                                   model_max_length=max_length, padding_side="left")


def save_random_checkpoint(path: str | Path, sizes: Lumina2Sizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Lumina-Image 2.0 checkpoint in diffusers layout with random weights (default sizes: `tiny()`), a Gemma-style
    tokenizer made in code (padding on the left, which the family turns to the right as the pipeline does) and a
    statically shifted scheduler (shift 6; the family takes whatever the checkpoint's scheduler says). Built on
    `device`, stored in `dtype`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, Lumina2Transformer2DModel
    from transformers import Gemma2Config, Gemma2Model

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_gemma_word_tokenizer(WORDS, 8192)
    latent_channels = sizes.vae["latent_channels"]
    with torch.device(device):  # build where it is fast
        modules = {
            "text_encoder": Gemma2Model(Gemma2Config(
                vocab_size=len(tokenizer), hidden_size=sizes.text_hidden, intermediate_size=sizes.text_intermediate,
                num_hidden_layers=sizes.text_layers, num_attention_heads=sizes.text_heads,
                num_key_value_heads=sizes.text_kv_heads, head_dim=sizes.text_head_dim, pad_token_id=0,
                eos_token_id=1, bos_token_id=2)),
            "transformer": Lumina2Transformer2DModel(in_channels=latent_channels, cap_feat_dim=sizes.text_hidden,
                                                     **sizes.transformer),
            "vae": AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=0.3611, shift_factor=0.1159,
                                 **sizes.vae),
        }
    for folder, module in modules.items():
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=6.0).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "Lumina2Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "Gemma2Model"], "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "Lumina2Transformer2DModel"],
        "diffrl": {"family": Lumina2Family.name, "max_sequence_length": sizes.max_sequence_length},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
