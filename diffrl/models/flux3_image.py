"""The `flux3_image` family: FLUX 3 Image Klein (diffusers' `Flux3Transformer2DModel`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   Flux3Transformer2DModel          vae/        AutoencoderKLFlux2 (with its latent BatchNorm)
    text_encoder/  Qwen3VLForConditionalGeneration  scheduler/  FlowMatchEulerDiscreteScheduler config
    tokenizer/     the Qwen3-VL tokenizer and its chat template

What this adapter reproduces of diffusers' FLUX 3 pipeline (checked by `tests/test_flux3_image.py`):
- a prompt goes through the chat template and is right-padded to a multiple of 80 tokens (the
  transformer attends to the padding, so the window is part of the model); the conditioning is the
  hidden states of layers 4, 8, …, 32 stacked along the channels;
- latents are the VAE's 2×2-patchified channels, normalized by the VAE's BatchNorm statistics and
  packed to tokens; position ids are (t, h, w, l) with h, w scaled by the image RoPE scale 0.5;
- the transformer takes σ itself as its timestep (the scheduler's timesteps are σ·1000);
- CFG is `uncond + s·(cond − uncond)`; at s ≤ 1 a step is one conditional forward.
Image-conditioned requests are refused (text to image only), and so is the step-distilled (flow-map)
variant, which samples with a different transition.

`save_random_checkpoint` writes a checkpoint of this layout with random weights at any size: tests use
tiny ones, benchmarks the class defaults.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.errors import ModelLoadError
from diffrl.models.base import FamilyAdapter, Latents, PromptEmbeds, read_json, require_pixel_multiple
from diffrl.models.batch_invariance import (
    decode_rows,
    embed_rows_one_at_a_time,
    one_value_for_all_rows,
    rows_share_one_timestep,
)
from diffrl.models.registry import register_family
from diffrl.models.weights import require_finite_modules
from diffrl.sampling import make_sigmas, randn_per_sample

DEFAULT_TEXT_LAYERS = (4, 8, 12, 16, 20, 24, 28, 32)
TEXT_PAD_MULTIPLE = 80
IMAGE_ROPE_SCALE = 0.5
DEFAULT_SHIFT = 6.93  # diffusers' FLUX 3 pipeline default, used when the checkpoint has no scheduler config
MAX_TEXT_TOKENS = 8192


@dataclass
class Flux3Settings:
    """Per-checkpoint values that are not in the components' own configs. A checkpoint may override
    them in the `diffrl` block of its model_index.json (the tiny test checkpoints do: their text
    encoder has fewer than 32 layers)."""

    text_encoder_out_layers: tuple[int, ...] = DEFAULT_TEXT_LAYERS
    text_pad_multiple: int = TEXT_PAD_MULTIPLE
    image_rope_scale: float = IMAGE_ROPE_SCALE
    default_size: int = 1024


def image_position_ids(height_tokens: int, width_tokens: int, rope_scale: float, device=None) -> torch.Tensor:
    """(t, h, w, l) of each image token, h and w scaled by the image RoPE scale, l = 0 (the generated image)."""
    h = torch.arange(height_tokens, device=device, dtype=torch.float32).repeat_interleave(width_tokens)
    w = torch.arange(width_tokens, device=device, dtype=torch.float32).repeat(height_tokens)
    zeros = torch.zeros_like(h)
    return torch.stack([zeros, h * rope_scale, w * rope_scale, zeros], dim=1)


def text_position_ids(length: int, device=None) -> torch.Tensor:
    """(0, 0, 0, k) for text token k."""
    ids = torch.zeros(length, 4, device=device)
    ids[:, 3] = torch.arange(length, device=device, dtype=torch.float32)
    return ids


def _static_shift(scheduler_dir: Path) -> float:
    """The scheduler's static shift; the schedule options this adapter does not reproduce are refused."""
    config_file = scheduler_dir / "scheduler_config.json"
    if not config_file.is_file():
        return DEFAULT_SHIFT
    config = read_json(config_file)
    unsupported = [key for key in ("use_dynamic_shifting", "use_karras_sigmas", "use_exponential_sigmas",
                                   "use_beta_sigmas", "invert_sigmas", "stochastic_sampling") if config.get(key)]
    if config.get("shift_terminal"):
        unsupported.append("shift_terminal")
    if unsupported:
        raise ModelLoadError(f"{config_file}: unsupported scheduler options {unsupported} (flux3_image samples "
                             "with the static shift of FLUX 3's FlowMatchEulerDiscreteScheduler)")
    return float(config.get("shift", 1.0))


@register_family
class Flux3ImageFamily(FamilyAdapter):
    name = "flux3_image"
    name_patterns = ("flux3", "flux.3", "flux-3")
    default_guidance_scale = 3.5  # diffusers' FLUX 3 pipeline default
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes σ
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out")
    block_lists = ("mode_blocks", "txt_mode_blocks", "single_transformer_blocks")

    def __init__(self, transformer, vae, text_encoder, tokenizer, *, shift: float, settings: Flux3Settings):
        if getattr(transformer.config, "flow_map", False):
            raise ModelLoadError("this is the step-distilled FLUX 3 (flow_map=True), which samples with its own "
                                 "transition; flux3_image trains and samples the base model only")
        self.transformer = transformer
        embed_rows_one_at_a_time(transformer.timestep_embedder)  # sample k is the same in any batch
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.shift = shift
        self.settings = settings
        # VAE pixels per latent token side: the VAE's downsampling, then the 2x2 patchify.
        self.pixels_per_token = 2 ** (len(vae.config.block_out_channels) - 1) * 2

    # ---------------------------------------------------------------- load
    @classmethod
    def load(cls, model_path, *, device="cpu", dtype=torch.float32, load_text_encoder=True) -> Flux3ImageFamily:
        from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        root = Path(model_path)
        if not root.is_dir():
            raise ModelLoadError(f"model directory not found: {root}")
        for component in ("transformer", "vae", "tokenizer") + (("text_encoder",) if load_text_encoder else ()):
            read_json(root / component / ("config.json" if component != "tokenizer" else "tokenizer_config.json"))
        settings = Flux3Settings()
        index_file = root / "model_index.json"
        if index_file.is_file():
            overrides = dict(read_json(index_file).get("diffrl", {}))
            overrides.pop("family", None)
            try:
                settings = Flux3Settings(**overrides)
            except TypeError as err:
                raise ModelLoadError(f"corrupt file: {index_file} (bad 'diffrl' block: {err})") from None
            settings.text_encoder_out_layers = tuple(settings.text_encoder_out_layers)
        try:
            transformer = Flux3Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype,
                                                                  local_files_only=True)
            vae = AutoencoderKLFlux2.from_pretrained(root / "vae", torch_dtype=dtype, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
            text_encoder = (Qwen3VLForConditionalGeneration.from_pretrained(
                str(root / "text_encoder"), dtype=dtype, local_files_only=True) if load_text_encoder else None)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the FLUX 3 checkpoint {root}: {str(err).splitlines()[0]}") from None
        if tokenizer.chat_template is None:
            raise ModelLoadError(f"{root / 'tokenizer'}: the tokenizer has no chat template (FLUX 3 encodes "
                                 "prompts through it)")
        for module in (transformer, vae, text_encoder):
            if module is not None:
                module.to(device=device).eval().requires_grad_(False)
        require_finite_modules(root, {"transformer": transformer, "vae": vae, "text_encoder": text_encoder})
        return cls(transformer, vae, text_encoder, tokenizer, shift=_static_shift(root / "scheduler"),
                   settings=settings)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        step = self.pixels_per_token
        require_pixel_multiple("FLUX 3", step, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return make_sigmas(num_steps, shift=self.shift, device=self.device)

    def text_window(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt through the chat template, right-padded to a multiple of the pad size: (ids, mask) [1, L]."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True)
        length = len(self.tokenizer(text, truncation=True, max_length=MAX_TEXT_TOKENS)["input_ids"])
        multiple = self.settings.text_pad_multiple
        window = min(math.ceil(length / multiple) * multiple, MAX_TEXT_TOKENS)
        batch = self.tokenizer(text, return_tensors="pt", padding="max_length", padding_side="right",
                               truncation=True, max_length=window)
        return batch["input_ids"], batch["attention_mask"]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt's stacked hidden states. Prompts whose windows differ cannot share a batch (the
        transformer attends to the padding, so padding further would change the image): refused."""
        if self.text_encoder is None:
            raise RuntimeError("this FLUX 3 model was loaded without its text encoder")
        windows = [self.text_window(p) for p in prompts]
        lengths = sorted({ids.shape[1] for ids, _ in windows})
        if len(lengths) > 1:
            raise ValueError(f"prompts with text windows of {lengths} tokens cannot be encoded as one batch; "
                             "encode them separately")
        device = next(self.text_encoder.parameters()).device
        input_ids = torch.cat([ids for ids, _ in windows]).to(device)
        mask = torch.cat([m for _, m in windows]).to(device)
        # Padding positions get position id 1, as in the environment FLUX 3 was trained in (transformers 4.57).
        position_ids = torch.arange(input_ids.shape[1], device=device)[None].masked_fill(mask == 0, 1)
        out = self.text_encoder(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                output_hidden_states=True, use_cache=False)
        layers = torch.stack([out.hidden_states[k] for k in self.settings.text_encoder_out_layers], dim=2)
        embeds = layers.flatten(2)  # [B, L, layers·D], channel-major per token as diffusers stacks them
        return PromptEmbeds(embeds, text_position_ids(embeds.shape[1], device=device))

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        channels = self.transformer.config.in_channels
        noise = randn_per_sample((len(generators), channels, h, w), generators, device=self.device)
        tokens = noise.flatten(2).transpose(1, 2)  # [B, h·w, C]
        return Latents(tokens, image_position_ids(h, w, self.settings.image_rope_scale, device=self.device))

    def velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        with rows_share_one_timestep(one_value_for_all_rows(sigma)):
            return self._velocity(transformer, latents, sigma, cond, uncond, guidance_scale)

    def _velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        tokens = latents.tokens
        sigma = torch.as_tensor(sigma, device=tokens.device, dtype=torch.float32).expand(tokens.shape[0])
        dtype = next(transformer.parameters()).dtype

        def forward(x, embeds: PromptEmbeds, t):
            with self.forward_precision():
                return transformer(hidden_states=x.to(dtype), encoder_hidden_states=embeds.embeds.to(dtype),
                                   timestep=t.to(dtype), img_ids=latents.ids, txt_ids=embeds.ids,
                                   return_dict=False)[0].float()

        if guidance_scale <= 1.0:  # CFG off: one conditional forward per step
            return forward(tokens, cond, sigma)
        if uncond is None:
            raise ValueError("guidance_scale > 1 needs the unconditional (negative) conditioning")
        if torch.equal(uncond.ids, cond.ids):  # same text window: one forward for both halves
            v_uncond, v_cond = forward(torch.cat([tokens, tokens]), uncond.cat(cond), torch.cat([sigma, sigma])).chunk(2)
        else:
            v_uncond, v_cond = forward(tokens, uncond, sigma), forward(tokens, cond, sigma)
        return v_uncond + guidance_scale * (v_cond - v_uncond)

    def _latent_stats(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        bn = self.vae.bn
        mean = bn.running_mean.view(1, -1, 1, 1).to(dtype)
        std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + self.vae.config.batch_norm_eps).to(dtype)
        return mean, std

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        batch, _, channels = latents.shape
        grid = latents.view(batch, h, w, channels).permute(0, 3, 1, 2)
        mean, std = self._latent_stats(grid.dtype)
        grid = grid * std + mean
        # Undo the 2x2 patchify: [B, C·4, h, w] → [B, C, 2h, 2w].
        grid = grid.reshape(batch, channels // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
        grid = grid.reshape(batch, channels // 4, h * 2, w * 2)
        vae_dtype = next(self.vae.parameters()).dtype
        images = decode_rows(lambda rows: self.vae.decode(rows.to(vae_dtype), return_dict=False)[0], grid)
        return (images.float() / 2 + 0.5).clamp(0, 1)


# -------------------------------------------------------------------- random checkpoints
@dataclass
class Flux3Sizes:
    """Component sizes of a random checkpoint. The defaults are tiny (tests); `class_defaults()` is
    `Flux3Transformer2DModel`'s default configuration (5.5 B parameters) with the real VAE (benchmarks)."""

    transformer: dict = field(default_factory=lambda: dict(
        num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
        timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)))
    text_hidden: int = 32
    text_layers: int = 4
    text_encoder_out_layers: tuple[int, ...] = (2, 4)
    text_heads: int = 2
    vae: dict = field(default_factory=lambda: dict(
        block_out_channels=(16, 16), layers_per_block=1, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2))
    default_size: int = 32

    @classmethod
    def class_defaults(cls) -> Flux3Sizes:
        """The transformer and VAE at the diffusers classes' defaults (20,480-wide text input = 8 stacked
        layers of a 2,560-wide encoder). The text encoder keeps that width but only 8 layers: a prompt is
        encoded once per request, so its depth does not change what a benchmark of sampling and training
        measures. 1024² by default, as the family rolls out."""
        return cls(transformer={}, text_hidden=2560, text_layers=8, text_encoder_out_layers=tuple(range(1, 9)),
                   text_heads=20, vae={}, default_size=1024)


def build_chat_tokenizer():
    """A character-level tokenizer with the Qwen chat markers and a chat template, made in code."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials)}
    for code in range(32, 127):
        vocab.setdefault(chr(code), len(vocab))
    vocab.setdefault("\n", len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


def save_random_checkpoint(path: str | Path, sizes: Flux3Sizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A FLUX 3 checkpoint in diffusers layout with random weights (no download), including random
    latent BatchNorm statistics so that decoding exercises them; built on `device`, stored in `dtype`."""
    from diffusers import AutoencoderKLFlux2, Flux3Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    sizes = sizes or Flux3Sizes()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_chat_tokenizer()
    heads = sizes.text_heads
    half_head = sizes.text_hidden // heads // 2  # the rotary sections (t, h, w) split half a head: 2:1:1
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=sizes.text_hidden,
                             intermediate_size=2 * sizes.text_hidden, num_hidden_layers=sizes.text_layers,
                             num_attention_heads=heads, num_key_value_heads=1, head_dim=sizes.text_hidden // heads,
                             rope_scaling={"rope_type": "default", "mrope_section": [
                                 half_head - 2 * (half_head // 4), half_head // 4, half_head // 4]}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=sizes.text_hidden, deepstack_visual_indexes=[0])))
        vae = AutoencoderKLFlux2(**sizes.vae)
        with torch.no_grad():
            vae.bn.running_mean.normal_(0, 0.5)
            vae.bn.running_var.uniform_(0.5, 2.0)
        channels = 4 * vae.config.latent_channels
        transformer = Flux3Transformer2DModel(
            in_channels=channels, cond_in_channels=channels,
            joint_attention_dim=sizes.text_hidden * len(sizes.text_encoder_out_layers), **sizes.transformer)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    (path / "scheduler").mkdir(parents=True, exist_ok=True)
    (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": DEFAULT_SHIFT}))
    index = {
        "_class_name": "Flux3ModularPipeline",
        "transformer": ["diffusers", "Flux3Transformer2DModel"], "vae": ["diffusers", "AutoencoderKLFlux2"],
        "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "diffrl": {"family": Flux3ImageFamily.name, "text_encoder_out_layers": list(sizes.text_encoder_out_layers),
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
