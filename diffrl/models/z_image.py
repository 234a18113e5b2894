"""The `z_image` family: Z-Image and Z-Image-Turbo (diffusers' `ZImageTransformer2DModel`, driven by
`ZImagePipeline`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   ZImageTransformer2DModel   vae/        AutoencoderKL (16 latent channels, f8)
    text_encoder/  Qwen3Model                 scheduler/  FlowMatchEulerDiscreteScheduler
    tokenizer/     the Qwen3 tokenizer and its chat template

Z-Image-Turbo (few-step distilled, sampled without CFG) is a setting of the same family: `turbo` in the `diffrl`
block of model_index.json, or by default a directory name containing "turbo". It changes the defaults only (CFG
off, 9 steps as sglang-diffusion serves it); the block may also set `max_sequence_length` (the pipeline's 512) and
`default_size` (1024).

What this adapter reproduces of diffusers' `ZImagePipeline` (checked by `tests/test_z_image.py`):
- prompt encoding: the prompt through the tokenizer's chat template (a user turn and the generation prompt),
  right-padded to `max_sequence_length` tokens, the text encoder's second-to-last hidden state, and only the
  real (unmasked) tokens kept. A conditioning row is those tokens plus a mask channel (1 for a real token), zero
  rows after them: prompts of different lengths share a batch zero-padded (`pads_text`), and each forward hands
  the transformer every row's own tokens, as the pipeline's list;
- latents: the VAE's `[B, 16, H/8, W/8]` noise, which the transformer patchifies itself (2×2); decoded as
  `latents / scaling_factor + shift_factor`;
- schedule: the scheduler's own for `linspace(1, 1/N, N)` with μ linear in the number of image tokens (used only
  by a dynamically shifting scheduler); the transformer's timestep is `(1000 − σ·1000) / 1000` and its output is
  the negated velocity;
- CFG in Z-Image's form `cond + g·(cond − uncond)`, the usual form at scale s = g + 1: requests carry s
  (`guidance_scale`, on above 1; default 6, the pipeline's g = 5), as for every family. The pipeline's
  `cfg_normalization` and `cfg_truncation` are left at their defaults (off).
Image-conditioned requests (the Omni, Edit and ControlNet variants) are refused, and so are scheduler options that
change the step.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from diffrl.errors import ModelLoadError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    register_family,
    require_rope_positions,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import read_settings, refuse_scheduler_options
from diffrl.models.flux1 import UNSUPPORTED_SCHEDULER_OPTIONS
from diffrl.models.masked_text import (  # noqa: F401 (pad_rows: still importable from z_image, its first home)
    MaskedTextWire,
    masked_text_conditioning,
    pad_rows,
    pad_to,
    text_lengths,
    with_mask_channel,
)
from diffrl.models.vae_latents import decode_images, latent_noise
from diffrl.sampling import resolution_mu



@dataclass
class ZImageSettings:
    """Per-checkpoint values outside the components' configs (the `diffrl` block of model_index.json)."""

    turbo: bool = False  # the few-step distilled checkpoint: CFG off and 9 steps by default
    max_sequence_length: int = 512
    default_size: int = 1024


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the timestep MLP and
    every AdaLN modulation (their row count is the batch size; their input is the timestep embedding) run one
    distinct row at a time. Not on GPU, where batched kernels differ anyway."""
    embed_rows_one_at_a_time(transformer.t_embedder)
    for name, module in transformer.named_modules():
        if name.endswith("adaLN_modulation"):
            embed_rows_one_at_a_time(module)


@register_family
class ZImageFamily(MaskedTextWire, FamilyAdapter):
    name = "z_image"
    name_patterns = ("z-image", "zimage", "z_image")
    reference_pipeline_class = "ZImagePipeline"
    display_name = "Z-Image"
    default_guidance_scale = 6.0  # the pipeline's default g = 5 in Z-Image's form (s = 1 + g)
    default_num_inference_steps = 50  # sglang-diffusion's and diffusers' Z-Image default
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000)
    pads_text = True  # conditionings of different lengths share a batch, zero-padded (see the module docstring)
    # Flow-Factory's Z-Image LoRA targets: every block's attention projections and SwiGLU MLP (the refiners' too).
    lora_target_modules = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                           "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
    block_lists = ("noise_refiner", "context_refiner", "layers")
    components = (
        Component("transformer", "diffusers:ZImageTransformer2DModel"),
        Component("vae", "diffusers:AutoencoderKL"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Qwen3Model", text_encoder=True),
    )
    settings_class = ZImageSettings

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, *, settings: ZImageSettings | None = None):
        settings = settings or ZImageSettings()
        config = transformer.config
        if getattr(config, "siglip_feat_dim", None) is not None:
            raise ModelLoadError("z_image: this is the Omni transformer (image-conditioned); the family trains and "
                                 "samples text-to-image Z-Image and Z-Image-Turbo only")
        if 2 not in tuple(config.all_patch_size) or 1 not in tuple(config.all_f_patch_size):
            raise ModelLoadError(f"z_image: the pipeline samples with 2x2 patches of one frame; this transformer has "
                                 f"patch sizes {list(config.all_patch_size)} / {list(config.all_f_patch_size)}")
        if config.in_channels != vae.config.latent_channels:
            raise ModelLoadError(f"z_image: the transformer takes {config.in_channels} channels, the VAE makes "
                                 f"{vae.config.latent_channels}")
        if text_encoder is not None and text_encoder.config.hidden_size != config.cap_feat_dim:
            raise ModelLoadError(f"z_image: the text encoder is {text_encoder.config.hidden_size} wide, the "
                                 f"transformer reads {config.cap_feat_dim}-wide text")
        if tokenizer.chat_template is None:
            raise ModelLoadError("z_image: the tokenizer has no chat template (Z-Image encodes prompts through it)")
        text_positions = -(-settings.max_sequence_length // 32) * 32 + 1  # padded to 32 tokens, then the image's frame
        if text_positions >= config.axes_lens[0]:
            raise ModelLoadError(f"z_image: max_sequence_length {settings.max_sequence_length} needs "
                                 f"{text_positions + 1} positions on the first RoPE axis; the transformer has "
                                 f"{config.axes_lens[0]}")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, settings=settings)
        if settings.turbo:
            self.default_guidance_scale = 1.0  # the distilled checkpoint samples without CFG (g = 0)
            self.default_num_inference_steps = 9  # sglang-diffusion's Z-Image-Turbo default
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        self.pixels_per_token = self.vae_scale * 2

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> ZImageSettings:
        """The `diffrl` block; `turbo` defaults to whether the directory's name says so."""
        settings = read_settings(ZImageSettings, index, root / "model_index.json",
                                 turbo="turbo" in root.resolve().name.lower())
        if settings.max_sequence_length < 1:
            raise ModelLoadError(f"{root / 'model_index.json'}: max_sequence_length must be positive")
        return settings

    @classmethod
    def from_components(cls, root, parts, settings) -> ZImageFamily:
        return cls(parts["transformer"], parts["vae"], parts["text_encoder"], parts["tokenizer"], parts["scheduler"],
                   settings=settings)

    def reference_pipeline_kwargs(self) -> dict:
        return {"max_sequence_length": self.settings.max_sequence_length}

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_rope_positions("Z-Image", self.pixels_per_token, self.transformer.config.axes_lens, height=height,
                               width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        config = self.scheduler.config
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        mu = resolution_mu(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        # torch's fp32 linspace, as ZImagePipeline writes it: not `flux1.flux_sigmas`, whose float64 numpy linspace
        # rounds differently.
        scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / num_steps, num_steps).tolist(), mu=mu, device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def text_window(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask `[1, max_sequence_length]` of the chat-templated prompt (right-padded, truncated)."""
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                  add_generation_prompt=True, enable_thinking=True)
        batch = self.tokenizer([text], padding="max_length", max_length=self.settings.max_sequence_length,
                               truncation=True, return_tensors="pt")
        return batch.input_ids, batch.attention_mask.bool()

    def _encode_one(self, prompt: str) -> torch.Tensor:
        """One prompt's real tokens `[n, D + 1]` (fp32): the second-to-last hidden state, then the mask channel."""
        ids, mask = self.text_window(prompt)
        device = next(self.text_encoder.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        hidden = self.text_encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
        return with_mask_channel(hidden[0][mask[0]].float())

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt encoded on its own (its conditioning never depends on the prompts beside it), the batch
        zero-padded to its longest."""
        if self.text_encoder is None:
            raise RuntimeError("this Z-Image model was loaded without its text encoder")
        return masked_text_conditioning([self._encode_one(p) for p in prompts])

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
        """Always one forward, as the pipeline's CFG: the shorter text is zero-padded (masked out) to the longer."""
        length = max(cond.embeds.shape[1], uncond.embeds.shape[1])
        both = torch.cat([pad_to(uncond.embeds, length), pad_to(cond.embeds, length)])
        return PromptEmbeds(both, torch.zeros(length, 1, device=both.device))

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (self.vae.config.latent_channels, height // self.vae_scale, width // self.vae_scale)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = next(transformer.parameters()).dtype
        embeds = cond.embeds
        lengths = text_lengths(embeds).tolist()  # one host sync per forward
        captions = [embeds[i, :n, :-1].to(dtype) for i, n in enumerate(lengths)]
        images = list(latents.tokens.to(dtype).unsqueeze(2).unbind(dim=0))  # [C, 1, h, w] each
        timestep = (1000 - sigma * 1000) / 1000  # the pipeline's (1000 − t) / 1000 of the scheduler's t = σ·1000
        with self.forward_precision():
            out = transformer(images, timestep.to(dtype), captions, return_dict=False)[0]
        return -torch.stack([o.float() for o in out]).squeeze(2)  # the model predicts the negated velocity

    def reference_guidance_scale(self, guidance_scale: float) -> float:
        return guidance_scale - 1.0  # the pipeline's g: CFG off at 0

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma) -> torch.Tensor:
        return v_cond + (guidance_scale - 1.0) * (v_cond - v_uncond)  # Z-Image's form, g = s − 1

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        config = self.vae.config
        vae_dtype = next(self.vae.parameters()).dtype
        latents = latents.to(vae_dtype) / config.scaling_factor + config.shift_factor
        return decode_images(self.vae, latents, per_call=self.vae_decode_batch)
