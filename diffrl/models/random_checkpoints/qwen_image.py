"""Qwen-Image checkpoints with random weights, in diffusers layout (no download): `tiny()` for tests, `real()`
(`QwenImageTransformer2DModel` and `AutoencoderKLQwenImage` at their defaults, Qwen-Image's 20 B transformer)
for benchmarks; `edit=` builds a Qwen-Image-Edit (or Edit Plus) checkpoint: the same components plus the
`processor/` (Qwen2-VL's image processor and the tokenizer, made in code) its pipeline encodes images with."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.qwen_image import EDIT_PIPELINES, VISION_TOKENS, QwenImageFamily
from diffrl.models.random_checkpoints import qwen_vl
from diffrl.models.random_checkpoints.tokenizers import build_qwen_word_tokenizer

TOKENIZER_WORDS = (  # noqa: SIM905 (a sentence of words reads better than a list)
    "system user assistant describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background a an on in to left right above below with one two three four "
    "circle circles square squares triangle triangles diamond diamonds red green blue yellow purple orange "
    "black white cat cats dog dogs mat blurry ugly picture photo very long prompt about").split()


EDIT_WORDS = (  # noqa: SIM905 (the editing template's words that TOKENIZER_WORDS lacks, and a few instructions)
    "key features input objects then explain how user s instruction should alter or modify generate new that "
    "meets requirements while maintaining consistency original where appropriate make remove add turn into").split()


def build_qwen_tokenizer():
    """Lowercased words; the template's prefix is the 34 tokens the pipeline drops (see `build_qwen_word_tokenizer`)."""
    return build_qwen_word_tokenizer(TOKENIZER_WORDS, (",", ":", ".", "'", '"'), lowercase=True)


def build_qwen_edit_tokenizer():
    """`build_qwen_tokenizer`'s words and the editing template's, with Qwen-VL's vision markers; `'s` and `),` are
    one token each (as in Qwen's BPE), so the editing template's prefix is the 64 tokens its pipelines drop."""
    return build_qwen_word_tokenizer((*TOKENIZER_WORDS, *EDIT_WORDS), (",", ":", ".", "'", '"', "(", ")"),
                                     lowercase=True, specials=VISION_TOKENS, merged=("'s", "),"))


@dataclass
class QwenImageSizes:
    transformer: dict  # QwenImageTransformer2DModel keywords (channels and text width are derived)
    text_hidden: int
    text_layers: int
    text_heads: int
    vae: dict  # AutoencoderKLQwenImage keywords
    default_size: int | None  # None: the family's default (1024² with the real VAE)
    vision_patch: int = 14  # the vision tower's (and image processor's) patch side; Qwen2.5-VL's 14
    image_areas: dict | None = None  # editing checkpoints: the `diffrl` block's areas (None: the pipelines' own)


def tiny() -> QwenImageSizes:
    return QwenImageSizes(
        transformer={"patch_size": 2, "num_layers": 2, "attention_head_dim": 16, "num_attention_heads": 2,
                     "axes_dims_rope": (4, 6, 6)},
        text_hidden=32, text_layers=2, text_heads=2,
        vae={"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2], "num_res_blocks": 1, "temperal_downsample": [False]},
        default_size=32, vision_patch=4, image_areas={"vae_image_area": 32 * 32, "vl_image_area": 32 * 32})


def real() -> QwenImageSizes:
    """The transformer and VAE at their defaults (Qwen-Image's sizes), with a text encoder of Qwen2.5-VL-7B's
    width (3,584) but 2 layers."""
    return QwenImageSizes(transformer={}, text_hidden=3584, text_layers=2, text_heads=28, vae={}, default_size=None)


def save_random_checkpoint(path: str | Path, sizes: QwenImageSizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                           edit: str | None = None) -> Path:
    """A Qwen-Image checkpoint in diffusers layout with random weights (default sizes: `tiny()`), with random
    latent statistics so that decoding exercises them; built on `device`, stored in `dtype`. The scheduler
    config is Qwen-Image's (dynamic shift, stretched to a terminal σ of 0.02). `edit`: "QwenImageEditPipeline" or
    "QwenImageEditPlusPipeline", an editing checkpoint (its vision tower runs: patches of `sizes.vision_patch`)."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    sizes = sizes or tiny()
    if edit is not None and edit not in EDIT_PIPELINES:
        raise ValueError(f"edit: one of {sorted(EDIT_PIPELINES)}, got {edit!r}")
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_qwen_edit_tokenizer() if edit else build_qwen_tokenizer()
    vision, vision_ids = {}, {}
    if edit:  # the vision tower runs: its patches (2x2 merged) and windows of 2x2 merged patches
        patch = sizes.vision_patch
        vision = {"patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 4 * patch}
        vision_ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in
                      zip(("vision_start", "vision_end", "image", "video"), VISION_TOKENS, strict=True)}
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config={**qwen_vl.text_config(len(tokenizer), sizes.text_hidden, sizes.text_layers, sizes.text_heads),
                         **qwen_vl.special_token_ids(tokenizer)},
            vision_config=qwen_vl.vision_config(sizes.text_hidden, fullatt_block_indexes=[0], **vision),
            **vision_ids))
        z_dim = sizes.vae.get("z_dim", 16)
        generator = torch.Generator().manual_seed(seed)
        # Drawn on the CPU (the generator's device) whatever `device` builds the modules.
        latents_mean = (0.5 * torch.randn(z_dim, generator=generator, device="cpu")).tolist()
        latents_std = (0.5 + 1.5 * torch.rand(z_dim, generator=generator, device="cpu")).tolist()
        vae = AutoencoderKLQwenImage(latents_mean=latents_mean, latents_std=latents_std, **sizes.vae)
        transformer = QwenImageTransformer2DModel(in_channels=4 * z_dim, out_channels=z_dim,
                                                  joint_attention_dim=sizes.text_hidden, **sizes.transformer)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    if edit:
        _save_processor(path / "processor", tokenizer, sizes.vision_patch)
    # Qwen-Image's published scheduler settings.
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": edit or "QwenImagePipeline",
        "transformer": ["diffusers", "QwenImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "diffrl": {"family": QwenImageFamily.name, "default_size": sizes.default_size,
                   **((sizes.image_areas or {}) if edit else {})},
        **({"processor": ["transformers", "Qwen2VLProcessor"]} if edit else {}),
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


def _save_processor(folder: Path, tokenizer, patch: int) -> None:
    """The `processor/` folder: Qwen2-VL's image processor (patches of `patch`, 2x2 merged; its default pixel bounds,
    4 to 1280 merged patches) and the tokenizer, as `QwenImageFamily` loads them."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    factor = 2 * patch
    Qwen2VLImageProcessorPil(patch_size=patch, merge_size=2, temporal_patch_size=2, min_pixels=4 * factor * factor,
                             max_pixels=1280 * factor * factor).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
