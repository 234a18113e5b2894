"""Qwen-Image 2.1 checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()`
(`QwenImage21Transformer2DModel` and `AutoencoderKLQwenImage21` at their defaults, a shallow Qwen3-VL of the real
width) for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.models.random_checkpoints import qwen_vl
from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# The processor's chat template, enough for the pipeline's system turn (its text parts, in Qwen's markers).
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                 "{% else %}{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class QwenImage21Sizes:
    transformer: dict  # QwenImage21Transformer2DModel keywords (channels and text width are derived)
    vae: dict  # AutoencoderKLQwenImage21 keywords
    text_hidden: int
    text_layers: int
    text_heads: int
    default_size: int
    scheduler: dict = field(default_factory=lambda: {"use_dynamic_shifting": True, "base_shift": 0.5,
                                                      "max_shift": 1.15})


def tiny() -> QwenImage21Sizes:
    """Two blocks; a VAE of 4 latent channels with the real 16x (four spatial downsamplings, none in time)."""
    return QwenImage21Sizes(
        transformer={"num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2, "mlp_ratio": 2,
                     "axes_dims_rope": (4, 6, 6)},
        vae={"base_dim": 8, "decoder_base_dim": 8, "z_dim": 4, "dim_mult": [1, 1, 1, 1, 1], "num_res_blocks": 1,
             "temperal_downsample": [False, False, False, False], "latents_mean": [0.1, -0.2, 0.3, 0.0],
             "latents_std": [1.5, 0.8, 1.2, 2.0]},
        text_hidden=32, text_layers=2, text_heads=2, default_size=64)


def real() -> QwenImage21Sizes:
    """The transformer and VAE at the diffusers classes' defaults; a Qwen3-VL of the transformer's text width
    (4,096) with 2 layers."""
    return QwenImage21Sizes(transformer={}, vae={}, text_hidden=4096, text_layers=2, text_heads=32, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: QwenImage21Sizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Qwen-Image 2.1 checkpoint with random weights (default sizes: `tiny()`) and a processor made in code."""
    from diffusers import AutoencoderKLQwenImage21, FlowMatchEulerDiscreteScheduler, QwenImage21Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", *VISION_TOKENS]})
    ids = {name: tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in ("image_pad", "video_pad",
                                                                            "vision_start")}
    with torch.device(device):
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config={**qwen_vl.text_config(len(tokenizer), sizes.text_hidden, sizes.text_layers, sizes.text_heads),
                         "head_dim": sizes.text_hidden // sizes.text_heads},
            vision_config=qwen_vl.vision_config(sizes.text_hidden, deepstack_visual_indexes=[0]),
            image_token_id=ids["image_pad"], video_token_id=ids["video_pad"], vision_start_token_id=ids["vision_start"]))
        vae = AutoencoderKLQwenImage21(**sizes.vae)
        transformer = QwenImage21Transformer2DModel(in_channels=vae.config.z_dim, out_channels=vae.config.z_dim,
                                                    context_in_dim=sizes.text_hidden, **sizes.transformer)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)
    processor = path / "processor"
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2).save_pretrained(processor)
    tokenizer.save_pretrained(processor)
    (processor / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    FlowMatchEulerDiscreteScheduler(**sizes.scheduler).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "QwenImage21Pipeline", "sample_sigmas": None,
        "transformer": ["diffusers", "QwenImage21Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage21"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "processor": ["transformers", "Qwen3VLProcessor"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "diffrl": {"default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
