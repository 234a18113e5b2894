"""CogView4 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()`
(CogView4-6B's transformer, 6.4 B, a 16-channel VAE, and a shallow GLM-4 of the real width) for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.cogview4 import CogView4Family
from diffrl.models.random_checkpoints import flux1

GLM_WORDS = flux1.T5_WORDS
GLM_PAD = "<|endoftext|>"
GLM_PREFIX = ("[gMASK]", "<sop>")  # what GLM-4's tokenizer puts before every text


@dataclass
class CogView4Sizes:
    transformer: dict  # CogView4Transformer2DModel keywords (channels and the text width are derived)
    glm: dict  # GlmConfig keywords (hidden_size is the transformer's text_embed_dim)
    vae: dict  # AutoencoderKL keywords
    max_sequence_length: int
    default_size: int


def tiny() -> CogView4Sizes:
    return CogView4Sizes(
        transformer={"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "text_embed_dim": 32,
                     "time_embed_dim": 32, "condition_dim": 16, "pos_embed_max_size": 16, "sample_size": 16,
                     "rope_axes_dim": (16, 16)},
        # GLM's default init (std 0.02) gives hidden states so small that the transformer's text projection sees
        # mostly its bias and every prompt looks alike; std 0.3 gives states of std ~2 (a real GLM's are larger).
        glm={"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
             "intermediate_size": 64, "initializer_range": 0.3},
        vae=flux1.tiny().vae, max_sequence_length=64, default_size=32)


def real() -> CogView4Sizes:
    """CogView4-6B: 28 blocks of width 4096 (32 heads of 128), GLM-4-9B's width 4096 for the text (2 layers: the
    pipeline reads the second-to-last hidden state, so 2 is the fewest that runs a layer), a 16-channel VAE of
    FLUX.1's shape with the scaling factor 1 the pipeline divides by; 1024² and 1024 GLM tokens, as the pipeline's
    defaults."""
    return CogView4Sizes(
        transformer={"num_layers": 28, "attention_head_dim": 128, "num_attention_heads": 32, "text_embed_dim": 4096,
                     "time_embed_dim": 512, "condition_dim": 256, "pos_embed_max_size": 128, "sample_size": 128,
                     "rope_axes_dim": (256, 256)},
        glm={"num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128,
             "intermediate_size": 13696},
        vae=flux1.real().vae, max_sequence_length=1024, default_size=1024)


def build_glm_tokenizer(words=GLM_WORDS):
    """A word-level tokenizer in GLM-4's format, made in code: `[gMASK]<sop>` before the text, `<|endoftext|>` as
    padding, padded on the left (as GLM-4's tokenizer is, and as the pipeline pads to a multiple of 16)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {GLM_PAD: 0, "<unk>": 1, GLM_PREFIX[0]: 2, GLM_PREFIX[1]: 3}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{GLM_PREFIX[0]} {GLM_PREFIX[1]} $A", special_tokens=[(GLM_PREFIX[0], 2), (GLM_PREFIX[1], 3)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=GLM_PAD, unk_token="<unk>",
                                        eos_token=GLM_PAD, model_max_length=131072, padding_side="left")
    tokenizer.add_special_tokens({"additional_special_tokens": list(GLM_PREFIX)})
    return tokenizer


def save_random_checkpoint(path: str | Path, sizes: CogView4Sizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A CogView4 checkpoint in diffusers layout with random weights (default sizes: `tiny()`), its GLM tokenizer
    made in code, CogView4's scheduler (dynamic shift, linear in √tokens, `time_shift_type="linear"`). Built on
    `device`, stored in `dtype`."""
    from diffusers import AutoencoderKL, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler
    from transformers import GlmConfig, GlmModel

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_glm_tokenizer()
    tokenizer.save_pretrained(path / "tokenizer")
    latent_channels = sizes.vae["latent_channels"]
    text_width = sizes.transformer["text_embed_dim"]
    with torch.device(device):  # build where it is fast
        modules = {
            "text_encoder": GlmModel(GlmConfig(vocab_size=len(tokenizer), hidden_size=text_width,
                                               pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.pad_token_id,
                                               **sizes.glm)),
            "transformer": CogView4Transformer2DModel(in_channels=latent_channels, out_channels=latent_channels,
                                                      **sizes.transformer),
            "vae": AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=1.0, **sizes.vae),
        }
    for folder, module in modules.items():
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=1.0, use_dynamic_shifting=True, base_shift=0.25, max_shift=0.75,
                                    base_image_seq_len=256, max_image_seq_len=4096,
                                    time_shift_type="linear").save_pretrained(path / "scheduler")
    index = {
        "_class_name": "CogView4Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "GlmModel"], "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "CogView4Transformer2DModel"],
        "diffrl": {"family": CogView4Family.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
