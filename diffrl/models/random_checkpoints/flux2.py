"""FLUX.2 checkpoints with random weights, in diffusers layout (no download): `tiny(variant)` for tests, `real(model)`
for benchmarks (FLUX.2 [klein] 4B or 9B, FLUX.2 [dev]: the published transformer and VAE, with a shallow text
encoder of the real width). `distilled=True` marks a klein checkpoint step-distilled (`is_distilled`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as DEV_SYSTEM_MESSAGE

from diffrl.models.flux2 import TEXT_ENCODERS, Flux2Family
from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer, build_qwen_word_tokenizer

PROMPT_WORDS = "a an the red blue green cat dog circle square of on mat blurry ugly".split()  # noqa: SIM905
# The published transformers (their config.json): klein 4B on Qwen3-4B (2560 wide), 9B on Qwen3-8B (4096), dev on
# Mistral Small 3.2 (5120); three stacked text layers each.
REAL_TRANSFORMERS = {
    "klein-4b": {"num_layers": 5, "num_single_layers": 20, "num_attention_heads": 24, "guidance_embeds": False},
    "klein-9b": {"num_layers": 8, "num_single_layers": 24, "num_attention_heads": 32, "guidance_embeds": False},
    "dev": {},  # the class defaults: 8 double and 48 single blocks, 48 heads of 128, the guidance embedding
}
REAL_TEXT_WIDTHS = {"klein-4b": 2560, "klein-9b": 4096, "dev": 5120}


@dataclass
class Flux2Sizes:
    variant: str  # "dev" (Mistral3 text encoder) or "klein" (Qwen3)
    transformer: dict  # Flux2Transformer2DModel keywords (channels and the text width are derived)
    text_hidden: int
    text_layers: int
    text_heads: int
    text_kv_heads: int
    text_encoder_out_layers: tuple[int, ...]
    vae: dict  # AutoencoderKLFlux2 keywords
    max_sequence_length: int
    default_size: int


def tiny(variant: str = "dev") -> Flux2Sizes:
    return Flux2Sizes(
        variant=variant,
        transformer={"num_layers": 1, "num_single_layers": 1, "attention_head_dim": 16, "num_attention_heads": 2,
                     "timestep_guidance_channels": 32, "axes_dims_rope": (4, 4, 4, 4),
                     "guidance_embeds": variant == "dev"},
        text_hidden=16, text_layers=2, text_heads=2, text_kv_heads=1, text_encoder_out_layers=(1, 2),
        vae={"block_out_channels": (16, 16), "layers_per_block": 1, "latent_channels": 4, "norm_num_groups": 8,
             "down_block_types": ("DownEncoderBlock2D",) * 2, "up_block_types": ("UpDecoderBlock2D",) * 2},
        max_sequence_length=48, default_size=32)


def real(model: str = "klein-4b") -> Flux2Sizes:
    """`model`: "klein-4b", "klein-9b" or "dev". The transformer as published, the VAE at the class defaults, a
    3-layer text encoder of the real width (its three layers stacked, as the pipelines stack three). 1024², 512 text
    tokens, as the pipelines."""
    width = REAL_TEXT_WIDTHS[model]
    return Flux2Sizes(
        variant="dev" if model == "dev" else "klein", transformer=dict(REAL_TRANSFORMERS[model]), text_hidden=width,
        text_layers=3, text_heads=32, text_kv_heads=8, text_encoder_out_layers=(1, 2, 3), vae={},
        max_sequence_length=512, default_size=1024)


def _dev_tokenizer():
    """A word-level tokenizer knowing the system message's and the test prompts' words, with a chat template that
    reads FLUX.2 [dev]'s message format (a list of text parts per turn)."""
    words = [*re.findall(r"\w+", DEV_SYSTEM_MESSAGE.lower()), *PROMPT_WORDS]
    tokenizer = build_qwen_word_tokenizer(words, (".", ",", ":"), lowercase=True)
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for part in m['content'] %}"
                               "{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}")
    return tokenizer


def _text_encoder(sizes: Flux2Sizes, vocab_size: int, pad_token_id: int):
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Qwen3Config, Qwen3ForCausalLM

    text = {"vocab_size": vocab_size, "hidden_size": sizes.text_hidden, "intermediate_size": 2 * sizes.text_hidden,
            "num_hidden_layers": sizes.text_layers, "num_attention_heads": sizes.text_heads,
            "num_key_value_heads": sizes.text_kv_heads, "head_dim": max(sizes.text_hidden // sizes.text_heads, 8),
            "max_position_embeddings": 4096, "pad_token_id": pad_token_id}
    if sizes.variant == "klein":
        return Qwen3ForCausalLM(Qwen3Config(**text))
    vision = {"model_type": "pixtral", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "head_dim": 8, "image_size": 32, "patch_size": 16}
    return Mistral3ForConditionalGeneration(Mistral3Config(
        text_config={"model_type": "mistral", **text}, vision_config=vision, image_token_index=vocab_size - 1,
        spatial_merge_size=1))


def save_random_checkpoint(path: str | Path, sizes: Flux2Sizes | None = None, *, distilled: bool = False,
                           seed: int = 0, device: str | torch.device = "cpu",
                           dtype: torch.dtype = torch.float32) -> Path:
    """A FLUX.2 checkpoint in diffusers layout with random weights (default sizes: `tiny()`, dev) and a chat
    tokenizer made in code, with random latent BatchNorm statistics so that decoding exercises them. `distilled`:
    a step-distilled klein checkpoint. Built on `device`, stored in `dtype`."""
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Transformer2DModel

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer() if sizes.variant == "klein" else _dev_tokenizer()
    with torch.device(device):  # build where it is fast
        text_encoder = _text_encoder(sizes, len(tokenizer), tokenizer.pad_token_id)
        vae = AutoencoderKLFlux2(**sizes.vae)
        with torch.no_grad():
            vae.bn.running_mean.normal_(0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
        transformer = Flux2Transformer2DModel(
            in_channels=4 * vae.config.latent_channels,
            joint_attention_dim=sizes.text_hidden * len(sizes.text_encoder_out_layers), **sizes.transformer)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                    ).save_pretrained(path / "scheduler")
    klein = sizes.variant == "klein"
    index = {
        "_class_name": "Flux2KleinPipeline" if klein else "Flux2Pipeline",
        **({"is_distilled": distilled} if klein else {}),
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", TEXT_ENCODERS[sizes.variant]],
        "tokenizer": ["transformers", type(tokenizer).__name__],
        "transformer": ["diffusers", "Flux2Transformer2DModel"],
        "diffrl": {"family": Flux2Family.name, "text_encoder_out_layers": list(sizes.text_encoder_out_layers),
                   "max_sequence_length": sizes.max_sequence_length, "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
