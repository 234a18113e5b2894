"""Cosmos3 checkpoints with random weights, in diffusers layout, built in code (no download).

`tiny()` is for tests: a two-layer transformer, a Wan VAE of a few channels (4× in time, 8× in space) and a
word-level tokenizer with Qwen's chat markers. `real()` is the diffusers classes' default transformer (hidden
4,096, 36 layers of both pathways, 48 latent channels) with a Wan2.2-style VAE (48 channels, 16× in space), for
GPU benchmarks (random weights and latent statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>")
# Enough words (space-separated) for the pipeline's system messages, metadata sentences and a few test prompts.
TOKENIZER_WORDS = (
    "you are a helpful assistant who will generate images videos from give prompt the this video image is not of "
    "seconds long and fps resolution x system user red green blue yellow cat dog robot car street kitchen walks "
    "drives in on blurry ugly")
# Qwen's ChatML layout, which the pipeline's `apply_chat_template` call renders.
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer():
    """A word-level tokenizer with a chat template; digits and punctuation are tokens of their own."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, "<unk>", "\n", *".,:'\"", *"0123456789"))}
    for word in TOKENIZER_WORDS.split():
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n|\d|[^\w\s]"), behavior="isolated"),
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                        eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@dataclass
class Cosmos3Sizes:
    transformer: dict = field(default_factory=dict)
    vae: dict = field(default_factory=dict)


def tiny() -> Cosmos3Sizes:
    """About 50 k parameters: 8 × 8 pixels are one latent pixel, 16 × 16 one patch token."""
    transformer = {"hidden_size": 32, "head_dim": 16, "num_attention_heads": 2, "num_key_value_heads": 1,
                   "intermediate_size": 64, "num_hidden_layers": 2, "latent_channel": 4, "latent_patch_size": 2,
                   "patch_latent_dim": 16, "rope_axes_dim": [4, 2, 2]}
    vae = {"base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
           "temperal_downsample": [False, True, True]}
    return Cosmos3Sizes(transformer, vae)


def real() -> Cosmos3Sizes:
    """`Cosmos3OmniTransformer`'s defaults and a VAE of Wan2.2's shape (patch 2, 16× in space, 48 channels)."""
    vae = {"base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
           "temperal_downsample": [False, True, True], "is_residual": True, "in_channels": 12, "out_channels": 12,
           "patch_size": 2, "scale_factor_spatial": 16, "scale_factor_temporal": 4}
    return Cosmos3Sizes({}, vae)


def save_random_checkpoint(path: str | Path, sizes: Cosmos3Sizes | None = None, *, seed: int = 0,
                           scheduler: str = "euler", shift: float = 3.0, native_flow_schedule: bool = False,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Cosmos3 checkpoint written by `Cosmos3OmniPipeline.save_pretrained` (default sizes: `tiny()`), with random
    latent statistics so that decoding exercises them. `scheduler`: "euler" (FlowMatchEulerDiscreteScheduler,
    which our Euler steps reproduce exactly) or "unipc" (the published kind, flow σ's)."""
    from diffusers import (
        AutoencoderKLWan,
        Cosmos3OmniTransformer,
        FlowMatchEulerDiscreteScheduler,
        UniPCMultistepScheduler,
    )
    from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

    sizes = sizes or tiny()
    torch.manual_seed(seed)
    tokenizer = build_tokenizer()
    transformer_config = dict(sizes.transformer)
    if "vocab_size" not in transformer_config and transformer_config:  # tiny: the tokenizer's vocabulary
        transformer_config["vocab_size"] = len(tokenizer)
    z_dim = sizes.vae.get("z_dim", 16)
    generator = torch.Generator().manual_seed(seed)
    latents_mean = (0.3 * torch.randn(z_dim, generator=generator)).tolist()
    latents_std = (0.5 + torch.rand(z_dim, generator=generator)).tolist()

    def stored(module):  # fp32 as built; another dtype cast as a whole
        return module if dtype == torch.float32 else module.to(dtype)

    with torch.device(device):
        transformer = stored(Cosmos3OmniTransformer(**transformer_config))
        vae = stored(AutoencoderKLWan(latents_mean=latents_mean, latents_std=latents_std, **sizes.vae))
    if scheduler == "euler":
        sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    elif scheduler == "unipc":
        sched = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=shift,
                                        final_sigmas_type="zero")
    else:
        raise ValueError(f"scheduler {scheduler!r}: 'euler' or 'unipc'")
    pipe = Cosmos3OmniPipeline(transformer=transformer, text_tokenizer=tokenizer, vae=vae, scheduler=sched,
                               enable_safety_checker=False, use_native_flow_schedule=native_flow_schedule)
    pipe.save_pretrained(path, safe_serialization=True)
    return Path(path)
