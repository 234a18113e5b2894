"""LTX-2 checkpoints (the `ltx2` family) with random weights, written by `LTX2Pipeline.save_pretrained` (no
download): `tiny()` for CPU tests, `real()` at LTX-2.3's size (its 19 B transformer) for GPU benchmarks.

The layout is the pipeline's: `transformer/`, `connectors/`, `vae/`, `audio_vae/`, `vocoder/`, `text_encoder/`
(Gemma 3), `tokenizer/`, `scheduler/`, plus the family's settings in the `diffrl` block of `model_index.json`. Both presets have the LTX-2.3 features (gated attention, timestep-modulated
cross-attention, per-modality text projections in the connectors); `real()`'s sizes are the ones diffusers'
conversion script gives LTX-2.3.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.models.ltx2 import Ltx2Family
from diffrl.models.random_checkpoints.tokenizers import build_word_tokenizer
from diffrl.utils.device import built_in

# The scheduler LTX-2 ships: a token-count dynamic shift, stretched so that the last σ before 0 is 0.1.
SCHEDULER = {"use_dynamic_shifting": True, "base_shift": 0.95, "max_shift": 2.05, "base_image_seq_len": 1024,
             "max_image_seq_len": 4096, "shift_terminal": 0.1}

# What makes a transformer LTX-2.3 rather than LTX-2.0.
LTX_2_3_FLAGS = {"gated_attn": True, "cross_attn_mod": True, "audio_gated_attn": True, "audio_cross_attn_mod": True,
                 "use_prompt_embeddings": False, "perturbed_attn": True, "rope_type": "split"}

WORDS = ["a", "an", "the", "red", "blue", "green", "cat", "dog", "circle", "square", "of", "on", "video", "running",
         "in", "rain", "blurry"]


def _connectors(heads: tuple[int, int], head_dims: tuple[int, int], layers: int, registers: int | None,
                rope_base: int) -> dict:
    """LTX-2.3's connector layout: per-modality text projections and gated attention; video then audio."""
    return {
        "video_connector_num_attention_heads": heads[0], "video_connector_attention_head_dim": head_dims[0],
        "audio_connector_num_attention_heads": heads[1], "audio_connector_attention_head_dim": head_dims[1],
        "video_connector_num_layers": layers, "audio_connector_num_layers": layers,
        "video_connector_num_learnable_registers": registers, "audio_connector_num_learnable_registers": registers,
        "video_gated_attn": True, "audio_gated_attn": True, "connector_rope_base_seq_len": rope_base,
        "rope_type": "split", "per_modality_projections": True, "proj_bias": True,
        "video_hidden_dim": heads[0] * head_dims[0], "audio_hidden_dim": heads[1] * head_dims[1],
    }


@dataclass
class Ltx2Sizes:
    """Keyword arguments of each component's class (`text` and `vision`: Gemma 3's two configs). The connectors'
    input width follows from the text encoder (hidden size × (layers + 1)), the transformer's from the
    connectors. `settings`: the family's per-checkpoint settings (`Ltx2Settings` fields), written to the model
    index; empty for the pipeline's defaults."""

    transformer: dict
    connectors: dict
    text: dict
    vae: dict
    audio_vae: dict
    vocoder: dict
    settings: dict = field(default_factory=dict)
    vision: dict = field(default_factory=lambda: {  # never run (text to video): the smallest that builds
        "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
        "image_size": 16, "patch_size": 8})


def tiny(registers: int | None = 8) -> Ltx2Sizes:
    """Every LTX-2.3 feature at a few channels. The VAE keeps the real factors (32 in space, 8 in time), and an
    audio token is as wide as a video token (4 here, 128 in the real model). `registers`: the connectors'
    learnable registers (None: none). 16 text tokens, 9 frames of 64 × 96 by default."""
    return Ltx2Sizes(
        transformer={
            "in_channels": 4, "out_channels": 4, "num_attention_heads": 2, "attention_head_dim": 8,
            "cross_attention_dim": 16, "audio_in_channels": 4, "audio_out_channels": 4,
            "audio_num_attention_heads": 2, "audio_attention_head_dim": 4, "audio_cross_attention_dim": 8,
            "num_layers": 2, **LTX_2_3_FLAGS},
        connectors=_connectors((2, 2), (8, 4), layers=1, registers=registers, rope_base=32),
        text={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 8, "sliding_window": 8, "max_position_embeddings": 256},
        vae={
            "latent_channels": 4, "block_out_channels": (8, 8, 8, 8), "layers_per_block": (1, 1, 1, 1, 1),
            "decoder_block_out_channels": (8, 8, 8), "decoder_layers_per_block": (1, 1, 1, 1),
            "decoder_spatio_temporal_scaling": (True, True, True), "decoder_inject_noise": (False,) * 4,
            "upsample_residual": (False, False, False), "upsample_factor": (1, 1, 1),
            "spatial_compression_ratio": 32, "temporal_compression_ratio": 8, "decoder_causal": False},
        audio_vae={"base_channels": 4, "ch_mult": (1,), "num_res_blocks": 1, "resolution": 32,
                   "latent_channels": 2, "mel_bins": 8},
        vocoder={"hidden_channels": 8, "out_channels": 2, "upsample_kernel_sizes": [4, 4],
                 "upsample_factors": [2, 2], "resnet_kernel_sizes": [3], "resnet_dilations": [[1, 3, 5]],
                 "output_sampling_rate": 16000},
        settings={"max_sequence_length": 16, "default_num_frames": 9, "default_height": 64, "default_width": 96},
    )


def real(text_layers: int = 8) -> Ltx2Sizes:
    """LTX-2.3: the 19 B transformer, its connectors (8 layers each, 128 registers; 2.2 B), the video VAE (32× in
    space, 8× in time, 128 channels) and the audio VAE (8 channels × 16 mel bins = 128 per token). The Gemma 3
    text encoder has Gemma-3-12B's width (3,840) and `text_layers` layers (48 in the real one; the connectors
    read every layer's hidden states, so their input projection follows the depth). The vocoder is LTX-2.0's;
    only the reference pipeline runs it. The pipeline's defaults: 1,024 text tokens, 121 frames of 512 × 768."""
    return Ltx2Sizes(
        transformer={
            "in_channels": 128, "out_channels": 128, "num_attention_heads": 32, "attention_head_dim": 128,
            "cross_attention_dim": 4096, "audio_in_channels": 128, "audio_out_channels": 128,
            "audio_num_attention_heads": 32, "audio_attention_head_dim": 64, "audio_cross_attention_dim": 2048,
            "num_layers": 48, **LTX_2_3_FLAGS},
        connectors=_connectors((32, 32), (128, 64), layers=8, registers=128, rope_base=4096),
        text={"hidden_size": 3840, "intermediate_size": 15360, "num_hidden_layers": text_layers,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 256, "sliding_window": 1024,
              "max_position_embeddings": 131072},
        vae={
            "latent_channels": 128, "block_out_channels": (256, 512, 1024, 1024),
            "layers_per_block": (4, 6, 4, 2, 2), "decoder_block_out_channels": (256, 512, 512, 1024),
            "decoder_layers_per_block": (4, 6, 4, 2, 2), "decoder_spatio_temporal_scaling": (True,) * 4,
            "decoder_inject_noise": (False,) * 5,
            "upsample_type": ("spatiotemporal", "spatiotemporal", "temporal", "spatial"),
            "upsample_residual": (False,) * 4, "upsample_factor": (2, 2, 1, 2),
            "decoder_spatial_padding_mode": "zeros", "spatial_compression_ratio": 32,
            "temporal_compression_ratio": 8, "decoder_causal": False},
        audio_vae={"base_channels": 128, "ch_mult": (1, 2, 4), "num_res_blocks": 2, "resolution": 256,
                   "latent_channels": 8, "mel_bins": 64},
        vocoder={"hidden_channels": 1024, "out_channels": 2, "upsample_kernel_sizes": [16, 15, 8, 4, 4],
                 "upsample_factors": [6, 5, 2, 2, 2], "resnet_kernel_sizes": [3, 7, 11],
                 "resnet_dilations": [[1, 3, 5]] * 3, "output_sampling_rate": 24000},
    )


def save_random_checkpoint(path: str | Path, sizes: Ltx2Sizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A checkpoint with random weights (default sizes: `tiny()`) and a word-level tokenizer made in code; built
    on `device`, stored in `dtype`. The video VAE gets random per-channel latent statistics, so that decoding
    exercises them."""
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    sizes = sizes or tiny()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_word_tokenizer(WORDS, 1024)
    words = len(tokenizer)
    text_width = sizes.text["hidden_size"]
    with built_in(device, dtype):
        # Gemma's image marker tokens sit past the tokenizer's words, where no prompt reaches them.
        text_encoder = Gemma3ForConditionalGeneration(Gemma3Config(
            text_config=dict(vocab_size=words + 3, **sizes.text), vision_config=sizes.vision,
            mm_tokens_per_image=4, boi_token_index=words, eoi_token_index=words + 1, image_token_index=words + 2))
        connectors = LTX2TextConnectors(caption_channels=text_width,
                                        text_proj_in_factor=sizes.text["num_hidden_layers"] + 1, **sizes.connectors)
        transformer = LTX2VideoTransformer3DModel(caption_channels=text_width, **sizes.transformer)
        vae = AutoencoderKLLTX2Video(**sizes.vae)
        audio_vae = AutoencoderKLLTX2Audio(**sizes.audio_vae)
        vocoder = LTX2Vocoder(in_channels=audio_vae.config.output_channels * audio_vae.config.mel_bins,
                              **sizes.vocoder)
        with torch.no_grad():
            vae.latents_mean.normal_(0, 0.3)
            vae.latents_std.uniform_(0.5, 1.5)
    pipe = LTX2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae, audio_vae=audio_vae,
                        text_encoder=text_encoder, tokenizer=tokenizer, connectors=connectors,
                        transformer=transformer, vocoder=vocoder)
    if dtype != torch.float32:
        pipe.to(dtype=dtype)
    pipe.save_pretrained(path, safe_serialization=True)
    index_file = path / "model_index.json"
    index = json.loads(index_file.read_text())
    index["diffrl"] = {"family": Ltx2Family.name, **sizes.settings}
    index_file.write_text(json.dumps(index, indent=2) + "\n")
    return path
