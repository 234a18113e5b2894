"""The `flux1` family: FLUX.1 [dev] and FLUX.1 [schnell] (diffusers' `FluxTransformer2DModel`, driven by
`FluxPipeline`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/     FluxTransformer2DModel      vae/          AutoencoderKL (16 latent channels, f8)
    text_encoder/    CLIPTextModel (CLIP-L)      tokenizer/    its CLIP tokenizer
    text_encoder_2/  T5EncoderModel (T5-XXL)     tokenizer_2/  its T5 tokenizer
    scheduler/       FlowMatchEulerDiscreteScheduler (dev: dynamic shift; schnell: static shift 1)

Its model_index.json may carry a `diffrl` block with `guidance` (the embedded guidance scale of a
guidance-distilled checkpoint, 3.5 by default as the pipeline's), `max_sequence_length` (T5 tokens: 512 for dev,
256 for schnell by default) and `default_size` (1024).

What this adapter reproduces of diffusers' `FluxPipeline` (checked by `tests/test_flux1.py`):
- conditioning: T5's last hidden state over a window of `max_sequence_length` tokens (right-padded, truncated) and
  CLIP-L's pooled output over 77 tokens. The pooled vector travels as one extra token at the end of the
  conditioning (zero-padded to T5's width), so engine, trainer and wire carry one tensor as for every family;
  text position ids are zeros `[L + 1, 3]` (the transformer gets the first L);
- latents: the VAE's `[B, 16, H/8, W/8]` noise packed into 2×2 patches `[B, h·w, 64]`, position ids
  `(0, row, column)`; decoded as `latents / scaling_factor + shift_factor`;
- schedule: the scheduler's own for `linspace(1, 1/N, N)` with μ linear in the number of image tokens (the
  scheduler's `base/max_image_seq_len` and `base/max_shift`, defaults 256, 4096, 0.5, 1.15); a static-shift
  scheduler (schnell's) ignores μ, as in the pipeline. The transformer takes σ (the scheduler's timestep / 1000);
- guidance: FLUX.1 [dev] is guidance-distilled: every forward gets the embedded guidance scale (the checkpoint's
  `guidance`), as the pipeline's `guidance_scale` feeds it. A request's `guidance_scale` is true CFG on top
  (`uncond + s·(cond − uncond)`, the pipeline's `true_cfg_scale` with a negative prompt; off at s ≤ 1, the
  default), as sglang-diffusion reads it for FLUX.1 (its embedded scale is a server setting too). Schnell has no
  guidance embedding.
- FLUX.1 Kontext (a checkpoint whose model_index.json names `FluxKontextPipeline`; the same transformer) takes one
  condition image per request (`image_path`), as `FluxKontextPipeline` does: the image at its own size floored to
  a multiple of `pixels_per_token` (Lanczos, the pipeline without `_auto_resize`: resize sources to a Kontext
  resolution beforehand), VAE-encoded (the distribution's mode), shifted and scaled, packed into 2×2 patches with
  position ids `(1, row, column)`, and concatenated after the noisy tokens in every forward (CFG's negative pass
  too); the output keeps the generated tokens. The packed image travels inside the conditioning after the pooled
  row, `C` channels per token laid row-major into rows of T5's width (zero-padded), and its ids after the text's,
  so one tensor carries prompt and image through the engine, the denoising env and the trainer.
Other checkpoints refuse image-conditioned requests (text to image only); scheduler options that change the step are
refused at load.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    register_family,
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import check_max_sequence_length, read_settings, refuse_scheduler_options
from diffrl.models.condition_rows import pack_image_rows, unpack_image_rows
from diffrl.models.flux2_vae import downscale_to_area
from diffrl.models.qwen_vae import pack_latents
from diffrl.models.vae_latents import decode_images
from diffrl.sampling import randn_per_sample, resolution_mu

CLIP_TOKENS = 77
DEFAULT_GUIDANCE = 3.5  # FluxPipeline's guidance_scale default, and flow_grpo's FLUX.1 [dev] setting
# The FlowMatchEulerDiscreteScheduler options that change the step; every family over that scheduler with no option
# of its own to refuse reads them from here (FLUX.1, FLUX.2, Chroma, Z-Image, Lumina 2, CogView4).
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas", "use_flow_sigmas")


@dataclass
class Flux1Settings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    guidance: float = DEFAULT_GUIDANCE  # embedded guidance (guidance-distilled checkpoints only)
    max_sequence_length: int | None = None  # None: 512 for a guidance-distilled checkpoint, 256 without
    default_size: int = 1024
    kontext: bool | None = None  # image-conditioned (FLUX.1 Kontext); None: whether the model index names its pipeline


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose
    matmul row count is the batch size (the timestep, guidance and pooled-text MLPs, every block's AdaLN
    modulation) run one distinct row at a time. Not on GPU, where batched kernels differ anyway."""
    embed = transformer.time_text_embed
    embed_rows_one_at_a_time(embed.timestep_embedder)
    if hasattr(embed, "guidance_embedder"):
        embed_rows_one_at_a_time(embed.guidance_embedder)
    embed_rows_one_at_a_time(embed.text_embedder, timestep=False)
    for name, module in transformer.named_modules():
        if name.endswith(("norm1.linear", "norm1_context.linear", "norm.linear", "norm_out.linear")):
            embed_rows_one_at_a_time(module, timestep=False)


def image_position_ids(h: int, w: int, device=None) -> torch.Tensor:
    """(0, row, column) of each image token `[h·w, 3]`, as `FluxPipeline._prepare_latent_image_ids`."""
    rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1)


# The FLUX.1 layout that Chroma (`chroma.py`, a FLUX.1 [schnell] derivative) shares: the schedule, the packed noise
# and the decode of `FluxPipeline` and `ChromaPipeline`. The schedule is also Lumina 2's and Qwen-Image's.
def flux_sigmas(scheduler, num_steps: int, image_tokens: int, device, base=None) -> torch.Tensor:
    """The scheduler's own sigmas `[N + 1]` for `linspace(1, 1/N, N)` (or the `base` σ's a checkpoint configures) with
    μ linear in the number of image tokens (the scheduler's `base/max_image_seq_len` and `base/max_shift`, defaults
    256, 4096, 0.5, 1.15); a static-shift scheduler ignores μ, as in the pipelines."""
    config = scheduler.config
    mu = resolution_mu(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                       config.get("base_shift", 0.5), config.get("max_shift", 1.15))
    scheduler = copy.deepcopy(scheduler)  # set_timesteps changes the scheduler's state
    sigmas = np.linspace(1.0, 1 / num_steps, num_steps) if base is None else list(base)
    scheduler.set_timesteps(sigmas=sigmas, mu=mu, device="cpu")
    return scheduler.sigmas.to(device=device, dtype=torch.float32)


def packed_noise(generators, latent_channels: int, h: int, w: int, device) -> Latents:
    """The pipeline's noise `[B, C, 2h, 2w]` (one stream per sample) packed into 2×2 patches `[B, h·w, 4C]`, with
    the image tokens' ids `(0, row, column)`."""
    shape = (len(generators), latent_channels, 2 * h, 2 * w)  # what the pipeline draws
    tokens = pack_latents(randn_per_sample(shape, generators, device=device), 2)
    return Latents(tokens, image_position_ids(h, w, device=device))


def decode_packed(vae, latents: torch.Tensor, h: int, w: int, *, per_call: int | None) -> torch.Tensor:
    """Packed latents `[B, h·w, 4C]` → images `[B, 3, H, W]` in [0, 1]: unpacked, `latents / scaling_factor +
    shift_factor`, decoded (`decode_rows`), `x/2 + 0.5` clamped."""
    batch, _, channels = latents.shape
    grid = latents.view(batch, h, w, channels // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    grid = grid.reshape(batch, channels // 4, 2 * h, 2 * w)
    config = vae.config
    grid = grid / config.scaling_factor + config.shift_factor
    return decode_images(vae, grid, per_call=per_call)


@register_family
class Flux1Family(FamilyAdapter):
    name = "flux1"
    name_patterns = ("flux.1", "flux1", "flux-1", "flux_1")
    display_name = "FLUX.1"
    default_guidance_scale = 1.0  # no true CFG: FLUX.1 [dev] samples with its embedded guidance
    default_num_inference_steps = 50  # sglang-diffusion's FLUX.1 default (diffusers' pipeline: 28)
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes σ
    # flow_grpo's FLUX.1 LoRA targets (scripts/train_flux.py): both streams' attention projections and MLPs of the
    # double blocks; peft matches by suffix, so `attn.to_q/k/v` also cover the single blocks' attention.
    lora_target_modules = ("attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                           "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2",
                           "ff_context.net.0.proj", "ff_context.net.2")
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    components = (
        Component("transformer", "diffusers:FluxTransformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("tokenizer_2", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:CLIPTextModel", text_encoder=True),
        Component("text_encoder_2", "transformers:T5EncoderModel", text_encoder=True),
    )
    settings_class = Flux1Settings

    def __init__(self, transformer, vae, text_encoder, tokenizer, text_encoder_2, tokenizer_2, scheduler, *,
                 settings: Flux1Settings | None = None):
        settings = copy.copy(settings or Flux1Settings())
        config = transformer.config
        self.guidance_distilled = bool(config.guidance_embeds)
        if settings.max_sequence_length is None:
            settings.max_sequence_length = 512 if self.guidance_distilled else 256
        check_max_sequence_length("flux1", settings.max_sequence_length, limit=512, pipeline="FluxPipeline")
        latent_channels = vae.config.latent_channels
        if config.in_channels != 4 * latent_channels:
            raise ModelLoadError(f"flux1: the transformer takes {config.in_channels} channels; 2x2 patches of the "
                                 f"VAE's {latent_channels} latent channels are {4 * latent_channels}")
        if config.pooled_projection_dim > config.joint_attention_dim:
            raise ModelLoadError("flux1: the pooled text vector is wider than the T5 tokens it travels beside")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae,
                              text_encoders=[text_encoder, text_encoder_2],  # [CLIP-L, T5]
                              tokenizers=[tokenizer, tokenizer_2], scheduler=scheduler, settings=settings)
        if not self.guidance_distilled:  # schnell: timestep-distilled, a few steps
            self.default_num_inference_steps = 4
        self.accepts_image_conditioning = bool(settings.kontext)
        self.max_condition_images = 1 if settings.kontext else 0
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.pixels_per_token = self.vae_scale * 2

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> Flux1Settings:
        return read_settings(Flux1Settings, index, root / "model_index.json",
                             kontext=index.get("_class_name") == "FluxKontextPipeline")

    @classmethod
    def from_components(cls, root, parts, settings) -> Flux1Family:
        return cls(parts["transformer"], parts["vae"], parts["text_encoder"], parts["tokenizer"],
                   parts["text_encoder_2"], parts["tokenizer_2"], parts["scheduler"], settings=settings)

    @property
    def embedded_guidance(self) -> float | None:
        """The guidance scale every forward embeds (None for a checkpoint without the embedding)."""
        return float(self.settings.guidance) if self.guidance_distilled else None

    def reference_pipeline(self):
        """diffusers' `FluxPipeline` (Kontext: `FluxKontextPipeline`) over this family's own components (a copy of
        the scheduler, whose state sampling changes); call it with `reference_pipeline_kwargs()` and
        `true_cfg_scale` for CFG."""
        from diffusers import FluxKontextPipeline, FluxPipeline

        (clip, t5), (clip_tokenizer, t5_tokenizer) = self.text_encoders, self.tokenizers
        return self.pipeline_over_components(FluxKontextPipeline if self.settings.kontext else FluxPipeline,
                                             text_encoder=clip, tokenizer=clip_tokenizer, text_encoder_2=t5,
                                             tokenizer_2=t5_tokenizer)

    def reference_pipeline_kwargs(self) -> dict:
        """The checkpoint's embedded guidance and T5 window: inputs of each pipeline call (Kontext: the condition
        image at its own size, as the engine takes it)."""
        kwargs = {"guidance_scale": self.settings.guidance, "max_sequence_length": self.settings.max_sequence_length}
        return {**kwargs, "_auto_resize": False} if self.settings.kontext else kwargs

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_pixel_multiple("FLUX.1", self.pixels_per_token, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return flux_sigmas(self.scheduler, num_steps, image_tokens, self.device)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        (clip, t5), (clip_tokenizer, t5_tokenizer) = self.text_encoders, self.tokenizers
        if clip is None or t5 is None:
            raise RuntimeError("this FLUX.1 model was loaded without its text encoders")
        prompts = list(prompts)
        ids = clip_tokenizer(prompts, padding="max_length", max_length=clip_tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids
        pooled = clip(ids.to(clip.device), output_hidden_states=False).pooler_output.float()
        ids = t5_tokenizer(prompts, padding="max_length", max_length=self.settings.max_sequence_length,
                           truncation=True, return_tensors="pt").input_ids
        tokens = t5(ids.to(t5.device), output_hidden_states=False)[0].float()
        width = tokens.shape[-1]
        pooled_row = torch.nn.functional.pad(pooled.to(tokens.device), (0, width - pooled.shape[-1]))[:, None]
        packed = torch.cat([tokens, pooled_row], dim=1)
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 3, device=packed.device))

    def unpack_conditioning(self, cond: PromptEmbeds) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                                                torch.Tensor | None]:
        """(T5 tokens `[B, L, D]`, pooled CLIP `[B, P]`, the condition image's tokens `[B, S, C]` and ids `[S, 3]`,
        or None twice without one) from the packed conditioning."""
        length = self.settings.max_sequence_length
        text, pooled = cond.embeds[:, :length], cond.embeds[:, length, : self.transformer.config.pooled_projection_dim]
        image_ids = cond.ids[length + 1:]
        if not len(image_ids):
            return text, pooled, None, None
        channels = self.transformer.config.in_channels
        return text, pooled, unpack_image_rows(cond.embeds[:, length + 1:], len(image_ids), channels), image_ids

    def encode_condition_images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """Kontext: the one condition image's packed latents and ids (`encode_condition_image`)."""
        if not self.settings.kontext or len(images) != 1:
            raise RequestError("image_path", f"this FLUX.1 checkpoint takes {self.max_condition_images} condition "
                                             f"images, got {len(images)}")
        return self.encode_condition_image(images[0])

    def condition_on_images(self, cond: PromptEmbeds, encoded: tuple[torch.Tensor, torch.Tensor]) -> PromptEmbeds:
        """Kontext: the condition image's packed latents appended to the conditioning (module docstring)."""
        tokens, ids = encoded
        rows = pack_image_rows(tokens.to(cond.embeds), cond.embeds.shape[-1]).expand(len(cond), -1, -1)
        return PromptEmbeds(torch.cat([cond.embeds, rows], dim=1), torch.cat([cond.ids, ids.to(cond.ids)]))

    @torch.no_grad()
    def encode_condition_image(self, image: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`uint8 [3, H, W]` → (packed latents `[1, S, C]`, ids `(1, row, column)` `[S, 3]`), as
        `FluxKontextPipeline` prepares its `image` without `_auto_resize`."""
        step = self.pixels_per_token
        if self.condition_image_area is not None:  # a run's cap (--condition-image-size), before the pipeline's sizing
            image = downscale_to_area(image, self.condition_image_area)
        height, width = image.shape[1] // step * step, image.shape[2] // step * step
        if not height or not width:
            raise RequestError("image_path", f"the condition image is {image.shape[2]}x{image.shape[1]} pixels; FLUX.1 "
                                             f"Kontext needs at least {step}x{step}")
        if (height, width) != tuple(image.shape[1:]):  # the pipeline's resize: PIL, Lanczos
            from PIL import Image

            pil = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((width, height), Image.Resampling.LANCZOS)
            image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        pixels = (image.float() / 255 * 2 - 1)[None]  # the image processor's arithmetic
        vae_dtype = next(self.vae.parameters()).dtype
        latents = self.vae.encode(pixels.to(self.device, vae_dtype)).latent_dist.mode()
        config = self.vae.config
        latents = ((latents - config.shift_factor) * config.scaling_factor).float()
        ids = image_position_ids(height // step, width // step, device=self.device)
        ids[:, 0] = 1
        return pack_latents(latents, 2), ids

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """sglang's FLUX.1 cond kwargs: the T5 tokens, `pooled_projections` [P] (unpadded) and the position ids;
        Kontext's condition image as diffrl's `condition_latents` [S, C] and `condition_ids` [S, 3]."""
        tokens, pooled, image, ids = self.unpack_conditioning(PromptEmbeds(cond.embeds[:1], cond.ids))
        wire = {"encoder_hidden_states": [tokens[0]], "pooled_projections": pooled[0],
                "txt_ids": cond.ids[: tokens.shape[1]], "img_ids": image_ids}
        if image is not None:
            wire.update(condition_latents=image[0], condition_ids=ids)
        return wire

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        tokens = wire_text_tokens(kwargs)
        pooled = kwargs.get("pooled_projections")
        if isinstance(pooled, torch.Tensor) and pooled.dim() == 2 and pooled.shape[0] == 1:
            pooled = pooled[0]
        if not isinstance(pooled, torch.Tensor) or pooled.dim() != 1 or pooled.shape[0] > tokens.shape[1]:
            raise ValueError("pooled_projections: expected a [P] tensor no wider than the text tokens")
        row = torch.nn.functional.pad(pooled.float(), (0, tokens.shape[1] - pooled.shape[0]))
        packed = torch.cat([tokens, row[None]])[None]
        ids = torch.zeros(packed.shape[1], 3)
        image, image_ids = kwargs.get("condition_latents"), kwargs.get("condition_ids")
        if image is not None:
            if not isinstance(image_ids, torch.Tensor) or image.dim() != 2 or image_ids.shape != (image.shape[0], 3):
                raise ValueError("condition_latents / condition_ids: expected [S, C] latents and [S, 3] ids")
            packed = torch.cat([packed, pack_image_rows(image[None].float(), tokens.shape[1])], dim=1)
            ids = torch.cat([ids, image_ids.float()])
        return PromptEmbeds(packed, ids), kwargs.get("img_ids")

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        return packed_noise(generators, self.vae.config.latent_channels, height // self.pixels_per_token,
                            width // self.pixels_per_token, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        text, pooled, image, image_ids = self.unpack_conditioning(cond)
        timestep = sigma * 1000 / 1000  # the scheduler's timestep / 1000, as the pipeline passes it
        guidance = None
        if self.guidance_distilled:
            guidance = torch.full_like(sigma, self.settings.guidance)
        tokens, ids, generated = latents.tokens, latents.ids, latents.tokens.shape[1]
        if image is not None:  # Kontext: the condition image's tokens after the noisy ones, its own ids
            tokens, ids = torch.cat([tokens, image.to(tokens)], dim=1), torch.cat([ids, image_ids.to(ids)])
        with self.forward_precision():
            return transformer(hidden_states=tokens.to(dtype), timestep=timestep.to(dtype), guidance=guidance,
                               pooled_projections=pooled.to(dtype), encoder_hidden_states=text.to(dtype),
                               txt_ids=cond.ids[: text.shape[1]].to(latents.ids), img_ids=ids,
                               return_dict=False)[0][:, :generated].float()

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_packed(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                             per_call=self.vae_decode_batch)
