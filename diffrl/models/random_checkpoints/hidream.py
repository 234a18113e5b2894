"""HiDream-I1 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()`
(HiDream-I1's published transformer shape, 17 B with its experts, and FLUX.1's 16-channel VAE, with shallow CLIPs,
T5 and Llama of the real widths) for benchmarks. The VAE and T5 sizes are FLUX.1's (`random_checkpoints.flux1`):
HiDream-I1 uses the same VAE and T5-XXL."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.hidream import HiDreamFamily
from diffrl.models.random_checkpoints import flux1
from diffrl.models.random_checkpoints.sd3 import build_clip_tokenizer
from diffrl.models.random_checkpoints.tokenizers import build_word_tokenizer

LLAMA_BOS, LLAMA_EOS = "<|begin_of_text|>", "<|eot_id|>"


@dataclass
class HiDreamSizes:
    transformer: dict  # HiDreamImageTransformer2DModel keywords (channels and text widths are derived)
    clip_widths: tuple[int, int]  # CLIP-L, CLIP-G (their projections too: the pooled width is the sum)
    clip_layers: int
    clip_positions: int  # HiDream's CLIPs read up to 248 tokens
    t5: dict  # T5Config keywords (d_model is the transformer's caption_channels[0])
    llama: dict  # LlamaConfig keywords (hidden_size is caption_channels[1])
    vae: dict  # AutoencoderKL keywords
    max_sequence_length: int
    default_size: int


def tiny() -> HiDreamSizes:
    """One double and one single block of width 32 (2 heads of 16), 4 experts of which 2 are active; a 3-layer
    Llama of which the blocks read layers 2 and 0 (layer 1 is never carried)."""
    flux = flux1.tiny()
    return HiDreamSizes(
        transformer={"patch_size": 2, "num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16,
                     "num_attention_heads": 2, "caption_channels": [32, 24], "num_routed_experts": 4,
                     "num_activated_experts": 2, "axes_dims_rope": (8, 4, 4), "max_resolution": (32, 32),
                     "llama_layers": [2, 0]},
        clip_widths=(8, 16), clip_layers=2, clip_positions=32, t5=flux.t5,
        llama={"intermediate_size": 48, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1},
        vae=flux.vae, max_sequence_length=16, default_size=32)


def real() -> HiDreamSizes:
    """HiDream-I1: 16 double and 32 single blocks of width 2560 (20 heads of 128), MoE of 4 routed experts (2
    active) and a shared one, 1024² and 128 tokens per text encoder as the pipeline's defaults. The Llama (3.1 8B's
    width 4096, 32 heads, 8 KV heads, MLP 14,336) is shallow: two layers, the blocks reading them in turn (the real
    model reads 32 distinct layers: its conditioning carries 32 × 128 Llama tokens rather than 2 × 128)."""
    flux = flux1.real()
    return HiDreamSizes(
        transformer={"patch_size": 2, "num_layers": 16, "num_single_layers": 32, "attention_head_dim": 128,
                     "num_attention_heads": 20, "caption_channels": [4096, 4096], "num_routed_experts": 4,
                     "num_activated_experts": 2, "axes_dims_rope": (64, 32, 32), "max_resolution": (128, 128),
                     "llama_layers": [k % 2 for k in range(48)]},
        clip_widths=(768, 1280), clip_layers=2, clip_positions=248, t5=flux.t5,
        llama={"intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32,
               "num_key_value_heads": 8},
        vae=flux.vae, max_sequence_length=128, default_size=1024)


def build_llama_tokenizer(max_length: int):
    """A word-level tokenizer in Llama 3's format: `<|begin_of_text|>` prepended, no end token appended, and
    `<|eot_id|>` as its end token (the pipeline pads with it)."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {LLAMA_BOS: 0, LLAMA_EOS: 1, "<unk>": 2}
    for word in flux1.T5_WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single=f"{LLAMA_BOS} $A", special_tokens=[(LLAMA_BOS, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=LLAMA_BOS, eos_token=LLAMA_EOS, unk_token="<unk>",
                                   model_max_length=max_length)


def save_random_checkpoint(path: str | Path, sizes: HiDreamSizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A HiDream-I1 checkpoint in diffusers layout with random weights (default sizes: `tiny()`), its four
    tokenizers made in code, a flow-matching Euler scheduler of shift 3 (HiDream-I1-Full's flow shift). Built on
    `device` (every weight drawn by torch's seeded default generator there), stored in `dtype`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, HiDreamImageTransformer2DModel
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        LlamaConfig,
        LlamaForCausalLM,
        T5Config,
        T5EncoderModel,
    )

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    t5_width, llama_width = sizes.transformer["caption_channels"]
    t5_tokenizer = build_word_tokenizer(flux1.T5_WORDS, 512)
    llama_tokenizer = build_llama_tokenizer(131072)
    t5_tokenizer.save_pretrained(path / "tokenizer_3")
    llama_tokenizer.save_pretrained(path / "tokenizer_4")
    modules = {}
    with torch.device(device):  # build where it is fast
        for index, name in enumerate(("", "_2")):
            tokenizer = build_clip_tokenizer(path / f"tokenizer{name}")
            tokenizer.save_pretrained(path / f"tokenizer{name}")
            width = sizes.clip_widths[index]
            modules[f"text_encoder{name}"] = CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                num_hidden_layers=sizes.clip_layers, num_attention_heads=2, projection_dim=width,
                max_position_embeddings=sizes.clip_positions, bos_token_id=0, eos_token_id=1, pad_token_id=1))
        modules["text_encoder_3"] = T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=t5_width,
                                                            decoder_start_token_id=0, pad_token_id=0, **sizes.t5))
        modules["text_encoder_4"] = LlamaForCausalLM(LlamaConfig(
            vocab_size=len(llama_tokenizer), hidden_size=llama_width, bos_token_id=0, eos_token_id=1,
            max_position_embeddings=max(sizes.max_sequence_length, 256), **sizes.llama))
        latent_channels = sizes.vae["latent_channels"]
        modules["transformer"] = HiDreamImageTransformer2DModel(
            in_channels=latent_channels, text_emb_dim=sum(sizes.clip_widths), **sizes.transformer)
        modules["vae"] = AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=0.3611, shift_factor=0.1159,
                                       **sizes.vae)
    for folder, module in modules.items():
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False).save_pretrained(path / "scheduler")
    clip = ["transformers", type(tokenizer).__name__]
    index = {
        "_class_name": "HiDreamImagePipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKL"],
        "transformer": ["diffusers", "HiDreamImageTransformer2DModel"],
        "text_encoder": ["transformers", "CLIPTextModelWithProjection"], "tokenizer": clip,
        "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"], "tokenizer_2": clip,
        "text_encoder_3": ["transformers", "T5EncoderModel"], "tokenizer_3": ["transformers", type(t5_tokenizer).__name__],
        "text_encoder_4": ["transformers", "LlamaForCausalLM"],
        "tokenizer_4": ["transformers", type(llama_tokenizer).__name__],
        "diffrl": {"family": HiDreamFamily.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
