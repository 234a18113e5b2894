"""SANA checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()` (SANA
1600M's transformer, `SanaTransformer2DModel`'s defaults, and the f32c32 DC-AE, with a shallow Gemma-2 of the real
width) for benchmarks. The tokenizer is word-level, made in code, with Gemma's special tokens (BOS prepended, no
EOS), and knows the words of the pipeline's default complex human instruction so that its tokens are not all
unknown."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.random_checkpoints.flux1 import T5_WORDS
from diffrl.models.sana import SanaFamily, pipeline_default_instruction

# Gemma's special tokens and their ids.
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")


@dataclass
class SanaSizes:
    transformer: dict  # SanaTransformer2DModel keywords (the channels and the text width are derived)
    gemma: dict  # Gemma2Config keywords (hidden_size is the transformer's caption_channels)
    vae: dict  # AutoencoderDC keywords
    max_sequence_length: int
    default_size: int


def tiny() -> SanaSizes:
    return SanaSizes(
        transformer={"num_attention_heads": 2, "attention_head_dim": 8, "num_layers": 2, "num_cross_attention_heads": 2,
                     "cross_attention_head_dim": 8, "cross_attention_dim": 16, "caption_channels": 32},
        gemma={"intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
               "head_dim": 16, "sliding_window": 64, "query_pre_attn_scalar": 16},
        vae={"latent_channels": 8, "attention_head_dim": 8,
             "encoder_block_types": ("ResBlock", "ResBlock", "EfficientViTBlock"),
             "decoder_block_types": ("ResBlock", "ResBlock", "EfficientViTBlock"),
             "encoder_block_out_channels": (8, 16, 16), "decoder_block_out_channels": (8, 16, 16),
             "encoder_layers_per_block": (1, 1, 1), "decoder_layers_per_block": (1, 1, 1),
             "encoder_qkv_multiscales": ((), (), (5,)), "decoder_qkv_multiscales": ((), (), (5,)),
             "upsample_block_type": "interpolate", "downsample_block_type": "Conv",
             "decoder_norm_types": ("batch_norm", "batch_norm", "rms_norm"),
             "decoder_act_fns": ("relu", "relu", "silu"),
             "scaling_factor": 0.41407},
        max_sequence_length=16, default_size=32)


def real() -> SanaSizes:
    """SANA 1600M 1024px: 20 blocks of width 2240 (70 linear-attention heads of 32, cross-attention 20 × 112,
    `SanaTransformer2DModel`'s defaults); DC-AE f32c32 (6 stages, 32 latent channels); a 2-layer Gemma-2 of Gemma-2
    2B's width (2304, 8 heads of 256, 4 KV heads, MLP 9216). 1024² and 300 prompt tokens, as the pipeline."""
    return SanaSizes(
        transformer={},
        gemma={"intermediate_size": 9216, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 256, "sliding_window": 4096, "query_pre_attn_scalar": 256},
        vae={"latent_channels": 32, "attention_head_dim": 32,
             "encoder_block_types": ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
             "decoder_block_types": ("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
             "encoder_block_out_channels": (128, 256, 512, 512, 1024, 1024),
             "decoder_block_out_channels": (128, 256, 512, 512, 1024, 1024),
             "encoder_layers_per_block": (2, 2, 2, 3, 3, 3), "decoder_layers_per_block": (3, 3, 3, 3, 3, 3),
             "encoder_qkv_multiscales": ((), (), (), (5,), (5,), (5,)),
             "decoder_qkv_multiscales": ((), (), (), (5,), (5,), (5,)),
             "upsample_block_type": "interpolate", "downsample_block_type": "Conv",
             "decoder_norm_types": ("batch_norm",) * 3 + ("rms_norm",) * 3,
             "decoder_act_fns": ("relu",) * 3 + ("silu",) * 3, "scaling_factor": 0.41407},
        max_sequence_length=300, default_size=1024)


def build_gemma_word_tokenizer(words):
    """A word-level tokenizer with Gemma's special tokens: `<bos>` prepended, no EOS, `<pad>` id 0, unknown words
    `<unk>`; words and punctuation split as `Whitespace` does, case kept (Gemma's is cased)."""
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(GEMMA_SPECIALS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                   unk_token="<unk>", model_max_length=8192)


def save_random_checkpoint(path: str | Path, sizes: SanaSizes | None = None, *, seed: int = 0,
                           scheduler: str = "euler", device: str | torch.device = "cpu",
                           dtype: torch.dtype = torch.float32) -> Path:
    """A SANA checkpoint in diffusers layout with random weights (default sizes: `tiny()`) and its tokenizer made in
    code. `scheduler`: "euler" (FlowMatchEulerDiscreteScheduler, shift 3) or "dpm" (the published checkpoints'
    DPM-Solver++ on flow σ's, shift 3). Built on `device`, stored in `dtype`."""
    from diffusers import (
        AutoencoderDC,
        DPMSolverMultistepScheduler,
        FlowMatchEulerDiscreteScheduler,
        SanaTransformer2DModel,
    )
    from transformers import Gemma2Config, Gemma2Model

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    words = [*T5_WORDS, *re.findall(r"\w+|[^\w\s]+", "\n".join(pipeline_default_instruction()))]
    tokenizer = build_gemma_word_tokenizer(words)
    tokenizer.save_pretrained(path / "tokenizer")
    width = sizes.transformer.get("caption_channels", 2304)
    latent_channels = sizes.vae["latent_channels"]
    with torch.device(device):  # build where it is fast
        modules = {
            "text_encoder": Gemma2Model(Gemma2Config(vocab_size=len(tokenizer), hidden_size=width, pad_token_id=0,
                                                     eos_token_id=1, bos_token_id=2, **sizes.gemma)),
            "transformer": SanaTransformer2DModel(in_channels=latent_channels, out_channels=latent_channels,
                                                  **sizes.transformer),
            "vae": AutoencoderDC(in_channels=3, **sizes.vae),
        }
    for folder, module in modules.items():
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    if scheduler == "euler":
        FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(path / "scheduler")
    elif scheduler == "dpm":
        DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction",
                                    algorithm_type="dpmsolver++", solver_order=2).save_pretrained(path / "scheduler")
    else:
        raise ValueError(f"scheduler must be 'euler' or 'dpm', got {scheduler!r}")
    scheduler_class = "FlowMatchEulerDiscreteScheduler" if scheduler == "euler" else "DPMSolverMultistepScheduler"
    index = {
        "_class_name": "SanaPipeline",
        "scheduler": ["diffusers", scheduler_class], "vae": ["diffusers", "AutoencoderDC"],
        "text_encoder": ["transformers", "Gemma2Model"], "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "SanaTransformer2DModel"],
        "diffrl": {"family": SanaFamily.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
