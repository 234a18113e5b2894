"""The `cogview4` family: CogView4 (diffusers' `CogView4Transformer2DModel`, driven by `CogView4Pipeline`), text to
image.

A checkpoint is a local diffusers-format directory:

    transformer/   CogView4Transformer2DModel  vae/        AutoencoderKL (16 latent channels, f8)
    text_encoder/  GlmModel (GLM-4-9B)         tokenizer/  its GLM-4 tokenizer (pads on the left)
    scheduler/     FlowMatchEulerDiscreteScheduler (dynamic shift, `time_shift_type="linear"`)

Its model_index.json may carry a `diffrl` block with `max_sequence_length` (GLM tokens, the pipeline's 1024) and
`default_size` (1024, the pipeline's).

What this adapter reproduces of diffusers' `CogView4Pipeline` (checked by `tests/test_cogview4.py`):
- conditioning: each prompt tokenized on its own (GLM-4's `[gMASK]<sop>` prefix, truncated at
  `max_sequence_length`), left-padded with the pad token to a multiple of 16 tokens, and GLM's second-to-last
  hidden state computed *without* an attention mask (the pipeline passes none: the pad tokens are text the
  transformer sees). The pipeline pads a batch of prompts to its longest; a prompt alone (how it is called here,
  so a prompt's conditioning never depends on the prompts beside it) is padded only to the multiple of 16. A
  conditioning row is those tokens plus a channel of 1s, then zero rows: prompts of different lengths share a
  batch zero-padded at the end (`pads_text`), and each forward gives every row its own tokens (rows of one length
  run as one call);
- the forward: the VAE's `[B, C, H/8, W/8]` latents, which the transformer patchifies itself (2×2); the size
  conditioning the pipeline passes by default: `original_size = target_size = (H, W)` pixels and
  `crop_coords = (0, 0)`; and the timestep the pipeline passes, which is *not* σ·1000: the pipeline gives the
  scheduler both its sigmas and its timesteps, so the Euler step uses the shifted σ while the transformer sees
  the unshifted t. It is recovered from σ by inverting the linear shift: `t = 1000 / (μ·(1/σ − 1) + 1)`;
- schedule: `t_k = int(linspace(1000, 1, N))`, `σ_k = shift(t_k / 1000)` with the scheduler's linear time shift
  `μ / (μ + 1/σ − 1)` and `μ = √(image tokens / base_image_seq_len)·max_shift + base_shift` (diffusers'
  `calculate_shift`: 0.25 + 0.75·√(tokens / 256) for CogView4-6B), where image tokens count 2×2 patches;
- CFG: `uncond + s·(cond − uncond)` above s = 1 with the negative prompt (the empty prompt by default), the
  pipeline's `guidance_scale` (default 5); no renormalization. The pipeline runs the halves as two forwards; here
  they share one when their texts have one length;
- decode: `latents / scaling_factor` (the pipeline adds no shift factor), the VAE, `x/2 + 0.5` clamped.
Reported timesteps are the scheduler's σ·1000, as for the other families. Image-conditioned requests are refused
(text to image only); scheduler options that change the step are refused at load.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

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
from diffrl.models.components import check_max_sequence_length, refuse_scheduler_options
from diffrl.models.flux1 import UNSUPPORTED_SCHEDULER_OPTIONS
from diffrl.models.masked_text import MaskedTextWire, masked_text_conditioning, text_lengths, with_mask_channel
from diffrl.models.vae_latents import decode_images, latent_noise

TEXT_MULTIPLE = 16  # the pipeline left-pads GLM's tokens to a multiple of 16
PIPELINE_PIXEL_MULTIPLE = 16  # CogView4Pipeline.check_inputs: height and width divisible by 16


@dataclass
class CogView4Settings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    max_sequence_length: int = 1024  # CogView4Pipeline's default GLM window
    default_size: int = 1024  # the transformer's sample_size (128) × the VAE's 8


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose
    matmul row count is the batch size run one distinct row at a time: the timestep MLP, the size-conditioning MLP
    (its rows are equal within a forward: one size per batch), every block's AdaLN modulation and the output
    norm's, all over the timestep-and-size embedding. Not on GPU, where batched kernels differ anyway."""
    embed_rows_one_at_a_time(transformer.time_condition_embed.timestep_embedder)
    embed_rows_one_at_a_time(transformer.time_condition_embed.condition_embedder)
    for name, module in transformer.named_modules():
        if name.endswith(("norm1.linear", "norm_out.linear")):
            embed_rows_one_at_a_time(module)


def cogview4_mu(scheduler, image_tokens: int) -> float:
    """The pipeline's μ for `image_tokens` 2×2 patches: diffusers' `calculate_shift` with the scheduler's
    `base_image_seq_len`, `base_shift` and `max_shift` (the pipeline's fallbacks 256, 0.25, 0.75)."""
    from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift

    config = scheduler.config
    return calculate_shift(image_tokens, config.get("base_image_seq_len", 256), config.get("base_shift", 0.25),
                           config.get("max_shift", 0.75))


@register_family
class CogView4Family(MaskedTextWire, FamilyAdapter):
    name = "cogview4"
    name_patterns = ("cogview4", "cogview-4")
    reference_pipeline_class = "CogView4Pipeline"
    display_name = "CogView4"
    default_guidance_scale = 5.0  # CogView4Pipeline's default guidance_scale
    default_num_inference_steps = 50  # CogView4Pipeline's default
    timestep_scale = 1000.0  # reported timesteps are the scheduler's σ·1000 (the transformer's t: run_transformer)
    pads_text = True  # conditionings of different lengths share a batch, zero-padded (see the module docstring)
    # The joint attention's four projections (text and image tokens share them in CogView4's blocks), as Flow-GRPO
    # targets SD3's attention; no peer RL framework publishes CogView4 targets.
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:CogView4Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:GlmModel", text_encoder=True),
    )
    settings_class = CogView4Settings

    def __init__(self, transformer, vae, scheduler, tokenizer, text_encoder, *,
                 settings: CogView4Settings | None = None):
        settings = copy.copy(settings or CogView4Settings())
        config = transformer.config
        check_max_sequence_length("cogview4", settings.max_sequence_length)
        latent_channels = vae.config.latent_channels
        if config.in_channels != latent_channels:
            raise ModelLoadError(f"cogview4: the transformer takes {config.in_channels} channels; the VAE's latents "
                                 f"have {latent_channels}")
        if text_encoder is not None and text_encoder.config.hidden_size != config.text_embed_dim:
            raise ModelLoadError(f"cogview4: the text encoder's width {text_encoder.config.hidden_size} is not the "
                                 f"transformer's text input {config.text_embed_dim}")
        if scheduler.config.get("use_dynamic_shifting") and scheduler.config.get("time_shift_type") != "linear":
            raise ModelLoadError("cogview4: the scheduler's dynamic shift must be linear (time_shift_type='linear', "
                                 "CogView4's); the transformer's timestep is recovered by inverting it")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.pixels_per_token = self.vae_scale * config.patch_size

    def reference_pipeline_kwargs(self) -> dict:
        return {"max_sequence_length": self.settings.max_sequence_length}

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        step = math.lcm(PIPELINE_PIXEL_MULTIPLE, self.pixels_per_token)
        require_pixel_multiple("CogView4", step, height=height, width=width)

    def _mu(self, height: int, width: int) -> float:
        return cogview4_mu(self.scheduler, (height // self.pixels_per_token) * (width // self.pixels_per_token))

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The pipeline's: the scheduler shifts `int(linspace(1000, 1, N)) / 1000` by μ (a static-shift scheduler
        ignores μ, as in the pipeline)."""
        train_steps = self.scheduler.config.num_train_timesteps
        timesteps = np.linspace(train_steps, 1.0, num_steps).astype(np.int64).astype(np.float32)
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=timesteps / train_steps, mu=self._mu(height, width), device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def transformer_timesteps(self, sigma: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """The timestep the pipeline gives the transformer at σ: the unshifted t (the shift inverted), fp32."""
        config = self.scheduler.config
        sigma = sigma.double()
        if config.get("use_dynamic_shifting"):
            unshifted = 1.0 / (self._mu(height, width) * (1.0 / sigma - 1.0) + 1.0)
        else:
            unshifted = sigma / (config.shift - (config.shift - 1.0) * sigma)  # σ = s·t / (1 + (s − 1)·t)
        return (unshifted * config.num_train_timesteps).float()

    def _encode_one(self, prompt: str, device) -> torch.Tensor:
        ids = self.tokenizer([prompt], padding="longest", max_length=self.settings.max_sequence_length,
                             truncation=True, add_special_tokens=True, return_tensors="pt").input_ids
        pad = -ids.shape[1] % TEXT_MULTIPLE
        ids = torch.nn.functional.pad(ids, (pad, 0), value=self.tokenizer.pad_token_id)  # on the left
        hidden = self.text_encoder(ids.to(device), output_hidden_states=True).hidden_states[-2]
        return with_mask_channel(hidden[0].float())

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """GLM over each prompt alone (module docstring), the batch zero-padded to its longest."""
        if self.text_encoder is None:
            raise RuntimeError("this CogView4 model was loaded without its text encoder")
        device = next(self.text_encoder.parameters()).device
        return masked_text_conditioning([self._encode_one(p, device) for p in prompts])

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (self.vae.config.latent_channels, height // self.vae_scale, width // self.vae_scale)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        tokens = latents.tokens
        height, width = tokens.shape[2] * self.vae_scale, tokens.shape[3] * self.vae_scale
        timestep = self.transformer_timesteps(sigma, height, width).to(tokens.device)
        size = torch.tensor([[height, width]], dtype=dtype, device=tokens.device)
        lengths = text_lengths(cond.embeds).tolist()  # one host sync per forward
        groups = [[i for i, n in enumerate(lengths) if n == length] for length in sorted(set(lengths))]
        outputs = []
        for rows in groups:  # rows of one text length run as one call (a rollout's: always one)
            index = slice(None) if len(groups) == 1 else torch.tensor(rows, device=tokens.device)
            n, length = len(rows), lengths[rows[0]]
            with self.forward_precision():
                outputs.append(transformer(
                    hidden_states=tokens[index].to(dtype), encoder_hidden_states=cond.embeds[index, :length, :-1].to(
                        dtype), timestep=timestep[index], original_size=size.expand(n, 2),
                    target_size=size.expand(n, 2), crop_coords=torch.zeros_like(size).expand(n, 2),
                    return_dict=False)[0].float())
        if len(groups) == 1:
            return outputs[0]
        order = torch.tensor([i for rows in groups for i in rows], device=tokens.device)
        return torch.cat(outputs)[torch.argsort(order)]

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        vae_dtype = next(self.vae.parameters()).dtype
        latents = latents.to(vae_dtype) / self.vae.config.scaling_factor
        return decode_images(self.vae, latents, per_call=self.vae_decode_batch)
