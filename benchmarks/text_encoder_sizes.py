"""What a real checkpoint's text encoder adds to a peak measured on a random one.

The random checkpoints the GPU benchmarks build (`family_rollout.py` `REAL_SIZES`) keep each text encoder's width but
few layers and a small vocabulary. This builds, on the meta device (no weights, no download), each family's random
encoder from its builder's `real()` sizes and the published encoder from its published shapes, and prints both
parameter counts and the difference in GiB at bf16: what to add to a `peak GiB` of BENCHMARKS.md for a real checkpoint
(unless `--offload-text-encoder` keeps the encoder in host memory).

    python benchmarks/text_encoder_sizes.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch

VOCAB = 1000  # the random checkpoints' word tokenizers are this small or smaller: their embeddings barely count


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def qwen_image() -> tuple[int, int]:
    """Qwen-Image (and -Edit): Qwen2.5-VL-7B."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from diffrl.models.random_checkpoints import qwen_vl
    from diffrl.models.random_checkpoints.qwen_image import real

    s = real()
    random = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=qwen_vl.text_config(VOCAB, s.text_hidden, s.text_layers, s.text_heads),
        vision_config=qwen_vl.vision_config(s.text_hidden, fullatt_block_indexes=[0], patch_size=14,
                                            spatial_merge_size=2, temporal_patch_size=2, window_size=56)))
    published = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
        text_config=dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                           fullatt_block_indexes=[7, 15, 23, 31])))
    return _count(random), _count(published)


def flux3_image() -> tuple[int, int]:
    """FLUX 3 Image Klein: Qwen3-VL-4B (the modular pipeline's `Qwen3VLForConditionalGeneration`)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from diffrl.models.random_checkpoints import qwen_vl
    from diffrl.models.random_checkpoints.flux3_image import real

    s = real()
    random = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config={**qwen_vl.text_config(VOCAB, s.text_hidden, s.text_layers, s.text_heads),
                     "head_dim": s.text_hidden // s.text_heads},
        vision_config=qwen_vl.vision_config(s.text_hidden, deepstack_visual_indexes=[0])))
    published = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
        text_config=dict(vocab_size=151936, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128),
        vision_config=dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           deepstack_visual_indexes=[5, 11, 17]),
        tie_word_embeddings=True))  # the 4B model ties its output head to its embeddings
    return _count(random), _count(published)


def _t5_encoder(layers: int, vocab: int, umt5: bool = False) -> torch.nn.Module:
    from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

    config_class, model_class = (UMT5Config, UMT5EncoderModel) if umt5 else (T5Config, T5EncoderModel)
    return model_class(config_class(vocab_size=vocab, d_model=4096, d_kv=64, d_ff=10240, num_layers=layers,
                                    num_heads=64, feed_forward_proj="gated-gelu"))


def flux1() -> tuple[int, int]:
    """FLUX.1: CLIP-L's text model and T5-XXL's encoder."""
    from transformers import CLIPTextConfig, CLIPTextModel

    from diffrl.models.random_checkpoints.flux1 import real

    s = real()
    random = [CLIPTextModel(CLIPTextConfig(vocab_size=VOCAB, hidden_size=s.clip_width,
                                           intermediate_size=2 * s.clip_width, num_hidden_layers=s.clip_layers,
                                           num_attention_heads=2)),
              _t5_encoder(s.t5["num_layers"], VOCAB)]
    published = [CLIPTextModel(CLIPTextConfig(vocab_size=49408, hidden_size=768, intermediate_size=3072,
                                              num_hidden_layers=12, num_attention_heads=12,
                                              max_position_embeddings=77)),
                 _t5_encoder(24, 32128)]
    return sum(map(_count, random)), sum(map(_count, published))


def wan2_2() -> tuple[int, int]:
    """Wan2.2: UMT5-XXL's encoder."""
    from diffrl.models.random_checkpoints.wan2_2 import real

    return (_count(_t5_encoder(real().text_encoder["num_layers"], VOCAB, umt5=True)),
            _count(_t5_encoder(24, 256384, umt5=True)))


def ltx2() -> tuple[int, int]:
    """LTX-2.3: Gemma 3 12B (with its SigLIP vision tower, as `Gemma3ForConditionalGeneration` loads it)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from diffrl.models.random_checkpoints.ltx2 import real

    s = real(text_layers=2)  # REAL_SIZES's depth
    random = Gemma3ForConditionalGeneration(Gemma3Config(text_config=dict(vocab_size=VOCAB + 3, **s.text),
                                                         vision_config=s.vision, mm_tokens_per_image=4))
    published = Gemma3ForConditionalGeneration(Gemma3Config(
        text_config=dict(vocab_size=262208, hidden_size=3840, intermediate_size=15360, num_hidden_layers=48,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=256),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14)))
    return _count(random), _count(published)


FAMILIES = {"qwen_image": qwen_image, "flux3_image": flux3_image, "flux1": flux1, "wan2_2": wan2_2, "ltx2": ltx2}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the table here")
    args = parser.parse_args(argv)
    from transformers.utils import logging

    logging.set_verbosity_error()  # the small vocabularies' token-id warnings
    rows = {}
    print(f"{'family':<12} {'random B':>9} {'published B':>12} {'adds GiB (bf16)':>16}")
    with torch.device("meta"):
        for name, build in FAMILIES.items():
            random, published = build()
            rows[name] = {"random_params_b": random / 1e9, "published_params_b": published / 1e9,
                          "adds_gib_bf16": 2 * (published - random) / 2**30}
            print(f"{name:<12} {random / 1e9:>9.2f} {published / 1e9:>12.2f} {rows[name]['adds_gib_bf16']:>16.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
