"""Demo models with random weights, in memory: pretraining starts from one (`real()` is the shipped model's
size), tests use `tiny()`. `family.save(path)` writes one in diffusers layout."""

from __future__ import annotations

import torch

from diffrl.data.ocr.prompts import scene_vocabulary
from diffrl.data.shapes import CATEGORIES, all_prompts
from diffrl.models.demo import DemoConfig, DemoFamily
from diffrl.models.random_checkpoints.tokenizers import build_quoted_char_tokenizer, build_word_tokenizer

# The worlds a demo model is made for: the shapes world (square images, word-level prompts) and the OCR world
# (one-line text renders, the quoted text tokenized character by character; docs/ocr-world.md), and the shapes
# world's editing world (the shapes vocabulary and the edit verbs, `EDIT_VERBS`; docs/editing-world.md).
WORLDS = ("shapes", "ocr", "shapes-edit")
# Words of edit instructions that shapes prompts lack, appended after the shapes vocabulary so that a shapes model's
# token ids stay the same in an editing model's tokenizer (`diffrl pretrain --world shapes-edit --init-from` it).
EDIT_VERBS = ("add", "make", "move", "remove")


def tiny() -> DemoConfig:
    """A demo model of a few thousand parameters (CPU tests)."""
    config = DemoConfig()
    config.transformer.update(num_layers=1, num_single_layers=1, attention_head_dim=8, num_attention_heads=2,
                              timestep_channels=16, axes_dims_rope=(2, 2, 2, 2))
    config.text_encoder.update(d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2)
    return config


def real() -> DemoConfig:
    """The shipped demo model's sizes."""
    return DemoConfig()


def ocr(config: DemoConfig | None = None) -> DemoConfig:
    """`config`'s transformer and text encoder (default: the shipped shapes model's) at the OCR world's image
    size and prompt length: 48×256 pixels in 4×4 patches (768 tokens), the smallest size measured at which both
    OCR readers read ≥ 95% of clean renders of the published test texts exactly (docs/ocr-world.md), and prompts of up to 96 tokens
    (the test split's longest is 84 with its quoted text spelled out). The text encoder's relative positions
    reach 64 tokens in 32 buckets (the shapes model's: 16 in 8), so it can tell letters' order apart."""
    config = config or DemoConfig()
    config.image_size, config.image_width, config.max_text_len = 48, 256, 96
    config.text_encoder.update(relative_attention_num_buckets=32, relative_attention_max_distance=64)
    return config


def tokenizer_for(world: str, max_length: int):
    if world not in WORLDS:
        raise ValueError(f"unknown world {world!r}; known: {', '.join(WORLDS)}")
    if world == "ocr":
        return build_quoted_char_tokenizer(scene_vocabulary(), max_length)
    extra = EDIT_VERBS if world == "shapes-edit" else ()
    return build_word_tokenizer([*shapes_vocabulary(), *extra], max_length)


def shapes_vocabulary() -> list[str]:
    """Every word of the shapes grammar, sorted (the demo tokenizer's vocabulary)."""
    return sorted({word for category in CATEGORIES for prompt in all_prompts(category) for word in prompt.split()})


def random_family(config: DemoConfig | None = None, seed: int = 0, *, batch_invariant: bool = True,
                  world: str = "shapes") -> DemoFamily:
    """A demo family of `config`'s sizes (default: `real()`) with fresh random weights and `world`'s tokenizer.
    `batch_invariant=False` for pretraining, where every row has its own timestep."""
    from diffusers import Flux3Transformer2DModel
    from transformers import T5Config, T5EncoderModel

    config = config or real()
    tokenizer = tokenizer_for(world, config.max_text_len)
    torch.manual_seed(seed)
    text_encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, **config.text_encoder,
    ))
    transformer = Flux3Transformer2DModel(
        in_channels=config.in_channels, cond_in_channels=config.in_channels,
        joint_attention_dim=config.text_encoder["d_model"], **config.transformer,
    )
    return DemoFamily(config, transformer, text_encoder, tokenizer, batch_invariant=batch_invariant)
