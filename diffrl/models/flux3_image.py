"""The `flux3_image` family: FLUX 3 Image Klein (diffusers' `Flux3Transformer2DModel`), text to image and
reference-image editing.

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
- CFG is `uncond + s·(cond − uncond)`; at s ≤ 1 a step is one conditional forward;
- editing (image-conditioned requests, `image_path`: up to 10 reference images, the modular pipeline's `image`):
  one reference is kept whole: downscaled (Lanczos) until its canvas, its sides rounded up to whole tokens (at
  least 64 pixels), fits 4 megapixels, and reflect-padded to the canvas; several are each downscaled to 1
  megapixel when above it and center-cropped to whole tokens (`Flux3ImageProcessor`'s "fill" and "crop"). Each is
  VAE-encoded (the mode), patchified, BatchNorm-normalized and packed, with position ids (0, h, w, -(i + 1)) (h, w
  scaled as the image's), and goes to the transformer's own reference mode (`image_cond_hidden_states`: its own
  blocks, modulated at timestep 0, joined to the generated tokens in the single blocks, no output). The output
  size is the request's, so the pipeline's crop back to a padded reference (when it derives the size from it) does
  not arise. The tokens travel inside the prompt's conditioning (`diffrl.models.flux2_vae.fold_references`).
The step-distilled (flow-map) variant is refused: it samples with a different transition.

`diffrl.models.random_checkpoints.flux3_image` writes a checkpoint of this layout with random weights:
tests use `tiny`, benchmarks `real` (the class defaults).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    read_json,
    register_family,
    require_pixel_multiple,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.flux2_vae import (
    MAX_REFERENCE_IMAGES,
    crop_reference,
    decode_latents,
    encode_reference,
    fill_reference,
    fold_references,
    image_position_ids,
    noise_tokens,
    pack_references,
    reference_ids,
    split_references,
    text_position_ids,
)
from diffrl.sampling import make_sigmas

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

    def __post_init__(self):
        self.text_encoder_out_layers = tuple(self.text_encoder_out_layers)  # JSON gives a list


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


def run_flux3_transformer(family: FamilyAdapter, transformer, latents: Latents, sigma: torch.Tensor,
                          cond: PromptEmbeds, references: tuple[torch.Tensor, torch.Tensor] | None = None,
                          **inputs) -> torch.Tensor:
    """One forward of diffusers' `Flux3Transformer2DModel` or `Flux2Transformer2DModel`, which take the same inputs
    (σ is their timestep; `inputs`: FLUX.2's `guidance`): `run_transformer` of the families built on them
    (flux3_image, demo, flux2). `references`: FLUX 3's reference-image tokens `[B, S, C]` and ids `[S, 4]`."""
    dtype = next(transformer.parameters()).dtype
    if references is not None:
        inputs.update(image_cond_hidden_states=references[0].to(dtype), image_cond_ids=references[1])
    with family.forward_precision():
        return transformer(hidden_states=latents.tokens.to(dtype), encoder_hidden_states=cond.embeds.to(dtype),
                           timestep=sigma.to(dtype), img_ids=latents.ids, txt_ids=cond.ids, **inputs,
                           return_dict=False)[0].float()


class _ChatProcessor:
    """What diffusers' FLUX 3 text step uses of the Qwen3-VL processor (chat template, tokenizer), for
    text-only prompts; the real processor needs torchvision for its video half."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)


@register_family
class Flux3ImageFamily(FamilyAdapter):
    name = "flux3_image"
    name_patterns = ("flux3", "flux.3", "flux-3")
    display_name = "FLUX 3"
    default_guidance_scale = 3.5  # diffusers' FLUX 3 pipeline default
    default_num_inference_steps = 50  # diffusers' FLUX 3 pipeline default (sglang-diffusion has no FLUX 3)
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes σ
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "linear_in", "linear_out")
    block_lists = ("mode_blocks", "txt_mode_blocks", "single_transformer_blocks")
    # The scheduler config is optional (its static shift is read from it, see `_static_shift`).
    components = (
        Component("transformer", "diffusers:Flux3Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKLFlux2"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Qwen3VLForConditionalGeneration", text_encoder=True),
    )
    settings_class = Flux3Settings
    root: Path | None = None  # the checkpoint directory, when loaded from one (the reference pipeline's scheduler)

    def __init__(self, transformer, vae, text_encoder, tokenizer, *, shift: float, settings: Flux3Settings):
        if getattr(transformer.config, "flow_map", False):
            raise ModelLoadError("this is the step-distilled FLUX 3 (flow_map=True), which samples with its own "
                                 "transition; flux3_image trains and samples the base model only")
        if tokenizer.chat_template is None:
            raise ModelLoadError("flux3_image: the tokenizer has no chat template (FLUX 3 encodes prompts through "
                                 "it)")
        self.transformer = transformer
        embed_rows_one_at_a_time(transformer.timestep_embedder)  # sample k is the same in any batch
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.shift = shift
        self.settings = settings
        # VAE pixels per latent token side: the VAE's downsampling, then the 2x2 patchify.
        self.pixels_per_token = 2 ** (len(vae.config.block_out_channels) - 1) * 2
        self.accepts_image_conditioning = True  # reference-image editing (module docstring)
        self.max_condition_images = MAX_REFERENCE_IMAGES
        multiple = settings.text_pad_multiple  # the text windows a conditioning may hold (`split_references`)
        self.text_lengths = (*range(multiple, MAX_TEXT_TOKENS, multiple), MAX_TEXT_TOKENS)

    @classmethod
    def from_components(cls, root, parts, settings) -> Flux3ImageFamily:
        family = cls(parts["transformer"], parts["vae"], parts["text_encoder"], parts["tokenizer"],
                     shift=_static_shift(root / "scheduler"), settings=settings)
        family.root = Path(root)
        return family

    def reference_pipeline(self):
        """diffusers' FLUX 3 modular pipeline (`Flux3AutoBlocks` less the prompt upsampler: the prompt is
        encoded as given) over this family's own components (no copy of the weights): what the tests check
        the engine against and the benchmarks time it against. Its CFG is its guider's, here at the family's
        default scale (another: `pipe.update_components(guider=pipe.guider.new(guidance_scale=...))`); call
        it with `reference_pipeline_kwargs()`."""
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.guiders import ClassifierFreeGuidance
        from diffusers.modular_pipelines.flux3 import Flux3AutoBlocks
        from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor

        scheduler_dir = None if self.root is None else self.root / "scheduler"
        if scheduler_dir is not None and (scheduler_dir / "scheduler_config.json").is_file():
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(scheduler_dir, shift=self.shift)
        else:  # no scheduler config: diffusers' default scheduler at FLUX 3's shift, as `_static_shift` reads it
            scheduler = FlowMatchEulerDiscreteScheduler(shift=self.shift)
        blocks = Flux3AutoBlocks()
        blocks.sub_blocks.pop("prompt_upsampler")  # encode the prompt as given
        pipe = blocks.init_pipeline()
        pipe.update_components(transformer=self.transformer, vae=self.vae, text_encoder=self.text_encoder,
                               tokenizer=_ChatProcessor(self.tokenizer), scheduler=scheduler,
                               guider=ClassifierFreeGuidance(guidance_scale=self.default_guidance_scale),
                               image_processor=Flux3ImageProcessor(vae_scale_factor=self.pixels_per_token))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    def reference_pipeline_kwargs(self) -> dict:
        """The checkpoint's text encoder layers: an input of each pipeline call, whose default is FLUX 3's."""
        return {"text_encoder_out_layers": self.settings.text_encoder_out_layers}

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        step = self.pixels_per_token
        require_pixel_multiple("FLUX 3", step, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        return make_sigmas(num_steps, shift=self.shift, device=self.device)

    def set_flow_shift(self, shift: float) -> None:
        if not shift > 0:
            raise ModelLoadError(f"flux3_image: a flow shift must be > 0, got {shift}")
        self.shift = float(shift)

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
        tokens = noise_tokens(generators, self.transformer.config.in_channels, h, w, device=self.device)
        return Latents(tokens, image_position_ids(h, w, self.settings.image_rope_scale, device=self.device))

    def encode_condition_images(self, images) -> tuple[torch.Tensor, torch.Tensor]:
        """A request's reference images `uint8 [3, H, W]` → their packed tokens `[1, S, C]` and ids `[S, 4]`, as the
        modular pipeline prepares `image` (module docstring)."""
        step, latents, ids = self.pixels_per_token, [], []
        for i, image in enumerate(images):
            try:
                cap = self.condition_area_cap()
                sized = fill_reference(image, step, **cap) if len(images) == 1 else crop_reference(image, step, **cap)
            except ValueError as err:
                raise RequestError("image_path", f"image_path[{i}]: {err}") from None
            latent = encode_reference(self.vae, sized, device=self.device)
            latents.append(latent)
            ids.append(reference_ids(*latent.shape[-2:], l=-(i + 1.0), rope_scale=self.settings.image_rope_scale,
                                     device=self.device))
        return pack_references(latents, ids)

    def condition_on_images(self, cond: PromptEmbeds, encoded: tuple[torch.Tensor, torch.Tensor]) -> PromptEmbeds:
        return fold_references(cond, encoded)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        cond, references = split_references(cond, self.transformer.config.cond_in_channels, self.text_lengths)
        return run_flux3_transformer(self, transformer, latents, sigma, cond, references)

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              per_call=self.vae_decode_batch)
