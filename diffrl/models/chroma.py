"""The `chroma` family: Chroma (diffusers' `ChromaTransformer2DModel`, driven by `ChromaPipeline`), text to image.

Chroma is a FLUX.1 [schnell] derivative: the same double- and single-stream blocks, the same 16-channel VAE and
2×2 packing, but one text encoder (T5, no pooled CLIP vector), per-block modulations from a small MLP of the
timestep alone (the "distilled guidance layer", no guidance embedding), a text attention mask, and real CFG with
a negative prompt. A checkpoint is a local diffusers-format directory:

    transformer/   ChromaTransformer2DModel     vae/        AutoencoderKL (16 latent channels, f8)
    text_encoder/  T5EncoderModel (T5-XXL)      tokenizer/  its T5 tokenizer
    scheduler/     FlowMatchEulerDiscreteScheduler

Its model_index.json may carry a `diffrl` block with `max_sequence_length` (T5 tokens, 512 as the pipeline's) and
`default_size` (1024, the pipeline's).

What this adapter reproduces of diffusers' `ChromaPipeline` (checked by `tests/test_chroma.py`):
- conditioning: the prompt tokenized into a window of `max_sequence_length` tokens (right-padded, truncated), T5's
  last hidden state computed *with* the tokenizer's attention mask (unlike FLUX.1), and the transformer's text
  mask: 1 for the prompt's tokens and the first padding token after them, 0 for the rest, as the pipeline builds
  it. The mask travels as one extra channel after T5's (`[B, L, D + 1]`), so engine, trainer and wire carry one
  tensor as for every family; text position ids are zeros `[L, 3]`. Every prompt has the same window, so prompts,
  negative prompts and microgroups share a batch;
- the forward: the text mask extended with 1 for every image token, in the transformer's dtype, as the pipeline
  passes it (diffusers 0.42.1 passes this 0/1 mask as a float tensor, which attention adds to the scores rather
  than masking with: diffusers issue #12116; what matters here is that both give the transformer the same tensor);
- latents, schedule and decode are FLUX.1's (`flux1.packed_noise`, `flux1.flux_sigmas`, `flux1.decode_packed`):
  the VAE's `[B, 16, H/8, W/8]` noise in 2×2 patches with ids `(0, row, column)`; the scheduler's sigmas for
  `linspace(1, 1/N, N)` with μ linear in the image tokens (a static-shift scheduler ignores μ); the transformer
  takes σ (the scheduler's timestep / 1000);
- CFG: `uncond + s·(cond − uncond)` on above s = 1 with the negative prompt (the empty prompt by default), the
  pipeline's `guidance_scale` (default 5). The pipeline runs the halves as two forwards; here they share one.

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
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import check_max_sequence_length, refuse_scheduler_options
from diffrl.models.flux1 import UNSUPPORTED_SCHEDULER_OPTIONS, Flux1Family, decode_packed, flux_sigmas, packed_noise


@dataclass
class ChromaSettings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    max_sequence_length: int = 512  # ChromaPipeline's default T5 window
    default_size: int = 1024  # the pipeline's default_sample_size (128) × the VAE's 8


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the modulation MLP
    (`distilled_guidance_layer`, over the timestep's embedding) is the only layer whose matmul row count follows the
    batch size (its rows are batch × modulation slots); it runs one distinct row at a time. The blocks' norms have
    no projection of their own (they slice its output). Not on GPU, where batched kernels differ anyway."""
    embed_rows_one_at_a_time(transformer.distilled_guidance_layer)


@register_family
class ChromaFamily(FamilyAdapter):
    name = "chroma"
    name_patterns = ("chroma",)
    reference_pipeline_class = "ChromaPipeline"
    display_name = "Chroma"
    default_guidance_scale = 5.0  # ChromaPipeline's default guidance_scale (real CFG)
    default_num_inference_steps = 35  # diffusers' ChromaPipeline default (sglang-diffusion has no Chroma)
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes σ
    # FLUX.1's blocks under the same names, so FLUX.1's LoRA targets and block lists.
    lora_target_modules = Flux1Family.lora_target_modules
    block_lists = Flux1Family.block_lists
    components = (
        Component("transformer", "diffusers:ChromaTransformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:T5EncoderModel", text_encoder=True),
    )
    settings_class = ChromaSettings

    def __init__(self, transformer, vae, scheduler, tokenizer, text_encoder, *, settings: ChromaSettings | None = None):
        settings = copy.copy(settings or ChromaSettings())
        config = transformer.config
        check_max_sequence_length("chroma", settings.max_sequence_length, limit=512, pipeline="ChromaPipeline")
        latent_channels = vae.config.latent_channels
        if config.in_channels != 4 * latent_channels:
            raise ModelLoadError(f"chroma: the transformer takes {config.in_channels} channels; 2x2 patches of the "
                                 f"VAE's {latent_channels} latent channels are {4 * latent_channels}")
        if text_encoder is not None and text_encoder.config.d_model != config.joint_attention_dim:
            raise ModelLoadError(f"chroma: the text encoder's width {text_encoder.config.d_model} is not the "
                                 f"transformer's text input {config.joint_attention_dim}")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        self.pixels_per_token = 2 ** (len(vae.config.block_out_channels) - 1) * 2

    def reference_pipeline_kwargs(self) -> dict:
        return {"max_sequence_length": self.settings.max_sequence_length}

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_pixel_multiple("Chroma", self.pixels_per_token, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return flux_sigmas(self.scheduler, num_steps, image_tokens, self.device)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """T5 over each prompt's window with its attention mask, then the transformer's text mask as the last
        channel (module docstring)."""
        if self.text_encoder is None:
            raise RuntimeError("this Chroma model was loaded without its text encoder")
        batch = self.tokenizer(list(prompts), padding="max_length", max_length=self.settings.max_sequence_length,
                               truncation=True, return_tensors="pt")
        device = next(self.text_encoder.parameters()).device
        mask = batch.attention_mask.to(device)
        tokens = self.text_encoder(batch.input_ids.to(device), attention_mask=mask, output_hidden_states=False)[0]
        # The transformer sees the prompt's tokens and one padding token: positions up to the token count.
        positions = torch.arange(mask.shape[1], device=device)[None]
        keep = (positions <= mask.sum(dim=1, keepdim=True)).float()
        packed = torch.cat([tokens.float(), keep[..., None]], dim=-1)
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 3, device=packed.device))

    @staticmethod
    def unpack_conditioning(embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T5 tokens `[B, L, D]`, the transformer's text mask `[B, L]`, 0 or 1) from the packed conditioning."""
        return embeds[..., :-1], embeds[..., -1]

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The T5 tokens, the text mask as `prompt_attention_mask` [L] (the pipeline's name) and the position ids
        (sglang-diffusion serves no Chroma: these are diffrl's names)."""
        tokens, keep = self.unpack_conditioning(cond.embeds[0])
        return {"encoder_hidden_states": [tokens], "prompt_attention_mask": keep, "txt_ids": cond.ids,
                "img_ids": image_ids}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        tokens = wire_text_tokens(kwargs)
        keep = kwargs.get("prompt_attention_mask")
        if not isinstance(keep, torch.Tensor) or keep.shape != (tokens.shape[0],):
            raise ValueError(f"prompt_attention_mask: expected a [{tokens.shape[0]}] tensor, one value per text token")
        packed = torch.cat([tokens, keep.float()[:, None]], dim=1)[None]
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 3)), kwargs.get("img_ids")

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        return packed_noise(generators, self.vae.config.latent_channels, height // self.pixels_per_token,
                            width // self.pixels_per_token, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        text, keep = self.unpack_conditioning(cond.embeds)
        tokens = latents.tokens
        # The pipeline's mask: the text mask, then 1 for every image token (`ChromaPipeline._prepare_attention_mask`).
        mask = torch.cat([keep.to(dtype), keep.new_ones(tokens.shape[0], tokens.shape[1], dtype=dtype)], dim=1)
        timestep = sigma * 1000 / 1000  # the scheduler's timestep / 1000, as the pipeline passes it
        with self.forward_precision():
            return transformer(hidden_states=tokens.to(dtype), timestep=timestep.to(dtype),
                               encoder_hidden_states=text.to(dtype), txt_ids=cond.ids.to(latents.ids),
                               img_ids=latents.ids, attention_mask=mask, return_dict=False)[0].float()

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_packed(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                             per_call=self.vae_decode_batch)
