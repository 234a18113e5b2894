"""HunyuanVideo 1.5 checkpoints with random weights, written by `HunyuanVideo15Pipeline.save_pretrained` (no
download): `tiny()` for tests (the VAE's real factors, 16 in space and 4 in time, at a few channels; a 3-layer
Qwen2.5-VL text model, a 1-layer ByT5-style T5 encoder and the ByT5 byte tokenizer), `real()` (the transformer and
VAE at the diffusers classes' defaults, HunyuanVideo 1.5's 8.3 B transformer, with shallow text encoders of the real
widths) for benchmarks. The tiny preset also shortens the pipeline's token counts (the `diffrl` block of its model
index), so that a CPU test does not attend over 2,000 text and image tokens. Text to video (`HunyuanVideo15Pipeline`),
or with `image_to_video` image to video (`HunyuanVideo15ImageToVideoPipeline`: a SigLIP vision encoder and its image
processor besides, the transformer's `task_type` "i2v"); the scheduler's shift 5 and CFG 6 (the guider)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.models.random_checkpoints import qwen_vl
from diffrl.models.random_checkpoints.tokenizers import build_qwen_word_tokenizer

# The words of the pipeline's system message and a few prompts' (the others map to <unk>).
TOKENIZER_WORDS = (  # noqa: SIM905 (a sentence of words reads better than a list)
    "system user you are a helpful assistant describe the video by detailing following aspects main content and theme of "
    "color shape size texture quantity text spatial relationships objects actions events behaviors temporal physical "
    "movement changes background environment light style atmosphere camera angles movements transitions used in "
    "an on red green blue cat dog sign that says hello walks grass blurry").split()
SPACES = "¦"  # a run of spaces, as a token of its own
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@dataclass
class HunyuanVideo15Sizes:
    transformer: dict  # HunyuanVideo15Transformer3DModel keywords (channels and text widths are derived)
    text_hidden: int  # Qwen2.5-VL's width (the transformer's text_embed_dim)
    text_layers: int
    text_heads: int
    byt5: dict  # T5Config keywords of the glyph encoder (d_model is the transformer's text_embed_2_dim)
    vae: dict  # AutoencoderKLHunyuanVideo15 keywords
    # The `diffrl` block's token counts (text_tokens, glyph_tokens, image_tokens); empty: the pipeline's 1000, 256, 729.
    tokens: dict = field(default_factory=dict)
    # Image to video: SiglipVisionConfig keywords (hidden_size is the transformer's image_embed_dim) and the image
    # processor's square input size; its (image_size / patch_size)² patches are the image tokens.
    vision: dict = field(default_factory=dict)


def tiny() -> HunyuanVideo15Sizes:
    return HunyuanVideo15Sizes(
        transformer={"num_attention_heads": 2, "attention_head_dim": 16, "num_layers": 2, "num_refiner_layers": 1,
                     "mlp_ratio": 2.0, "rope_axes_dim": (4, 6, 6), "image_embed_dim": 8, "target_size": 64,
                     "task_type": "t2v"},
        text_hidden=32, text_layers=3, text_heads=2,
        byt5={"d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_heads": 2},
        vae={"latent_channels": 4, "block_out_channels": (8, 8, 8, 16, 16), "layers_per_block": 1},
        tokens={"text_tokens": 24, "glyph_tokens": 8, "image_tokens": 8},
        vision={"intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 16,
                "patch_size": 8})


def real() -> HunyuanVideo15Sizes:
    """The transformer and VAE at their defaults (8.3 B); Qwen2.5-VL-7B's width (3,584) with 3 layers (the pipeline
    reads the third-to-last hidden state) and ByT5's (1,472) with 2."""
    return HunyuanVideo15Sizes(transformer={"task_type": "t2v"}, text_hidden=3584, text_layers=3, text_heads=28,
                               byt5={"d_model": 1472, "d_kv": 64, "d_ff": 3584, "num_layers": 2, "num_heads": 6},
                               vae={}, vision={"intermediate_size": 4304, "num_hidden_layers": 2,
                                               "num_attention_heads": 16, "image_size": 384, "patch_size": 14})


def build_tokenizer():
    """Qwen's chat markers and template over a word-level vocabulary (see `build_qwen_word_tokenizer`). A run of
    spaces (the system message's indents) is two tokens, as Qwen's BPE splits them, so the template's prefix before
    the prompt is the 108 tokens the pipeline crops (`prompt_template_encode_start_idx`)."""
    from tokenizers import Regex, normalizers

    tokenizer = build_qwen_word_tokenizer(TOKENIZER_WORDS, (",", ":", ".", "'", '"', SPACES), lowercase=True)
    tokenizer.backend_tokenizer.normalizer = normalizers.Sequence([
        normalizers.Replace(Regex(" {2,}"), f" {SPACES}{SPACES} "), normalizers.Lowercase()])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_random_checkpoint(path: str | Path, sizes: HunyuanVideo15Sizes | None = None, *, seed: int = 0,
                           shift: float = 5.0, guidance_scale: float = 6.0, image_to_video: bool = False,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A HunyuanVideo 1.5 text-to-video checkpoint (with `image_to_video`: image-to-video, a SigLIP encoder of
    `sizes.vision` besides) in diffusers layout with random weights (default sizes: `tiny()`), built on `device`,
    stored in `dtype`; its scheduler shifted by `shift`, its guider at `guidance_scale`."""
    from diffusers import (
        AutoencoderKLHunyuanVideo15,
        ClassifierFreeGuidance,
        FlowMatchEulerDiscreteScheduler,
        HunyuanVideo15ImageToVideoPipeline,
        HunyuanVideo15Pipeline,
        HunyuanVideo15Transformer3DModel,
    )
    from transformers import (
        ByT5Tokenizer,
        Qwen2_5_VLTextConfig,
        Qwen2_5_VLTextModel,
        SiglipImageProcessor,
        SiglipVisionConfig,
        SiglipVisionModel,
        T5Config,
        T5EncoderModel,
    )

    sizes = sizes or tiny()
    torch.manual_seed(seed)
    tokenizer, tokenizer_2 = build_tokenizer(), ByT5Tokenizer()
    with torch.device(device):
        text_encoder = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
            **qwen_vl.text_config(len(tokenizer), sizes.text_hidden, sizes.text_layers, sizes.text_heads),
            **qwen_vl.special_token_ids(tokenizer)))
        text_encoder_2 = T5EncoderModel(T5Config(vocab_size=len(tokenizer_2), decoder_start_token_id=0,
                                                 pad_token_id=0, **sizes.byt5))
        vae = AutoencoderKLHunyuanVideo15(**sizes.vae)
        latent = vae.config.latent_channels
        transformer_sizes = {**sizes.transformer, **({"task_type": "i2v"} if image_to_video else {})}
        transformer = HunyuanVideo15Transformer3DModel(
            in_channels=2 * latent + 1, out_channels=latent, text_embed_dim=sizes.text_hidden,
            text_embed_2_dim=sizes.byt5["d_model"], **transformer_sizes)
        if image_to_video:
            image_encoder = SiglipVisionModel(SiglipVisionConfig(
                hidden_size=transformer.config.image_embed_dim, **sizes.vision))
    parts = dict(text_encoder=text_encoder.to(dtype), tokenizer=tokenizer, transformer=transformer.to(dtype),
                 vae=vae.to(dtype), scheduler=FlowMatchEulerDiscreteScheduler(shift=shift),
                 text_encoder_2=text_encoder_2.to(dtype), tokenizer_2=tokenizer_2,
                 guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    tokens = dict(sizes.tokens)
    if image_to_video:
        side = sizes.vision["image_size"]
        # Image to video reads the encoder's patches, not the zero image tokens of text to video.
        tokens["image_tokens"] = (side // sizes.vision["patch_size"]) ** 2
        pipe = HunyuanVideo15ImageToVideoPipeline(
            **parts, image_encoder=image_encoder.to(dtype),
            feature_extractor=SiglipImageProcessor(size={"height": side, "width": side}))
    else:
        pipe = HunyuanVideo15Pipeline(**parts)
    pipe.save_pretrained(path, safe_serialization=True)
    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    index["diffrl"] = {"family": "hunyuan_video15", **tokens}
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
