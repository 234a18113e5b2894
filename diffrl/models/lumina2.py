"""The `lumina2` family: Lumina-Image 2.0 (diffusers' `Lumina2Transformer2DModel`, driven by `Lumina2Pipeline`), text
to image.

A checkpoint is a local diffusers-format directory:

    transformer/   Lumina2Transformer2DModel   vae/        AutoencoderKL (16 latent channels, f8)
    text_encoder/  Gemma2Model (Gemma-2-2B)    tokenizer/  its Gemma tokenizer
    scheduler/     FlowMatchEulerDiscreteScheduler

Its model_index.json may carry a `diffrl` block with `max_sequence_length` (Gemma tokens, the pipeline's 256),
`system_prompt` (the pipeline's own by default) and `cfg_normalization` (the pipeline's default, on). The default
size is the pipeline's: the transformer's `sample_size` × 8.

What this adapter reproduces of diffusers' `Lumina2Pipeline` (checked by `tests/test_lumina2.py`):
- conditioning: the pipeline encodes a prompt as `system_prompt + " <Prompt Start> " + prompt` but a negative
  prompt as it is (no system prompt), each tokenized right-padded into a window of `max_sequence_length` tokens
  (truncated), Gemma2's second-to-last hidden state computed with the tokenizer's attention mask. The engine
  encodes prompts and negative prompts alike, so a conditioning row holds both encodings of its text, each the
  whole window plus the mask as one extra channel (`[B, L, 2·(D + 1)]`: as a prompt, then as a negative prompt);
  a forward reads the first, and `pair_conditionings` moves the negative half's second encoding first. Engine,
  trainer and wire carry one tensor; every text has the same window, so prompts, negative prompts and
  microgroups share a batch. The transformer reads only the first (mask-sum) tokens of each row;
- latents: the VAE's `[B, 16, H/8, W/8]` noise, which the transformer patchifies (2×2) and positions itself;
  decoded as `latents / scaling_factor + shift_factor`;
- schedule: the scheduler's own sigmas for `linspace(1, 1/N, N)` with μ from `calculate_shift` of the pipeline's
  `latents.shape[1]` — for these unpacked latents that is the channel count, not the token count; only a
  dynamically shifting scheduler reads μ (a static shift ignores it). The transformer's timestep is
  `1 − t/1000` of the scheduler's t = σ·1000 (Lumina counts time from noise to image) and its output is the
  negated velocity;
- CFG: `uncond + s·(cond − uncond)` above s = 1 with the negative prompt (the empty prompt by default), then, as
  the pipeline's default `cfg_normalization=True`, rescaled so that each row along the latent's last axis (width)
  keeps the conditional prediction's norm. The pipeline's default `cfg_trunc_ratio=1.0` truncates nothing: CFG
  runs at every step, as here. The pipeline runs the two halves as two forwards; here they share one (rows of
  different text lengths: the transformer masks the padding itself).

Image-conditioned requests are refused (text to image only); scheduler options that change the step are refused at
load.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffrl.errors import ModelLoadError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    register_family,
    require_rope_positions,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import check_max_sequence_length, refuse_scheduler_options
from diffrl.models.flux1 import UNSUPPORTED_SCHEDULER_OPTIONS, flux_sigmas
from diffrl.models.vae_latents import decode_images, latent_noise

# Lumina2Pipeline's system prompt, word for word (its `system_prompt` attribute).
SYSTEM_PROMPT = ("You are an assistant designed to generate superior images with the superior degree of image-text "
                 "alignment based on textual prompts or user prompts.")


@dataclass
class Lumina2Settings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    max_sequence_length: int = 256  # Lumina2Pipeline's default Gemma window
    system_prompt: str = SYSTEM_PROMPT
    cfg_normalization: bool = True  # the pipeline's default


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose
    matmul row count is the batch size (the timestep MLP, each modulated block's modulation projection and the
    output norm's) run one distinct row at a time; their input is the timestep embedding. Not on GPU, where batched
    kernels differ anyway."""
    embed_rows_one_at_a_time(transformer.time_caption_embed.timestep_embedder)
    for blocks in (transformer.noise_refiner, transformer.layers):
        for block in blocks:
            embed_rows_one_at_a_time(block.norm1.linear)
    embed_rows_one_at_a_time(transformer.norm_out.linear_1)


@register_family
class Lumina2Family(FamilyAdapter):
    name = "lumina2"
    name_patterns = ("lumina-image-2", "lumina2", "lumina-2", "lumina_2", "lumina-image2")
    reference_pipeline_class = "Lumina2Pipeline"
    display_name = "Lumina-Image 2.0"
    default_guidance_scale = 4.0  # Lumina2Pipeline's default guidance_scale
    default_num_inference_steps = 30  # diffusers' Lumina2Pipeline default (sglang-diffusion serves no Lumina 2)
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000)
    # No peer publishes Lumina 2 LoRA targets: Z-Image's (the same block design: attention projections and the
    # SwiGLU MLP of every block, refiners included), under Lumina2's module names.
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "feed_forward.linear_1", "feed_forward.linear_2", "feed_forward.linear_3")
    block_lists = ("noise_refiner", "context_refiner", "layers")
    components = (
        Component("transformer", "diffusers:Lumina2Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Gemma2Model", text_encoder=True),
    )
    settings_class = Lumina2Settings

    def __init__(self, transformer, vae, scheduler, tokenizer, text_encoder, *,
                 settings: Lumina2Settings | None = None):
        settings = copy.copy(settings or Lumina2Settings())
        config = transformer.config
        check_max_sequence_length("lumina2", settings.max_sequence_length, limit=512, pipeline="Lumina2Pipeline")
        if settings.max_sequence_length >= config.axes_lens[0]:
            # The image tokens sit at position (text length) on the first RoPE axis.
            raise ModelLoadError(f"lumina2: max_sequence_length {settings.max_sequence_length} needs "
                                 f"{settings.max_sequence_length + 1} positions on the first RoPE axis; the "
                                 f"transformer has {config.axes_lens[0]}")
        if config.patch_size != 2:
            raise ModelLoadError(f"lumina2: the pipeline samples with 2x2 patches; this transformer's are "
                                 f"{config.patch_size}x{config.patch_size}")
        if config.in_channels != vae.config.latent_channels:
            raise ModelLoadError(f"lumina2: the transformer takes {config.in_channels} channels, the VAE makes "
                                 f"{vae.config.latent_channels}")
        if text_encoder is not None and text_encoder.config.hidden_size != config.cap_feat_dim:
            raise ModelLoadError(f"lumina2: the text encoder is {text_encoder.config.hidden_size} wide, the "
                                 f"transformer reads {config.cap_feat_dim}-wide text")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        tokenizer.padding_side = "right"  # as the pipeline sets it (Gemma's tokenizer may pad on the left)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.pixels_per_token = self.vae_scale * config.patch_size

    def reference_pipeline_kwargs(self) -> dict:
        return {"max_sequence_length": self.settings.max_sequence_length, "system_prompt": self.settings.system_prompt,
                "cfg_normalization": self.settings.cfg_normalization}

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * 8  # the pipeline's default_sample_size × its vae_scale_factor
        return size, size

    def check_size(self, height: int, width: int) -> None:
        require_rope_positions("Lumina-Image 2.0", self.pixels_per_token, self.transformer.config.axes_lens,
                               height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        # μ of the pipeline's `latents.shape[1]`: the latent channel count (module docstring).
        return flux_sigmas(self.scheduler, num_steps, self.vae.config.latent_channels, self.device)

    def _encode_texts(self, texts: list[str]) -> torch.Tensor:
        """Gemma2's second-to-last hidden state over each text's window, with its attention mask, then the mask as
        the last channel: `[B, L, D + 1]` (fp32)."""
        batch = self.tokenizer(texts, padding="max_length", max_length=self.settings.max_sequence_length,
                               truncation=True, return_tensors="pt")
        device = next(self.text_encoder.parameters()).device
        mask = batch.attention_mask.to(device)
        hidden = self.text_encoder(batch.input_ids.to(device), attention_mask=mask,
                                   output_hidden_states=True).hidden_states[-2]
        return torch.cat([hidden.float(), mask.float()[..., None]], dim=-1)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each text encoded as a prompt (behind the system prompt) and as a negative prompt (alone), the two side
        by side on the last axis (module docstring)."""
        if self.text_encoder is None:
            raise RuntimeError("this Lumina-Image 2.0 model was loaded without its text encoder")
        as_prompt = [f"{self.settings.system_prompt} <Prompt Start> {p}" for p in prompts]
        both = self._encode_texts([*as_prompt, *prompts])
        packed = torch.cat([both[: len(prompts)], both[len(prompts) :]], dim=-1)
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1, device=packed.device))

    @staticmethod
    def encodings(embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(as a prompt, as a negative prompt), each `[..., L, D + 1]`, from the packed conditioning."""
        return embeds.chunk(2, dim=-1)

    @classmethod
    def unpack_conditioning(cls, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Gemma tokens `[B, L, D]`, the tokenizer's attention mask `[B, L]` as 0/1 integers) of the encoding a
        forward reads (the first)."""
        first = cls.encodings(embeds)[0]
        return first[..., :-1], (first[..., -1] > 0.5).long()

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
        """Both CFG halves in one forward, the negative prompt's rows first, read as the pipeline encodes a negative
        prompt (without the system prompt): its second encoding moved first."""
        as_prompt, as_negative = self.encodings(uncond.embeds)
        negative = torch.cat([as_negative, as_prompt], dim=-1)
        return PromptEmbeds(torch.cat([negative, cond.embeds]), cond.ids)

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """Both encodings of the text, the Gemma tokens and masks under the transformer's names (sglang-diffusion
        serves no Lumina 2; `negative_*`: the text encoded as a negative prompt); the transformer positions text and
        image itself, so no ids travel."""
        as_prompt, as_negative = self.encodings(cond.embeds[0])
        return {"encoder_hidden_states": [as_prompt[:, :-1]], "encoder_attention_mask": as_prompt[:, -1],
                "negative_encoder_hidden_states": [as_negative[:, :-1]],
                "negative_encoder_attention_mask": as_negative[:, -1]}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        halves = []
        for prefix in ("", "negative_"):
            tokens = wire_text_tokens({"encoder_hidden_states": kwargs.get(f"{prefix}encoder_hidden_states")})
            mask = kwargs.get(f"{prefix}encoder_attention_mask")
            if not isinstance(mask, torch.Tensor) or mask.shape != (tokens.shape[0],):
                raise ValueError(f"{prefix}encoder_attention_mask: expected a [{tokens.shape[0]}] tensor, one value "
                                 f"per text token")
            halves.append(torch.cat([tokens, mask.to(tokens.dtype)[:, None]], dim=1))
        if halves[0].shape != halves[1].shape:
            raise ValueError(f"negative_encoder_hidden_states: expected the shape of encoder_hidden_states "
                             f"{tuple(halves[0].shape[:1])}, got {tuple(halves[1].shape[:1])}")
        packed = torch.cat(halves, dim=1)[None]
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1)), None

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (self.vae.config.latent_channels, height // self.vae_scale, width // self.vae_scale)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        text, mask = self.unpack_conditioning(cond.embeds)
        timestep = 1 - sigma * 1000 / 1000  # the pipeline's 1 − t/1000 of the scheduler's t = σ·1000
        with self.forward_precision():
            out = transformer(hidden_states=latents.tokens.to(dtype), timestep=timestep.to(dtype),
                              encoder_hidden_states=text.to(dtype), encoder_attention_mask=mask, return_dict=False)[0]
        return -out.float()  # the model predicts the negated velocity

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma) -> torch.Tensor:
        guided = v_uncond + guidance_scale * (v_cond - v_uncond)
        if self.settings.cfg_normalization:
            # The pipeline's renormalization, over the latent's last axis as it writes it (a norm per latent row,
            # not per sample); the norms do not see the velocity's sign.
            guided = guided * (v_cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True))
        return guided

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        config = self.vae.config
        latents = latents / config.scaling_factor + config.shift_factor
        return decode_images(self.vae, latents, per_call=self.vae_decode_batch)
