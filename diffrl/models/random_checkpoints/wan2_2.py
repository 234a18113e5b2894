"""Wan checkpoints with random weights, written by `WanPipeline.save_pretrained` (no download): two experts
switched at a boundary (Wan2.2) or one (Wan2.1-style). `tiny()` for tests (Wan's VAE factors, 4 in time and 8
in space, at a few channels); `real()` (`WanTransformer3DModel` and `AutoencoderKLWan` at their defaults: two
14 B experts, Wan2.2 A14B's sizes) for benchmarks."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.models.random_checkpoints.tokenizers import build_word_tokenizer

TOKENIZER_WORDS = "a an the red blue green cat dog circle square of on video".split()  # noqa: SIM905


@dataclass
class WanSizes:
    transformer: dict  # WanTransformer3DModel keywords (text_dim is the text encoder's width)
    text_encoder: dict  # UMT5Config keywords
    vae: dict  # AutoencoderKLWan keywords


def tiny() -> WanSizes:
    return WanSizes(
        transformer={"patch_size": (1, 2, 2), "num_attention_heads": 2, "attention_head_dim": 8, "in_channels": 4,
                     "out_channels": 4, "freq_dim": 16, "ffn_dim": 32, "num_layers": 2, "rope_max_seq_len": 32},
        text_encoder={"d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 1, "num_heads": 2},
        vae={"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
             "temperal_downsample": [False, True, True], "latents_mean": [0.1, -0.2, 0.3, 0.0],
             "latents_std": [1.5, 0.8, 1.2, 2.0]})


def real() -> WanSizes:
    """Each expert and the VAE at the diffusers classes' defaults (Wan's 14 B transformer, its 16-channel VAE);
    a UMT5 encoder of UMT5-XXL's width (4,096) with 2 layers."""
    return WanSizes(transformer={},
                    text_encoder={"d_model": 4096, "d_kv": 64, "d_ff": 10240, "num_layers": 2, "num_heads": 64},
                    vae={})


def save_random_checkpoint(path: str | Path, sizes: WanSizes | None = None, *, seed: int = 0, two_experts: bool = True,
                           boundary_ratio: float = 0.875, scheduler: str = "euler", shift: float = 3.0,
                           shared_experts: bool = False, device: str | torch.device = "cpu",
                           dtype: torch.dtype = torch.float32, image_to_video: bool = False,
                           ti2v: bool = False, clip_image: bool = False) -> Path:
    """A Wan checkpoint in diffusers layout with random weights (default sizes: `tiny()`) and a tokenizer made in
    code: two experts switched at `boundary_ratio` (Wan2.2), or one (Wan2.1-style, no boundary). `scheduler`:
    "euler" (FlowMatchEulerDiscreteScheduler) or "unipc" (Wan's published kind, flow σ's). `shared_experts`: the
    low-noise expert's folder is a link to the high-noise expert's, so both load the same weights as two modules:
    two experts' compute and memory on half the disk (Wan2.2 A14B at real size: 29 GB instead of 58).
    `image_to_video`: a `WanImageToVideoPipeline` checkpoint (Wan2.2 A14B I2V: the transformer takes the noise, the
    4-channel first-frame mask and the condition image's latents; no image encoder). `ti2v`: a TI2V-5B-style
    checkpoint (`WanPipeline` with `expand_timesteps`, one expert; the transformer as text-to-video's). `clip_image`:
    with `image_to_video`, Wan2.1 I2V's layout: one expert whose blocks also attend to a CLIP vision model's
    penultimate hidden states of the source (`image_encoder/`, `image_processor/`; a tiny CLIP at `tiny()` sizes)."""
    from diffusers import (
        AutoencoderKLWan,
        WanImageToVideoPipeline,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    sizes = sizes or tiny()
    two_experts = two_experts and not ti2v and not clip_image
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(TOKENIZER_WORDS, 512)
    width = sizes.text_encoder["d_model"]

    def stored(module):  # fp32 as built; another dtype cast as a whole (diffusers warns about its fp32 modules)
        return module if dtype == torch.float32 else module.to(dtype)

    with torch.device(device):
        text_encoder = stored(UMT5EncoderModel(UMT5Config(vocab_size=len(tokenizer), decoder_start_token_id=0,
                                                          pad_token_id=0, **sizes.text_encoder)))
        transformer = dict(sizes.transformer)
        if image_to_video:  # the noise, the mask (the VAE's temporal factor: 4 channels) and the image's latents
            z_dim = sizes.vae.get("z_dim", 16)
            transformer.update(in_channels=2 * z_dim + 4, out_channels=z_dim)
        image_encoder = image_processor = None
        if image_to_video and clip_image:
            from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

            # A tiny CLIP ViT (28² pixels in 14² patches: 4 patches and the class token); Wan2.1's is ViT-H/14 at 224².
            image_encoder = stored(CLIPVisionModel(CLIPVisionConfig(
                hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=28,
                patch_size=14)))
            image_processor = CLIPImageProcessor(size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28})
            inner = transformer.get("num_attention_heads", 40) * transformer.get("attention_head_dim", 128)
            transformer.update(image_dim=16, added_kv_proj_dim=inner)
        experts = [stored(WanTransformer3DModel(text_dim=width, **transformer))
                   for _ in range(2 if two_experts and not shared_experts else 1)]
        vae = stored(AutoencoderKLWan(**sizes.vae))
    sched = flow_scheduler(scheduler, shift)
    extra = {"image_encoder": image_encoder, "image_processor": image_processor} if image_to_video else {}
    if ti2v:
        extra = {"expand_timesteps": True}
    pipe = (WanImageToVideoPipeline if image_to_video else WanPipeline)(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, scheduler=sched, transformer=experts[0],
        transformer_2=experts[1] if len(experts) == 2 else None, boundary_ratio=boundary_ratio if two_experts else None,
        **extra)
    pipe.save_pretrained(path, safe_serialization=True)
    path = Path(path)
    if two_experts and shared_experts:
        (path / "transformer_2").symlink_to("transformer", target_is_directory=True)
        index = json.loads((path / "model_index.json").read_text())
        index["transformer_2"] = index["transformer"]
        (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path


def flow_scheduler(kind: str, shift: float):
    """A random checkpoint's scheduler: FlowMatch Euler, or UniPC on flow σ's ending at σ = 0 (Wan's and
    Cosmos3's published one)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    if kind == "euler":
        return FlowMatchEulerDiscreteScheduler(shift=shift)
    if kind == "unipc":
        return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                       final_sigmas_type="zero")
    raise ValueError(f"scheduler {kind!r}: 'euler' or 'unipc'")
