"""The `sana` family: SANA (diffusers' `SanaTransformer2DModel`, driven by `SanaPipeline`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   SanaTransformer2DModel      vae/        AutoencoderDC (DC-AE: 32 latent channels, f32)
    text_encoder/  Gemma2Model (Gemma-2 2B)    tokenizer/  its Gemma tokenizer
    scheduler/     DPMSolverMultistepScheduler on flow σ's (published checkpoints) or FlowMatchEulerDiscreteScheduler

Its model_index.json may carry a `diffrl` block with `max_sequence_length` (the prompt's Gemma tokens, 300 as the
pipeline's), `default_size` (1024, the pipeline's) and `complex_human_instruction` (true: the pipeline's default
instruction; false: none; or a list of lines, as the pipeline's argument).

What this adapter reproduces of diffusers' `SanaPipeline` (checked by `tests/test_sana.py`):
- conditioning, as the pipeline's defaults do it: the prompt lower-cased and stripped (`clean_caption=False`),
  the complex human instruction (its lines joined by newlines) put in front of it, the whole tokenized right-padded
  and truncated to the instruction's token count + `max_sequence_length` − 2, Gemma-2's last hidden state computed
  with the tokenizer's attention mask, then the first token (BOS) and the last `max_sequence_length` − 1 tokens kept
  (the prompt's slots: its tokens have read the instruction through Gemma's causal attention), with their mask.
  The pipeline encodes the *negative* prompt without the instruction, in a window of `max_sequence_length`. The
  engine encodes a text once whichever role it plays, so each conditioning holds both encodings: rows `[0, L)` the
  text as a prompt (with the instruction), rows `[L, 2L)` the text as a negative prompt (without), each token's
  mask as the last channel (`[B, 2L, D + 1]`); a forward reads the first half, a CFG pair
  (`pair_conditionings`) the second half for its unconditional rows. Text position ids are zeros `[2L, 1]` (the
  transformer has none);
- latents: the VAE's `[B, C, H/f, W/f]` noise (unpacked: the transformer patchifies itself, no position ids),
  decoded as `vae.decode(latents / scaling_factor)`, `x/2 + 0.5` clamped;
- the schedule: the scheduler's own `set_timesteps(N)` (DPM-Solver's flow σ's `shift·s / (1 + (shift − 1)·s)`,
  or FlowMatch Euler's), static shift; the transformer's timestep is the scheduler's (σ·num_train_timesteps,
  truncated to an integer for DPM-Solver, whose timesteps are integers) times the transformer's `timestep_scale`;
- CFG: `uncond + s·(cond − uncond)` on above s = 1 (the negative prompt "" by default), the pipeline's
  `guidance_scale` (default 4.5), both halves in one forward as the pipeline runs them; a transformer whose output
  has twice the latent channels (a learned variance) gives its first half, as the pipeline keeps.

Not reproduced: the solver (our steps are the shared Euler ODE / SDE of `diffrl.sampling`; a DPM-Solver checkpoint
gets DPM-Solver's flow σ's with our steps) and the pipeline's resolution binning (`use_resolution_binning`: it
samples at the nearest aspect-ratio bin and resizes the image to the requested size; here the requested size is
sampled, which must be a multiple of 32 as the pipeline's). Refused: image-conditioned requests (text to image
only), other SANA pipelines (Sprint's guidance embedding and consistency scheduler, ControlNet, PAG), a scheduler
with dynamic shifting or off flow σ's.
"""

from __future__ import annotations

import copy
import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

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
from diffrl.models.components import (
    check_max_sequence_length,
    read_flow_scheduler,
    read_settings,
    refuse_scheduler_options,
    scheduler_sigmas,
)
from diffrl.models.vae_latents import decode_images, latent_noise

SCHEDULERS = ("DPMSolverMultistepScheduler", "FlowMatchEulerDiscreteScheduler")
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas",
                                 "use_beta_sigmas")
PIPELINE_MULTIPLE = 32  # SanaPipeline.check_inputs: height and width divisible by 32


def pipeline_default_instruction() -> list[str]:
    """`SanaPipeline.__call__`'s default `complex_human_instruction` (read from its signature, so a diffusers
    release that changes it changes ours)."""
    from diffusers import SanaPipeline

    return list(inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default)


@dataclass
class SanaSettings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    scheduler_class: str = "FlowMatchEulerDiscreteScheduler"  # read from scheduler/ (not a `diffrl` key)
    max_sequence_length: int = 300  # SanaPipeline's default Gemma window for the prompt
    default_size: int = 1024  # the pipeline's default height and width
    complex_human_instruction: bool | list[str] = True  # True: the pipeline's default instruction


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the timestep MLP and
    the AdaLN-single projection over its output are the layers whose matmul row count is the batch size; they run
    one distinct row at a time. Not on GPU, where batched kernels differ anyway."""
    embed_rows_one_at_a_time(transformer.time_embed.emb.timestep_embedder)
    embed_rows_one_at_a_time(transformer.time_embed.linear)


@register_family
class SanaFamily(FamilyAdapter):
    name = "sana"
    name_patterns = ("sana",)
    reference_pipeline_class = "SanaPipeline"
    display_name = "SANA"
    default_guidance_scale = 4.5  # SanaPipeline's default guidance_scale (real CFG)
    default_num_inference_steps = 20  # SanaPipeline's default
    # No RL framework publishes SANA LoRA targets (Flow-Factory has no SANA): every projection of both attentions,
    # the linear self-attention over the image tokens and the cross-attention to the Gemma tokens.
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:SanaTransformer2DModel"),
        Component("vae", "diffusers:AutoencoderDC"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Gemma2Model", text_encoder=True),
    )
    settings_class = SanaSettings

    def __init__(self, transformer, vae, scheduler, tokenizer, text_encoder, *, settings: SanaSettings | None = None):
        settings = copy.copy(settings or SanaSettings())
        config = transformer.config
        if config.guidance_embeds:
            raise ModelLoadError("sana: the transformer embeds a guidance scale (SANA-Sprint, a distilled few-step "
                                 "model with its own pipeline and scheduler), which this adapter does not sample")
        check_max_sequence_length("sana", settings.max_sequence_length)
        latent_channels = vae.config.latent_channels
        if config.in_channels != latent_channels:
            raise ModelLoadError(f"sana: the transformer takes {config.in_channels} channels, the VAE's latents have "
                                 f"{latent_channels}")
        if text_encoder is not None and text_encoder.config.hidden_size != config.caption_channels:
            raise ModelLoadError(f"sana: the text encoder's width {text_encoder.config.hidden_size} is not the "
                                 f"transformer's caption_channels {config.caption_channels}")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        if type(scheduler).__name__ == "DPMSolverMultistepScheduler" and \
                scheduler.config.get("prediction_type") != "flow_prediction":
            raise ModelLoadError("sana: a DPMSolverMultistepScheduler must predict flow (prediction_type "
                                 "'flow_prediction', SANA's) for its σ's to be a flow-matching schedule")
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        self.timestep_scale = float(scheduler.config.num_train_timesteps)
        self.integer_timesteps = type(scheduler).__name__ == "DPMSolverMultistepScheduler"  # int64 timesteps
        self.vae_scale = 2 ** (len(vae.config.encoder_block_out_channels) - 1)  # the pipeline's vae_scale_factor
        self.pixels_per_token = self.vae_scale * config.patch_size
        self.pixel_multiple = math.lcm(PIPELINE_MULTIPLE, self.pixels_per_token)

    # ---------------------------------------------------------------- load
    @classmethod
    def read_settings(cls, root: Path, index: dict) -> SanaSettings:
        pipeline = index.get("_class_name", "SanaPipeline")
        if pipeline != "SanaPipeline":
            raise ModelLoadError(f"sana: {root} is a {pipeline} checkpoint, which this adapter does not sample; it "
                                 "samples SanaPipeline (text to image)")
        scheduler_name, config = read_flow_scheduler("sana", root, SCHEDULERS, pipeline)
        if scheduler_name == "DPMSolverMultistepScheduler" and not config.get("use_flow_sigmas"):
            raise ModelLoadError("sana: a DPMSolverMultistepScheduler without use_flow_sigmas has no flow-matching "
                                 "schedule")
        return read_settings(SanaSettings, index, root / "model_index.json", scheduler_class=scheduler_name)

    @classmethod
    def checkpoint_components(cls, settings: SanaSettings) -> list[Component]:
        """The scheduler of the checkpoint's class (DPM-Solver on flow σ's or FlowMatch Euler)."""
        return [c if c.folder != "scheduler" else Component("scheduler", f"diffusers:{settings.scheduler_class}",
                                                            kind="scheduler") for c in cls.components]

    def reference_pipeline_kwargs(self) -> dict:
        """The checkpoint's window and instruction, and no resolution binning (the engine samples the requested
        size)."""
        return {"max_sequence_length": self.settings.max_sequence_length,
                "complex_human_instruction": self.instruction, "use_resolution_binning": False}

    @property
    def instruction(self) -> list[str] | None:
        """The complex human instruction's lines put in front of every prompt, or None."""
        chi = self.settings.complex_human_instruction
        if chi is True:
            return pipeline_default_instruction()
        return list(chi) if chi else None

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_pixel_multiple("SANA", self.pixel_multiple, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler_sigmas("sana", scheduler, num_steps, self.device)

    def _gemma(self, prompts: list[str], instruction: list[str] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(Gemma's last hidden state `[B, L, D]`, mask `[B, L]`) over the prompts' window, as
        `SanaPipeline._get_gemma_prompt_embeds` then `encode_prompt`'s selection of the first and last L − 1
        tokens."""
        length = self.settings.max_sequence_length
        prompts = [p.lower().strip() for p in prompts]  # `_text_preprocessing` without clean_caption
        window = length
        if instruction:
            chi = "\n".join(instruction)
            prompts = [chi + p for p in prompts]
            window = len(self.tokenizer.encode(chi)) + length - 2
        self.tokenizer.padding_side = "right"
        batch = self.tokenizer(prompts, padding="max_length", max_length=window, truncation=True,
                               add_special_tokens=True, return_tensors="pt")
        device = next(self.text_encoder.parameters()).device
        mask = batch.attention_mask.to(device)
        tokens = self.text_encoder(batch.input_ids.to(device), attention_mask=mask)[0]
        keep = [0, *range(-length + 1, 0)]  # BOS, then the prompt's slots at the end of the window
        return tokens[:, keep].float(), mask[:, keep].float()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each text as a prompt (with the instruction) and as a negative prompt (without), one after the other on
        the token axis, the mask as the last channel (module docstring)."""
        if self.text_encoder is None:
            raise RuntimeError("this SANA model was loaded without its text encoder")
        prompts, instruction = list(prompts), self.instruction
        as_prompt = self._gemma(prompts, instruction)
        as_negative = self._gemma(prompts, None) if instruction else as_prompt
        halves = [torch.cat([tokens, mask[..., None]], dim=-1) for tokens, mask in (as_prompt, as_negative)]
        packed = torch.cat(halves, dim=1)
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1, device=packed.device))

    @staticmethod
    def unpack_conditioning(embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(Gemma tokens `[B, L, D]`, mask `[B, L]`) that a forward reads: the prompt half of a conditioning, or a
        CFG pair's rows as `pair_conditionings` chose them."""
        return embeds[..., :-1], embeds[..., -1]

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
        """Both CFG halves in one batch, unconditional rows first: the negative prompt's own encoding (without the
        instruction, its second half) and the prompt's (the first half), as the pipeline encodes each. Always one
        batch: two forwards would each read a conditioning's first half."""
        length = cond.embeds.shape[1] // 2
        rows = torch.cat([uncond.embeds[:, length:], cond.embeds[:, :length]])
        return replace(cond, embeds=rows, ids=cond.ids[:length])

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The text as a prompt (`encoder_hidden_states`, `encoder_attention_mask` [L], the transformer's names)
        and as a negative prompt (`negative_encoder_hidden_states`, `negative_encoder_attention_mask`); diffrl's
        names (no sglang-diffusion layout to follow)."""
        length = cond.embeds.shape[1] // 2
        (tokens, keep), (neg_tokens, neg_keep) = (self.unpack_conditioning(cond.embeds[0, part]) for part in
                                                  (slice(0, length), slice(length, None)))
        return {"encoder_hidden_states": [tokens], "encoder_attention_mask": keep,
                "negative_encoder_hidden_states": neg_tokens, "negative_encoder_attention_mask": neg_keep,
                "img_ids": image_ids}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        tokens = wire_text_tokens(kwargs)
        negative = wire_text_tokens({"encoder_hidden_states": kwargs.get("negative_encoder_hidden_states")})
        if negative.shape != tokens.shape:
            raise ValueError(f"negative_encoder_hidden_states: expected {tuple(tokens.shape)}, as "
                             f"encoder_hidden_states, got {tuple(negative.shape)}")
        halves = []
        for key, text in (("encoder_attention_mask", tokens), ("negative_encoder_attention_mask", negative)):
            keep = kwargs.get(key)
            if not isinstance(keep, torch.Tensor) or keep.shape != (text.shape[0],):
                raise ValueError(f"{key}: expected a [{text.shape[0]}] tensor, one value per text token")
            halves.append(torch.cat([text, keep.float()[:, None]], dim=1))
        packed = torch.cat(halves)[None]
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1)), kwargs.get("img_ids")

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (self.transformer.config.in_channels, height // self.vae_scale, width // self.vae_scale)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        config = transformer.config
        embeds = cond.embeds
        if embeds.shape[1] == 2 * self.settings.max_sequence_length:  # a conditioning: the text as a prompt
            embeds = embeds[:, : self.settings.max_sequence_length]
        text, keep = self.unpack_conditioning(embeds)
        # The pipeline's timestep: the scheduler's t times the transformer's timestep_scale, in fp32.
        timestep = self.model_timesteps(sigma).to(latents.tokens.device) * config.timestep_scale
        with self.forward_precision():
            out = transformer(latents.tokens.to(dtype), encoder_hidden_states=text.to(dtype),
                              encoder_attention_mask=keep, timestep=timestep, return_dict=False)[0].float()
        if config.out_channels // 2 == config.in_channels:  # a learned variance: the pipeline keeps the mean
            out = out.chunk(2, dim=1)[0]
        return out

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        latents = latents / self.vae.config.scaling_factor
        return decode_images(self.vae, latents, per_call=self.vae_decode_batch)
