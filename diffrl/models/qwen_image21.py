"""The `qwen_image21` family: Qwen-Image 2.1 (diffusers' `QwenImage21Pipeline`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   QwenImage21Transformer2DModel      vae/        AutoencoderKLQwenImage21
    text_encoder/  Qwen3VLForConditionalGeneration    scheduler/  FlowMatchEulerDiscreteScheduler config
    processor/     Qwen3-VL's processor (its tokenizer and image processor)

What this adapter reproduces of `QwenImage21Pipeline` (checked by `tests/test_qwen_image21.py`):
- a prompt (an empty one as " ") is written into the pipeline's raw system/user/assistant template, tokenized by the
  processor, encoded by Qwen3-VL, and the last decoder layer's hidden states *before* the final norm are kept (the
  pipeline hooks the norm away: that is what the transformer was trained on), without the system turn's tokens;
- latents are the VAE's channels at 1/16 of the pixels, unpatched: one token per latent pixel, drawn `[1, C, h, w]`
  per sample as the pipeline draws them; the transformer lays the text and the image into one sequence, four latent
  tokens per image slot of the text stream (`img_mask`), with `img_shapes` `[(1, h, w)]`;
- the schedule is the scheduler's own for `linspace(1, 1/N, N)` (or the checkpoint's `sample_sigmas`, which fix N)
  with the dynamic shift μ linear in the number of image tokens; the transformer's timestep is σ;
- CFG is the pipeline's true CFG, `uncond + s·(cond − uncond)` without a norm rescale (2.1 is meant to sample at 1);
- decoding: `latents · std + mean`, the VAE's first frame. The VAE gives RGBA; the images come back composited over
  white as RGB (what a reward sees), the pipeline's own output composited the same way in the tests.

One text length per forward. The transformer's rotary positions put the image after the text it follows and the text
attends causally, so a row's output depends on how far its text is padded: the pipeline's own outputs change with the
longest prompt in its batch. Here each row runs at its own length: conditionings of different lengths share an
engine batch (`pads_text`, zero-padded behind a header of lengths as Qwen-Image's) and the forward runs one
transformer call per length, the rows put back in order, so a sample never depends on the prompts beside it and the
trainer replays a rollout's forwards as they ran.

Not reproduced: image conditioning (the pipeline's editing mode; requests with images are refused) and the
pipeline's KV cache of the text prefix (an inference shortcut: the same values).
"""

from __future__ import annotations

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
    register_family,
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.components import read_settings, refuse_scheduler_options
from diffrl.models.flux1 import flux_sigmas
from diffrl.models.qwen_image import (
    _conditioning,
    forward_by_group,
    image_position_ids,
    paired_padded,
    text_lengths,
    without_video,
)
from diffrl.models.vae_latents import decode_images
from diffrl.sampling.noise import randn_per_sample

SYSTEM_PROMPT = "Comprehend and analyze the provided prompt."
SYSTEM_TURN = f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n"
PROMPT_TEMPLATE = SYSTEM_TURN + "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PIXELS_PER_TOKEN = 16  # the VAE's 16x, latents unpatched
SLOT_TOKENS = 4  # latent tokens per image slot of the text stream (2x2)
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas")


@dataclass(frozen=True)
class QwenImage21Settings:
    sample_sigmas: tuple[float, ...] | None = None  # the pipeline's configured schedule (it fixes the step count)
    default_size: int = 1024


def load_processor(folder: Path, dtype=None):
    """The `processor/` folder as a text-and-image Qwen3-VL processor (its video processor needs torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    chat = folder / "chat_template.jinja"
    return without_video(Qwen3VLProcessor)(
        image_processor=AutoImageProcessor.from_pretrained(str(folder), local_files_only=True),
        tokenizer=AutoTokenizer.from_pretrained(str(folder), local_files_only=True),
        chat_template=chat.read_text() if chat.is_file() else None)


def _row_invariant(transformer) -> None:
    """Sample k bit-identical in any batch on CPU: the timestep MLP, the shared modulation and the output norm's scale
    are the matmuls whose row count is the batch size (`embed_rows_one_at_a_time`). All by distinct rows, never the
    shared-timestep shortcut: the transformer appends a row of timestep 0 for the text, so a step's rows are not all
    one value."""
    for module in (transformer.time_text_embed.timestep_embedder, transformer.modulation, transformer.norm_out.linear):
        embed_rows_one_at_a_time(module, timestep=False)


@register_family
class QwenImage21Family(FamilyAdapter):
    name = "qwen_image21"
    name_patterns = ("qwen-image-2.1", "qwen_image_2_1", "qwen-image-21", "qwenimage21", "qwen_image21")
    display_name = "Qwen-Image 2.1"
    default_guidance_scale = 1.0  # the pipeline's true_cfg_scale default: 2.1 samples without guidance
    default_num_inference_steps = 50
    timestep_scale = 1000.0  # reported timesteps are σ·1000; the transformer takes σ
    pads_text = True  # different lengths share a batch; the forward runs one call per length (module docstring)
    has_true_cfg = True
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:QwenImage21Transformer2DModel"),
        Component("vae", "diffusers:AutoencoderKLQwenImage21"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("processor", load_processor, kind="tokenizer", config_file="preprocessor_config.json",
                  class_name="Qwen3VLProcessor"),
        Component("text_encoder", "transformers:Qwen3VLForConditionalGeneration", text_encoder=True),
    )
    settings_class = QwenImage21Settings
    model_index_required = True

    def __init__(self, transformer, vae, text_encoder, processor, scheduler, *, settings: QwenImage21Settings):
        config = transformer.config
        if config.patch_size != 1 or config.in_channels != vae.config.z_dim:
            raise ModelLoadError(f"qwen_image21: the transformer takes {config.in_channels} channels in patches of "
                                 f"{config.patch_size}; Qwen-Image 2.1 reads the VAE's {vae.config.z_dim} latent "
                                 "channels unpatched")
        if getattr(vae, "spatial_compression_ratio", PIXELS_PER_TOKEN) != PIXELS_PER_TOKEN:
            raise ModelLoadError(f"qwen_image21: the VAE compresses {vae.spatial_compression_ratio}x; the pipeline "
                                 f"lays out latents at {PIXELS_PER_TOKEN}x")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        self.adopt_components(transformer, _row_invariant, vae=vae, text_encoder=text_encoder, processor=processor,
                              scheduler=scheduler, settings=settings)
        self.pixels_per_token = PIXELS_PER_TOKEN
        tokenizer = processor.tokenizer
        self.tokenizer = tokenizer
        self.drop_tokens = len(tokenizer(SYSTEM_TURN).input_ids)  # the system turn, as the pipeline drops it

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> QwenImage21Settings:
        pipeline = str(index.get("_class_name", ""))
        if pipeline != "QwenImage21Pipeline":
            raise ModelLoadError(f"{root / 'model_index.json'}: qwen_image21 runs QwenImage21Pipeline checkpoints, "
                                 f"not {pipeline or 'one without a _class_name'}")
        sigmas = index.get("sample_sigmas")
        return read_settings(QwenImage21Settings, index, root / "model_index.json",
                             sample_sigmas=tuple(float(s) for s in sigmas) if sigmas else None)

    @classmethod
    def from_components(cls, root, parts, settings) -> QwenImage21Family:
        return cls(parts["transformer"], parts["vae"], parts["text_encoder"], parts["processor"], parts["scheduler"],
                   settings=settings)

    def reference_pipeline(self):
        """diffusers' `QwenImage21Pipeline` over this family's own components (no copy of the weights)."""
        from diffusers import QwenImage21Pipeline

        pipe = QwenImage21Pipeline(vae=self.vae, text_encoder=self.text_encoder, processor=self.processor,
                                   transformer=self.transformer, scheduler=self.scheduler,
                                   sample_sigmas=list(self.settings.sample_sigmas or []) or None)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        require_pixel_multiple("Qwen-Image 2.1", 2 * PIXELS_PER_TOKEN, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        image_tokens = (height // PIXELS_PER_TOKEN) * (width // PIXELS_PER_TOKEN)
        configured = self.settings.sample_sigmas
        if configured is not None and num_steps != len(configured):
            raise RequestError("num_inference_steps", f"this Qwen-Image 2.1 checkpoint samples its configured "
                                                      f"{len(configured)} steps (sample_sigmas), not {num_steps}")
        return flux_sigmas(self.scheduler, num_steps, image_tokens, self.device, base=configured)

    # ---------------------------------------------------------------- conditioning
    def _encode_one(self, prompt: str) -> torch.Tensor:
        """One prompt's text tokens `[L, D]` (fp32): the pre-norm last hidden states without the system turn."""
        inputs = self.processor(text=[PROMPT_TEMPLATE.format(prompt or " ")], padding=True, padding_side="left",
                                return_tensors="pt")
        device = next(self.text_encoder.parameters()).device
        kwargs = {"input_ids": inputs["input_ids"].to(device), "attention_mask": inputs["attention_mask"].to(device),
                  "output_hidden_states": True}
        if "mm_token_type_ids" in inputs:
            kwargs["mm_token_type_ids"] = inputs["mm_token_type_ids"].to(device)
        model = self.text_encoder.model
        text_model = getattr(model, "language_model", model)
        handle = text_model.norm.register_forward_hook(lambda module, args, output: args[0])  # the norm's input
        try:
            hidden = self.text_encoder(**kwargs).hidden_states[-1][0]
        finally:
            handle.remove()
        return hidden[inputs["attention_mask"][0].bool().to(device)][self.drop_tokens:].float()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt encoded on its own, then zero-padded to the longest behind the header token of lengths."""
        if self.text_encoder is None:
            raise RuntimeError("this Qwen-Image 2.1 model was loaded without its text encoder")
        return _conditioning([self._encode_one(p) for p in prompts])

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """The prompt's own tokens, `txt_seq_lens` and `img_shapes` [[(1, rows, columns)]] of the latent grid."""
        length = int(cond.embeds[0, 0, 0])
        rows, cols = (int(v) + 1 for v in image_ids[-1, 1:3])
        return {"encoder_hidden_states": [cond.embeds[0, 1 : 1 + length]], "txt_seq_lens": [length],
                "img_shapes": [[[1, rows, cols]]]}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        text = wire_text_tokens(kwargs)
        length = min(int((kwargs.get("txt_seq_lens") or [text.shape[0]])[0]), text.shape[0])
        shapes = kwargs.get("img_shapes")
        image_ids = image_position_ids(int(shapes[0][0][1]), int(shapes[0][0][2])) if shapes else None
        return _conditioning([text[:length]]), image_ids

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        h, w = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
        noise = randn_per_sample((len(generators), 1, self.vae.config.z_dim, h, w), generators, device=self.device)
        tokens = noise[:, 0].flatten(2).transpose(1, 2)  # the pipeline's pack: a spatial flatten
        return Latents(tokens, image_position_ids(h, w, device=self.device))

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
        """One batch of both halves, padded to the longer; the forward still runs each at its own length."""
        return paired_padded(uncond, cond)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        x, embeds = latents.tokens, cond.embeds
        h, w, *lengths = torch.cat([latents.ids[-1, 1:] + 1, text_lengths(embeds).to(latents.ids)]).tolist()

        def forward(index, length):  # the rows of one text length (module docstring)
            if index is None:
                return self._forward(transformer, x, sigma, embeds[:, 1 : 1 + length], (int(h), int(w)))
            return self._forward(transformer, x[index], sigma[index] if sigma.dim() else sigma,
                                 embeds[index, 1 : 1 + length], (int(h), int(w)))

        return forward_by_group([int(n) for n in lengths], x, forward)

    def _forward(self, transformer, x, sigma, text, grid) -> torch.Tensor:
        """Rows whose texts all have the given length: no padding, so no mask (as the pipeline for one prompt)."""
        dtype = next(transformer.parameters()).dtype
        slots = grid[0] * grid[1] // SLOT_TOKENS
        img_mask = torch.cat([torch.zeros(x.shape[0], text.shape[1], dtype=torch.bool, device=x.device),
                              torch.ones(x.shape[0], slots, dtype=torch.bool, device=x.device)], dim=1)
        timestep = (sigma * self.scheduler.config.num_train_timesteps / 1000).expand(x.shape[0])
        with self.forward_precision():
            return transformer(hidden_states=x.to(dtype), encoder_hidden_states=text.to(dtype),
                               timestep=timestep.to(dtype), img_shapes=[[(1, *grid)]] * x.shape[0], img_mask=img_mask,
                               return_dict=False)[0][:, -x.shape[1]:].float()

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """RGB in [0, 1]: the VAE's RGBA first frame composited over white."""
        h, w = height // PIXELS_PER_TOKEN, width // PIXELS_PER_TOKEN
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        z = latents.transpose(1, 2).reshape(latents.shape[0], config.z_dim, 1, h, w)
        z = z * torch.tensor(config.latents_std, device=z.device).view(shape) + torch.tensor(
            config.latents_mean, device=z.device).view(shape)
        return composite_over_white(decode_images(self.vae, z, per_call=self.vae_decode_batch)[:, :, 0])


def composite_over_white(images: torch.Tensor) -> torch.Tensor:
    """`[B, 4, H, W]` RGBA in [0, 1] → `[B, 3, H, W]` RGB over a white background (3 channels pass through)."""
    if images.shape[1] != 4:
        return images
    alpha = images[:, 3:]
    return images[:, :3] * alpha + (1 - alpha)
