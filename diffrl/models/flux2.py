"""The `flux2` family: FLUX.2 [dev] and FLUX.2 [klein] (4B / 9B, base and distilled), diffusers'
`Flux2Transformer2DModel` driven by `Flux2Pipeline` (dev) or `Flux2KleinPipeline` (klein), text to image and
reference-image editing.

One family: the two pipelines share the transformer class, the VAE, the latents, the position ids, the schedule and
the decode, and differ only in the text encoder (and in the guidance embedding that dev's transformer has). A
checkpoint is a local diffusers-format directory:

    transformer/   Flux2Transformer2DModel    vae/        AutoencoderKLFlux2 (with its latent BatchNorm)
    text_encoder/  dev: Mistral3ForConditionalGeneration (Mistral Small 3.2); klein: Qwen3ForCausalLM (Qwen3 4B / 8B)
    tokenizer/     its tokenizer, with a chat template       scheduler/  FlowMatchEulerDiscreteScheduler

The text encoder's class says which variant it is (`text_encoder` in model_index.json; its `_class_name` when that
is missing). model_index.json's `is_distilled` (what `Flux2KleinPipeline` saves) marks klein's step-distilled
checkpoints. The `diffrl` block may set `guidance` (dev's embedded guidance, 4.0 by default as the pipeline's and
sglang-diffusion's), `distilled`, `text_encoder_out_layers` (dev (10, 20, 30), klein (9, 18, 27)),
`max_sequence_length` (512) and `default_size` (1024).

What this adapter reproduces of the pipelines (checked by `tests/test_flux2.py`):
- conditioning: the prompt through the tokenizer's chat template (dev: FLUX.2's system message, then the prompt as
  a user turn; klein: a user turn, the generation prompt, thinking off), right-padded to `max_sequence_length`
  tokens (the transformer attends to the padding: the window is part of the model), and the hidden states of the
  text encoder layers stacked along the channels; text position ids (0, 0, 0, k);
- latents: the VAE's 2×2-patchified channels `[B, 4C, h, w]` packed to tokens, position ids (0, row, column, 0);
  decoded through the VAE's BatchNorm statistics (`diffrl.models.flux2_vae`, shared with flux3_image);
- schedule: the scheduler's own for `linspace(1, 1/N, N)` with FLUX.2's empirical μ (a fit on token and step counts);
  the transformer takes σ (the scheduler's timestep / 1000);
- guidance: FLUX.2 [dev] is guidance-distilled: every forward embeds the checkpoint's `guidance` (the pipeline's
  `guidance_scale`). A request's `guidance_scale` is true CFG on top (`uncond + s·(cond − uncond)`, off at s ≤ 1,
  the default), as sglang-diffusion reads it (its embedded scale is a server setting); `Flux2Pipeline` has no true
  CFG. FLUX.2 [klein] has no guidance embedding: a request's scale is the pipeline's CFG (default 4 on the base
  checkpoints; off, with 4 steps, on the distilled ones, whose pipeline ignores CFG).
- editing (image-conditioned requests, `image_path`: up to 10 reference images, the pipelines' `image`): each
  reference at its own size, downscaled to 1024² when above it (Lanczos) and center-cropped to multiples of
  `pixels_per_token`, refused below 64 pixels a side or beyond an 8:1 aspect ratio (the pipelines' checks);
  VAE-encoded (the distribution's mode), patchified, normalized with the VAE's BatchNorm statistics and packed to
  tokens with position ids (10·(i + 1), row, column, 0) for reference i; concatenated after the noisy tokens in every
  forward (CFG's negative pass too), whose output keeps the generated tokens. The prompt is encoded as without images
  (`Flux2Pipeline`'s caption upsampling, which looks at them, is off by default and not reproduced). The references'
  tokens travel inside the prompt's conditioning (`diffrl.models.flux2_vae.fold_references`, shared with
  flux3_image), so the engine, the denoising env and the trainer carry them unchanged.
Scheduler options that change the step are refused.
"""

from __future__ import annotations

import copy
import json
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
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import (
    check_max_sequence_length,
    checkpoint_class,
    read_settings,
    refuse_scheduler_options,
)
from diffrl.models.flux1 import UNSUPPORTED_SCHEDULER_OPTIONS
from diffrl.models.flux2_vae import (
    MAX_REFERENCE_IMAGES,
    crop_reference,
    decode_latents,
    encode_reference,
    fold_references,
    image_position_ids,
    noise_tokens,
    pack_references,
    reference_ids,
    split_references,
    text_position_ids,
)
from diffrl.models.flux3_image import run_flux3_transformer
from diffrl.sampling import flux2_empirical_mu

DEFAULT_GUIDANCE = 4.0  # Flux2Pipeline's guidance_scale default, sglang-diffusion's FLUX.2 embedded_cfg_scale
# The text encoder class of each variant, and the layers its pipeline stacks.
TEXT_ENCODERS = {"dev": "Mistral3ForConditionalGeneration", "klein": "Qwen3ForCausalLM"}
TEXT_LAYERS = {"dev": (10, 20, 30), "klein": (9, 18, 27)}


@dataclass
class Flux2Settings:
    """Per-checkpoint values outside the components' configs (see the module docstring)."""

    variant: str = "dev"  # "dev" (Mistral text encoder, guidance embedding) or "klein" (Qwen3): from the checkpoint
    distilled: bool = False  # klein's step-distilled checkpoints: CFG off and 4 steps by default
    guidance: float = DEFAULT_GUIDANCE  # embedded guidance (checkpoints with a guidance embedding only)
    text_encoder_out_layers: tuple[int, ...] | None = None  # None: the variant's
    max_sequence_length: int = 512
    default_size: int = 1024

    def __post_init__(self):
        if self.variant not in TEXT_ENCODERS:
            raise ModelLoadError(f"flux2: unknown variant {self.variant!r}; expected one of {sorted(TEXT_ENCODERS)}")
        self.text_encoder_out_layers = tuple(self.text_encoder_out_layers or TEXT_LAYERS[self.variant])
        check_max_sequence_length("flux2", self.max_sequence_length, limit=512)


def _load_tokenizer(folder: Path, dtype: torch.dtype):
    """The tokenizer, with its processor's chat template when only the processor holds it (FLUX.2 [dev] ships a
    Pixtral processor in `tokenizer/`)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    template_file = folder / "chat_template.json"
    if tokenizer.chat_template is None and template_file.is_file():
        tokenizer.chat_template = json.loads(template_file.read_text()).get("chat_template")
    if tokenizer.chat_template is None:
        raise ModelLoadError(f"flux2: the tokenizer in {folder} has no chat template (FLUX.2 encodes prompts "
                             "through it)")
    return tokenizer


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose
    matmul row count is the batch size (the timestep and guidance MLPs, the modulations computed from their sum, the
    output norm's) run one distinct row at a time. Not on GPU, where batched kernels differ anyway."""
    embed = transformer.time_guidance_embed
    embed_rows_one_at_a_time(embed.timestep_embedder)
    if embed.guidance_embedder is not None:
        embed_rows_one_at_a_time(embed.guidance_embedder)
    for module in (transformer.double_stream_modulation_img, transformer.double_stream_modulation_txt,
                   transformer.single_stream_modulation, transformer.norm_out.linear):
        embed_rows_one_at_a_time(module)


@register_family
class Flux2Family(FamilyAdapter):
    name = "flux2"
    name_patterns = ("flux.2", "flux2", "flux-2", "flux_2")
    display_name = "FLUX.2"
    default_guidance_scale = 1.0  # dev: no true CFG (it samples with its embedded guidance); klein base sets 4
    default_num_inference_steps = 50  # sglang-diffusion's FLUX.2 default and diffusers' pipelines'
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes σ
    # Flow-Factory's FLUX.2 and FLUX.2 [klein] LoRA targets: the double blocks' attention projections of both streams
    # and their MLPs, the single blocks' fused QKV-MLP projection (`attn.to_out.0` matches the double blocks only:
    # a single block's output projection is `attn.to_out` itself).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj",
                           "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out", "ff.linear_in", "ff.linear_out",
                           "ff_context.linear_in", "ff_context.linear_out", "attn.to_qkv_mlp_proj")
    block_lists = ("transformer_blocks", "single_transformer_blocks")
    components = (
        Component("transformer", "diffusers:Flux2Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKLFlux2"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", _load_tokenizer, kind="tokenizer"),
        Component("text_encoder", f"transformers:{TEXT_ENCODERS['dev']}", text_encoder=True),
    )
    settings_class = Flux2Settings

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, *, settings: Flux2Settings | None = None):
        settings = settings or Flux2Settings()
        config = transformer.config
        latent_channels = vae.config.latent_channels
        if config.in_channels != 4 * latent_channels:
            raise ModelLoadError(f"flux2: the transformer takes {config.in_channels} channels; 2x2 patches of the "
                                 f"VAE's {latent_channels} latent channels are {4 * latent_channels}")
        if text_encoder is not None:
            width = text_encoder.config.get_text_config().hidden_size * len(settings.text_encoder_out_layers)
            if width != config.joint_attention_dim:
                raise ModelLoadError(f"flux2: {len(settings.text_encoder_out_layers)} stacked text layers are "
                                     f"{width} wide; the transformer reads {config.joint_attention_dim}")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        self.guidance_distilled = bool(config.guidance_embeds)
        if settings.variant == "klein":
            if settings.distilled:  # step-distilled: its pipeline ignores CFG; sglang's Klein default is 4 steps
                self.default_num_inference_steps = 4
            else:
                self.default_guidance_scale = 4.0  # Flux2KleinPipeline's default
        self.pixels_per_token = 2 ** (len(vae.config.block_out_channels) - 1) * 2
        self.accepts_image_conditioning = True  # reference-image editing (module docstring)
        self.max_condition_images = MAX_REFERENCE_IMAGES

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> Flux2Settings:
        """The variant from the text encoder's class (else the pipeline's), `distilled` from `is_distilled`; the
        `diffrl` block overrides either."""
        found = checkpoint_class(root, "text_encoder")
        by_class = {name: variant for variant, name in TEXT_ENCODERS.items()}
        if found in by_class:
            variant = by_class[found]
        elif found is None:
            variant = "klein" if index.get("_class_name", "").startswith("Flux2Klein") else "dev"
        else:
            raise ModelLoadError(f"flux2: {root / 'text_encoder'} holds {found}; FLUX.2 [dev] encodes prompts with "
                                 f"{TEXT_ENCODERS['dev']}, FLUX.2 [klein] with {TEXT_ENCODERS['klein']}")
        return read_settings(Flux2Settings, index, root / "model_index.json", variant=variant,
                             distilled=bool(index.get("is_distilled", False)))

    @classmethod
    def checkpoint_components(cls, settings: Flux2Settings) -> list[Component]:
        """The table with the variant's text encoder class."""
        encoder = Component("text_encoder", f"transformers:{TEXT_ENCODERS[settings.variant]}", text_encoder=True)
        return [encoder if c.folder == "text_encoder" else c for c in cls.components]

    @property
    def embedded_guidance(self) -> float | None:
        """The guidance scale every forward embeds (None for a checkpoint without the embedding: klein)."""
        return float(self.settings.guidance) if self.guidance_distilled else None

    def reference_pipeline(self):
        """diffusers' `Flux2Pipeline` (dev) or `Flux2KleinPipeline` (klein, with `is_distilled`) over this family's
        own components (a copy of the scheduler, whose state sampling changes); call it with
        `reference_pipeline_kwargs()`."""
        from diffusers import Flux2KleinPipeline, Flux2Pipeline

        if self.settings.variant == "klein":
            return self.pipeline_over_components(Flux2KleinPipeline, is_distilled=self.settings.distilled)
        return self.pipeline_over_components(Flux2Pipeline)

    def reference_pipeline_kwargs(self) -> dict:
        """The checkpoint's text window and layers (and dev's embedded guidance): inputs of each pipeline call."""
        kwargs = {"max_sequence_length": self.settings.max_sequence_length,
                  "text_encoder_out_layers": self.settings.text_encoder_out_layers}
        if self.settings.variant == "dev":
            kwargs["guidance_scale"] = self.settings.guidance
        return kwargs

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_pixel_multiple("FLUX.2", self.pixels_per_token, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps),
                                mu=flux2_empirical_mu(image_tokens, num_steps), device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def text_windows(self, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask `[B, max_sequence_length]` of the chat-templated prompts, as the variant's pipeline
        makes them."""
        length = self.settings.max_sequence_length
        if self.settings.variant == "dev":
            # lazy: importing any diffusers pipeline module imports diffusers' whole model stack (seconds)
            from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE as DEV_SYSTEM_MESSAGE

            conversations = [[{"role": "system", "content": [{"type": "text", "text": DEV_SYSTEM_MESSAGE}]},
                              {"role": "user", "content": [{"type": "text", "text": p.replace("[IMG]", "")}]}]
                             for p in prompts]
            batch = self.tokenizer.apply_chat_template(
                conversations, add_generation_prompt=False, tokenize=True, return_dict=True, return_tensors="pt",
                padding="max_length", truncation=True, max_length=length)
            return batch["input_ids"], batch["attention_mask"]
        texts = [self.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=False)
                 for p in prompts]
        batch = self.tokenizer(texts, return_tensors="pt", padding="max_length", truncation=True, max_length=length)
        return batch["input_ids"], batch["attention_mask"]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        if self.text_encoder is None:
            raise RuntimeError("this FLUX.2 model was loaded without its text encoder")
        ids, mask = self.text_windows(list(prompts))
        device = next(self.text_encoder.parameters()).device
        out = self.text_encoder(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True,
                                use_cache=False)
        layers = torch.stack([out.hidden_states[k] for k in self.settings.text_encoder_out_layers], dim=2)
        embeds = layers.flatten(2).float()  # [B, L, layers·D], layer-major per token as the pipelines stack them
        return PromptEmbeds(embeds, text_position_ids(embeds.shape[1], device=embeds.device))

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        tokens = noise_tokens(generators, self.transformer.config.in_channels, h, w, device=self.device)
        return Latents(tokens, image_position_ids(h, w, device=self.device))

    def encode_condition_images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's reference images `uint8 [3, H, W]` → their packed tokens `[1, S, C]` and ids `[S, 4]`, as the
        pipelines prepare `image` (module docstring)."""
        latents, ids = [], []
        for i, image in enumerate(images):
            height, width = image.shape[1:]
            if min(height, width) < 64 or max(height / width, width / height) > 8:
                raise RequestError("image_path", f"image_path[{i}] is {width}x{height} pixels; FLUX.2 takes references "
                                                 "of at least 64 pixels a side and at most an 8:1 aspect ratio")
            sized = crop_reference(image, self.pixels_per_token, **self.condition_area_cap())
            latent = encode_reference(self.vae, sized, device=self.device)
            latents.append(latent)
            ids.append(reference_ids(*latent.shape[-2:], t=10.0 * (i + 1), device=self.device))
        return pack_references(latents, ids)

    def condition_on_images(self, cond: PromptEmbeds, encoded: tuple[torch.Tensor, torch.Tensor]) -> PromptEmbeds:
        return fold_references(cond, encoded)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        guidance = torch.full_like(sigma, self.settings.guidance) if self.guidance_distilled else None
        timestep = sigma * 1000 / 1000  # the scheduler's timestep / 1000, as the pipelines pass it
        cond, references = split_references(cond, self.transformer.config.in_channels,
                                            (self.settings.max_sequence_length,))
        generated = latents.tokens.shape[1]
        if references is not None:  # the references' tokens after the noisy ones, with their own ids
            tokens, ids = references
            latents = Latents(torch.cat([latents.tokens, tokens.to(latents.tokens)], dim=1),
                              torch.cat([latents.ids, ids.to(latents.ids)]))
        return run_flux3_transformer(self, transformer, latents, timestep, cond, guidance=guidance)[:, :generated]

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              per_call=self.vae_decode_batch)
