"""Shallow Qwen-VL text encoders for the random checkpoints of the families that encode prompts with one
(flux3_image: Qwen3-VL, krea2: Qwen3-VL, qwen_image: Qwen2.5-VL): the keywords of their configs."""

from __future__ import annotations

from diffrl.models.random_checkpoints.tokenizers import QWEN_SPECIAL_TOKENS


def text_config(vocab_size: int, hidden: int, layers: int, heads: int) -> dict:
    """One key-value head, an MLP twice as wide, and the rotary sections (t, h, w) splitting half a head 2:1:1."""
    half_head = hidden // heads // 2
    return {"vocab_size": vocab_size, "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": 1,
            "rope_scaling": {"rope_type": "default",
                             "mrope_section": [half_head - 2 * (half_head // 4), half_head // 4, half_head // 4]}}


def special_token_ids(tokenizer) -> dict:
    """bos, eos and pad as Qwen's tokenizers set them."""
    endoftext, im_end = (tokenizer.convert_tokens_to_ids(t) for t in (QWEN_SPECIAL_TOKENS[0], QWEN_SPECIAL_TOKENS[2]))
    return {"bos_token_id": endoftext, "eos_token_id": im_end, "pad_token_id": endoftext}


def vision_config(out_hidden: int, **extra) -> dict:
    """The smallest vision tower (text-to-image never runs it)."""
    return {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": out_hidden,
            **extra}
