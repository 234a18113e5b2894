"""The `sd3` family: Stable Diffusion 3 / 3.5 (diffusers' `SD3Transformer2DModel`), text to image, the
model the published Flow-GRPO recipes train.

A checkpoint is a local diffusers-format directory: `transformer/`, `vae/` (AutoencoderKL),
`text_encoder/` and `text_encoder_2/` (CLIP-L and CLIP-G with projection), `text_encoder_3/` (T5; may
be left out, as diffusers allows: its part of the conditioning is then zeros), `tokenizer/`,
`tokenizer_2/`, `tokenizer_3/`, `scheduler/`.

What this adapter reproduces of diffusers' `StableDiffusion3Pipeline` (`tests/test_sd3.py`):
- conditioning: the penultimate hidden states of both CLIPs (77 tokens) side by side, zero-padded to
  T5's width, then T5's `max_sequence_length` tokens; the pooled embedding is both CLIPs' projections;
- the schedule is the scheduler's own (`set_timesteps(N)`: a linspace between the shifted σ_max and
  σ_min, shifted again), and the transformer's timestep is σ·1000;
- latents are the VAE's `[B, 16, H/8, W/8]` (the transformer patchifies them itself), decoded as
  `latents / scaling_factor + shift_factor`; CFG is `uncond + s·(cond − uncond)` in one batch.

The pooled embedding travels inside the conditioning tensor: `PromptEmbeds.embeds` is `[B, L + 1, D]`
whose last token holds the pooled vector (zero-padded to D), so the engine, the denoising env and the
trainer carry SD3's two text inputs as the one tensor they carry for every family.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

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
from diffrl.models.vae_latents import decode_images, latent_noise

CLIP_TOKENS = 77
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")  # CLIP-L, CLIP-G, T5
TOKENIZERS = ("tokenizer", "tokenizer_2", "tokenizer_3")


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose
    matmul row count is the batch size (the timestep and pooled-text MLPs, every block's AdaLN modulation) run one
    distinct row at a time, since BLAS rounds other row counts differently. Not on GPU, where batched kernels differ
    anyway and a row-by-row modulation would cost ~50 small launches per forward."""
    embed_rows_one_at_a_time(transformer.time_text_embed.timestep_embedder)
    embed_rows_one_at_a_time(transformer.time_text_embed.text_embedder, timestep=False)
    for name, module in transformer.named_modules():
        if name.endswith(("norm1.linear", "norm1_context.linear", "norm_out.linear")):
            embed_rows_one_at_a_time(module, timestep=False)


@register_family
class SD3Family(FamilyAdapter):
    name = "sd3"
    name_patterns = ("stable-diffusion-3", "sd3", "sd-3")
    display_name = "SD3"
    default_guidance_scale = 4.5  # the Flow-GRPO recipes' CFG for SD3.5 (diffusers' pipeline default is 7)
    default_num_inference_steps = 50  # sglang-diffusion's default (diffusers' pipeline: 28)
    timestep_scale = 1000.0
    # Flow-GRPO's SD3 LoRA targets: the joint attention's projections of both streams.
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    block_lists = ("transformer_blocks",)
    # T5 (`text_encoder_3`, `tokenizer_3`) may be left out, as diffusers allows: its tokens are then zeros.
    components = (
        Component("transformer", "diffusers:SD3Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("tokenizer_2", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("tokenizer_3", "transformers:AutoTokenizer", kind="tokenizer", optional=True),
        Component("text_encoder", "transformers:CLIPTextModelWithProjection", text_encoder=True),
        Component("text_encoder_2", "transformers:CLIPTextModelWithProjection", text_encoder=True),
        Component("text_encoder_3", "transformers:T5EncoderModel", text_encoder=True, optional=True),
    )

    def __init__(self, transformer, vae, text_encoders, tokenizers, scheduler, *, max_sequence_length: int = 256):
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae,
                              text_encoders=text_encoders,  # [CLIP-L, CLIP-G, T5 or None]
                              tokenizers=tokenizers, scheduler=scheduler)
        self.max_sequence_length = max_sequence_length
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        if scheduler.config.get("use_dynamic_shifting"):
            raise ModelLoadError("sd3: the scheduler uses dynamic shifting, which this adapter does not reproduce "
                                 "(SD3 and SD3.5 ship a static shift)")

    def reference_pipeline(self):
        """diffusers' `StableDiffusion3Pipeline` over this family's own components (no copy): what the
        tests check the engine against and the benchmarks time it against."""
        from diffusers import StableDiffusion3Pipeline

        (clip_l, clip_g, t5), (tok_l, tok_g, tok_t5) = self.text_encoders, self.tokenizers
        pipe = StableDiffusion3Pipeline(transformer=self.transformer, scheduler=self.scheduler, vae=self.vae,
                                        text_encoder=clip_l, tokenizer=tok_l, text_encoder_2=clip_g, tokenizer_2=tok_g,
                                        text_encoder_3=t5, tokenizer_3=tok_t5)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def from_components(cls, root, parts, settings, *, max_sequence_length: int = 256) -> SD3Family:
        return cls(parts["transformer"], parts["vae"], [parts[n] for n in TEXT_ENCODERS],
                   [parts[n] for n in TOKENIZERS], parts["scheduler"], max_sequence_length=max_sequence_length)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * self.vae_scale
        return size, size

    def check_size(self, height: int, width: int) -> None:
        step = self.vae_scale * self.transformer.config.patch_size
        require_pixel_multiple("SD3", step, height=height, width=width)
        patches = getattr(self.transformer.config, "pos_embed_max_size", None)
        if patches:  # the position embedding covers at most this many patches a side
            largest = patches * step
            for name, value in (("height", height), ("width", width)):
                if value > largest:
                    raise RequestError(name, f"{name}={value}: this SD3 checkpoint makes at most {largest} pixels a "
                                             f"side (its pos_embed_max_size {patches} × {step} pixels a patch)")

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def _clip(self, index: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoder, tokenizer = self.text_encoders[index], self.tokenizers[index]
        ids = tokenizer(prompts, padding="max_length", max_length=CLIP_TOKENS, truncation=True,
                        return_tensors="pt").input_ids
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        return out.hidden_states[-2], out[0]  # penultimate layer, pooled projection

    def _t5(self, prompts: list[str], width: int) -> torch.Tensor:
        encoder, tokenizer = self.text_encoders[2], self.tokenizers[2]
        if encoder is None:
            return torch.zeros(len(prompts), self.max_sequence_length, width, device=self.device)
        ids = tokenizer(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                        add_special_tokens=True, return_tensors="pt").input_ids
        return encoder(ids.to(encoder.device))[0]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        if self.text_encoders[0] is None:
            raise RuntimeError("this SD3 model was loaded without its text encoders")
        prompts = list(prompts)
        (hidden_l, pooled_l), (hidden_g, pooled_g) = self._clip(0, prompts), self._clip(1, prompts)
        width = self.transformer.config.joint_attention_dim
        clip = torch.cat([hidden_l, hidden_g], dim=-1).float()
        clip = torch.nn.functional.pad(clip, (0, width - clip.shape[-1]))
        tokens = torch.cat([clip, self._t5(prompts, width).float()], dim=1)
        pooled = torch.cat([pooled_l, pooled_g], dim=-1).float()
        packed = torch.cat([tokens, torch.nn.functional.pad(pooled, (0, width - pooled.shape[-1]))[:, None]], dim=1)
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1, device=packed.device))

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """sglang's SD3 cond kwargs: the joint CLIP+T5 tokens and `pooled_projections` [P] (unpadded). Its
        `encoder_hidden_states` goes out as a one-element list, which its clients iterate; a bare tensor reads too."""
        tokens = cond.embeds[0, :-1]
        pooled = cond.embeds[0, -1]
        return {"encoder_hidden_states": [tokens],
                "pooled_projections": pooled[: self.transformer.config.pooled_projection_dim]}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        tokens = wire_text_tokens(kwargs)
        pooled = kwargs.get("pooled_projections")
        if isinstance(pooled, torch.Tensor) and pooled.dim() == 2 and pooled.shape[0] == 1:
            pooled = pooled[0]  # sglang keeps the prompt's batch axis of 1 when a request has several outputs
        if not isinstance(pooled, torch.Tensor) or pooled.dim() != 1 or pooled.shape[0] > tokens.shape[1]:
            raise ValueError("pooled_projections: expected a [P] tensor no wider than the text tokens")
        row = torch.nn.functional.pad(pooled.float(), (0, tokens.shape[1] - pooled.shape[0]))
        packed = torch.cat([tokens, row[None]])[None]
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1)), torch.zeros(0, 1)

    def _unpack(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text tokens [B, L, D], pooled [B, P]) from the packed conditioning."""
        return embeds[:, :-1], embeds[:, -1, : self.transformer.config.pooled_projection_dim]

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (self.transformer.config.in_channels, height // self.vae_scale, width // self.vae_scale)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        text, pooled = self._unpack(cond.embeds)
        with self.forward_precision():
            return transformer(hidden_states=latents.tokens.to(dtype), timestep=(sigma * self.timestep_scale).to(dtype),
                               encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
                               return_dict=False)[0].float()

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        config = self.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        return decode_images(self.vae, latents, per_call=self.vae_decode_batch)
