"""The `krea2` family: Krea 2 (diffusers' `Krea2Transformer2DModel`, driven by `Krea2Pipeline`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   Krea2Transformer2DModel   vae/        AutoencoderKLQwenImage (16 latent channels, f8)
    text_encoder/  Qwen3VLModel              scheduler/  FlowMatchEulerDiscreteScheduler (dynamic shift)
    tokenizer/     the Qwen3-VL tokenizer    model_index.json  the pipeline's own settings (below)

`model_index.json` carries what `Krea2Pipeline` registers in its config: `text_encoder_select_layers` (which
hidden states of the text encoder are stacked), `is_distilled` (the few-step checkpoint) and `patch_size`.
Missing, they take the pipeline's defaults. Its `diffrl` block may set `max_sequence_length` (the pipeline's
call argument, 512) and `default_size` (1024); the tiny test checkpoints make both small.

What this adapter reproduces of diffusers' `Krea2Pipeline` (checked by `tests/test_krea2.py`):
- prompt encoding: Qwen-Image's system/user template prefix plus the prompt, truncated and right-padded to
  `max_sequence_length + 34 − 5` tokens, then the 5-token assistant suffix appended *after* the padding, so the
  window is `[prefix | prompt | padding | suffix]`. Qwen3-VL runs it with the padding masked and position ids
  that count real tokens only (the suffix keeps the phase it had next to the prompt); the selected hidden states
  are stacked per token and the 34 prefix tokens dropped: a fixed window of `max_sequence_length` tokens and its
  boolean mask (real prompt tokens and the suffix);
- latents: the VAE's `[B, 16, H/8, W/8]` noise, packed into 2×2 patches `[B, h·w, 64]`; position ids are zeros
  for text and `(0, row, column)` for image tokens, one table for the whole `[text, image]` sequence;
- schedule: the scheduler's own for `linspace(1, 1/N, N)`, with the dynamic shift μ linear in the number of
  image tokens over the scheduler's `base/max_image_seq_len` and `base/max_shift` (the pipeline's defaults
  256, 6400, 0.5, 1.15); the distilled checkpoint uses μ = 1.15 at every size. The transformer's timestep is
  the scheduler's timestep (σ·1000) divided by `num_train_timesteps`, as the pipeline computes it;
- CFG in Krea's form `cond + g·(cond − uncond)`; the pipeline's scale g is on for g > 0 and equals the usual
  scale s = 1 + g. Requests carry the usual scale, as for every family (`guidance_scale`, on above 1; the
  pipeline's default g = 4.5 is s = 5.5). The pipeline runs the two halves as two forwards; here they share one;
- decode: tokens unpacked to `[B, 16, 1, H/8, W/8]`, `latents · std + mean` with the VAE's `latents_std` /
  `latents_mean` (the pipeline's arithmetic), decoded, first frame, `x/2 + 0.5` clamped.

The conditioning travels as the one tensor every family carries: `PromptEmbeds.embeds` is
`[B, L, layers·D + 1]`, each token's stacked hidden states (layer-major) followed by one channel holding its
text mask (1 real, 0 padding). `velocity` unpacks both, so the denoising env and the trainer replay the exact
forward without a separate mask. Every prompt has the same window, so prompts, negative prompts and
microgroups always share a batch.

Batching (the `krea2-nft-*` recipes run DiffusionNFT with microgroup 1, as the published run does): nothing in
diffusers' Krea 2 makes a batch incorrect. The text is a fixed window with a per-row key-padding mask (not packed,
not variable length), the timestep modulation is per row and the position table is shared by rows of one resolution.
So requests of several outputs are served as one batch, and sample k is bit-identical in any microgroup on CPU (the
timestep MLP and its modulation projection, the only matmuls whose row count is the batch size, run one distinct row
at a time there). So the recipes' microgroup 1 (with NFT) is not needed for correctness; what it bounds is size: the
transformer has 12.8 B parameters, a 1024² sample is 512 text + 4,096 image tokens in every block, and one prompt's
conditioning (512 tokens × 12 layers × 2,560, fp32) is 63 MB, repeated per output.

Refused with a `ModelLoadError`: a transformer whose input channels are not the VAE's channels in patches, a
text encoder or layer selection that does not fit the transformer's text input, a tokenizer that does not split
the template into the 34 + 5 tokens the pipeline cuts at, and scheduler options that change the step
(`stochastic_sampling`, `invert_sigmas`). Image-conditioned requests are refused by the engine.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffrl.errors import ModelLoadError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    register_family,
    require_pixel_multiple,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import read_settings, refuse_scheduler_options
from diffrl.models.qwen_vae import decode_latents, pack_latents
from diffrl.sampling import randn_per_sample, resolution_mu

# The pipeline's text layout: this prefix (34 tokens with Qwen's tokenizer, dropped from the conditioning), the
# prompt, padding, then this suffix (5 tokens).
TEMPLATE_PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
# Krea 2's taps of Qwen3-VL-4B's 37 hidden states (0 is the embedding output).
DEFAULT_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
DISTILLED_MU = 1.15  # the few-step checkpoint's fixed shift
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas")


@dataclass
class Krea2Settings:
    """Per-checkpoint values outside the components' configs: the pipeline's registered config
    (`text_encoder_select_layers`, `is_distilled`, `patch_size`, top level of model_index.json) and this
    adapter's (`max_sequence_length`, `default_size`, its `diffrl` block)."""

    text_encoder_select_layers: tuple[int, ...] = DEFAULT_SELECT_LAYERS
    is_distilled: bool = False
    patch_size: int = 2
    max_sequence_length: int = 512
    default_size: int = 1024


def _check_template(tokenizer) -> None:
    """The pipeline cuts the window at fixed token counts: the tokenizer must split the template's prefix into
    34 tokens (also with a prompt after it) and its suffix into 5."""
    prefix = list(tokenizer(TEMPLATE_PREFIX)["input_ids"])
    in_context = list(tokenizer(TEMPLATE_PREFIX + "a cat")["input_ids"][:PREFIX_TOKENS])
    suffix = list(tokenizer(TEMPLATE_SUFFIX)["input_ids"])
    if len(prefix) != PREFIX_TOKENS or in_context != prefix or len(suffix) != SUFFIX_TOKENS:
        raise ModelLoadError(f"krea2: the tokenizer splits the prompt template into {len(prefix)} + {len(suffix)} "
                             f"tokens; Krea 2 cuts it at {PREFIX_TOKENS} + {SUFFIX_TOKENS} (is this Qwen's tokenizer?)")


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the timestep
    embedding (sinusoid and MLP) and the shared modulation projection are the only layers whose matmul row count is
    the batch size; they run one distinct row at a time. (Each block and the final layer only add a learned table to
    that modulation.) Not on GPU, where batched kernels differ anyway."""
    # `timestep=False`: their outputs keep a token axis of 1, which the shared-timestep shortcut does not expand.
    embed_rows_one_at_a_time(transformer.time_embed, timestep=False)
    embed_rows_one_at_a_time(transformer.time_mod_proj, timestep=False)


def image_position_ids(h: int, w: int, device=None) -> torch.Tensor:
    """(0, row, column) of each image token `[h·w, 3]`."""
    rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1)


@register_family
class Krea2Family(FamilyAdapter):
    name = "krea2"
    name_patterns = ("krea2", "krea-2", "krea_2")
    display_name = "Krea 2"
    default_guidance_scale = 5.5  # the pipeline's default g = 4.5 in Krea's form (s = 1 + g)
    default_num_inference_steps = 28  # diffusers' Krea 2 default (sglang-diffusion has no Krea 2)
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes them / 1000
    # The gated attention's projections: the 28 single-stream blocks' and the text fusion's (peft matches by suffix).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:Krea2Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKLQwenImage"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Qwen3VLModel", text_encoder=True),
    )

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, *, settings: Krea2Settings | None = None):
        settings = settings or Krea2Settings()
        config = transformer.config
        patch = settings.patch_size
        if config.in_channels != vae.config.z_dim * patch**2:
            raise ModelLoadError(f"krea2: the transformer takes {config.in_channels} channels; {patch}x{patch} patches "
                                 f"of the VAE's {vae.config.z_dim} latent channels are {vae.config.z_dim * patch**2}")
        layers = settings.text_encoder_select_layers
        if len(layers) != config.num_text_layers:
            raise ModelLoadError(f"krea2: text_encoder_select_layers has {len(layers)} entries, the transformer fuses "
                                 f"{config.num_text_layers} text-encoder layers")
        if text_encoder is not None:
            text_config = text_encoder.config.text_config
            if text_config.hidden_size != config.text_hidden_dim:
                raise ModelLoadError(f"krea2: the text encoder is {text_config.hidden_size} wide, the transformer "
                                     f"reads {config.text_hidden_dim}-wide text")
            if not all(0 <= k <= text_config.num_hidden_layers for k in layers):
                raise ModelLoadError(f"krea2: text_encoder_select_layers {list(layers)} out of range for a text "
                                     f"encoder of {text_config.num_hidden_layers} layers (hidden states 0.."
                                     f"{text_config.num_hidden_layers})")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        _check_template(tokenizer)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        if settings.is_distilled:
            self.default_guidance_scale = 1.0  # the few-step checkpoint samples without CFG (g = 0)
            self.default_num_inference_steps = 8  # diffusers' advice for the few-step checkpoint
        self.vae_scale = 2 ** len(vae.config.temperal_downsample)
        self.pixels_per_token = self.vae_scale * patch

    def reference_pipeline(self):
        """diffusers' `Krea2Pipeline` over this family's own components (a copy of the scheduler, whose state
        sampling changes): what the tests check the engine against."""
        from diffusers import Krea2Pipeline

        settings = self.settings
        return self.pipeline_over_components(Krea2Pipeline, is_distilled=settings.is_distilled,
                                             text_encoder_select_layers=settings.text_encoder_select_layers,
                                             patch_size=settings.patch_size)

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> Krea2Settings:
        """The pipeline's registered config (top level of model_index.json), then the `diffrl` block."""
        index_file = root / "model_index.json"
        registered = {key: index[key] for key in ("text_encoder_select_layers", "is_distilled", "patch_size")
                      if key in index}
        settings = read_settings(Krea2Settings, index, index_file, **registered)
        settings.text_encoder_select_layers = tuple(int(k) for k in settings.text_encoder_select_layers)
        if settings.max_sequence_length < 1 or settings.patch_size < 1:
            raise ModelLoadError(f"{index_file}: max_sequence_length and patch_size must be positive")
        return settings

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        step = self.pixels_per_token
        require_pixel_multiple("Krea 2", step, height=height, width=width)

    def shift_mu(self, height: int, width: int) -> float:
        """The schedule's μ: fixed for the distilled checkpoint, else linear in the number of image tokens."""
        if self.settings.is_distilled:
            return DISTILLED_MU
        config = self.scheduler.config
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return resolution_mu(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 6400),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=self.shift_mu(height, width),
                                device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def text_window(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask `[1, 34 + L]` of `[prefix | prompt | padding | suffix]` (the prefix not yet dropped)."""
        length = self.settings.max_sequence_length + PREFIX_TOKENS - SUFFIX_TOKENS
        text = self.tokenizer(TEMPLATE_PREFIX + prompt, truncation=True, padding="max_length", max_length=length,
                              padding_side="right", return_tensors="pt")
        suffix = self.tokenizer(TEMPLATE_SUFFIX, return_tensors="pt")
        ids = torch.cat([text["input_ids"], suffix["input_ids"]], dim=1)
        mask = torch.cat([text["attention_mask"], suffix["attention_mask"]], dim=1).bool()
        return ids, mask

    def _encode_one(self, prompt: str) -> torch.Tensor:
        """One prompt's conditioning `[L, layers·D + 1]` (fp32): stacked hidden states, then the mask channel."""
        ids, mask = self.text_window(prompt)
        device = next(self.text_encoder.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        # Padding takes no position: each token's position is the number of real tokens before it (all 3 mRoPE axes).
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)[None].expand(3, -1, -1)
        out = self.text_encoder(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[k] for k in self.settings.text_encoder_select_layers], dim=2)
        hidden = hidden[0, PREFIX_TOKENS:].flatten(1).float()  # [L, layers·D], layer-major per token
        return torch.cat([hidden, mask[0, PREFIX_TOKENS:, None].float()], dim=1)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt encoded on its own (its conditioning never depends on the prompts beside it); every
        window has `max_sequence_length` tokens, so they stack."""
        if self.text_encoder is None:
            raise RuntimeError("this Krea 2 model was loaded without its text encoder")
        embeds = torch.stack([self._encode_one(p) for p in prompts])
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 3, device=embeds.device))

    def unpack_conditioning(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stacked hidden states `[B, L, layers, D]`, text mask `[B, L]` bool) from the packed conditioning."""
        config = self.transformer.config
        hidden = embeds[..., :-1].unflatten(-1, (config.num_text_layers, config.text_hidden_dim))
        return hidden, embeds[..., -1] > 0.5

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        patch = self.settings.patch_size
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        shape = (len(generators), self.vae.config.z_dim, h * patch, w * patch)  # what the pipeline draws per sample
        tokens = pack_latents(randn_per_sample(shape, generators, device=self.device), patch)
        return Latents(tokens, image_position_ids(h, w, device=self.device))

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        text, mask = self.unpack_conditioning(cond.embeds)
        position_ids = torch.cat([cond.ids.to(latents.ids), latents.ids])  # [text | image] `[L + S, 3]`
        # The scheduler's timestep (σ·1000) divided by num_train_timesteps, as the pipeline does.
        train_steps = self.scheduler.config.num_train_timesteps
        timestep = sigma * train_steps / train_steps
        with self.forward_precision():
            return transformer(hidden_states=latents.tokens.to(dtype), encoder_hidden_states=text.to(dtype),
                               timestep=timestep.to(dtype), position_ids=position_ids, encoder_attention_mask=mask,
                               return_dict=False)[0].float()

    def reference_guidance_scale(self, guidance_scale: float) -> float:
        return guidance_scale - 1.0  # the pipeline's g: CFG off at 0

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma) -> torch.Tensor:
        return v_cond + (guidance_scale - 1.0) * (v_cond - v_uncond)  # Krea's form, g = s − 1

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              self.settings.patch_size, per_call=self.vae_decode_batch)
