"""The `qwen_image` family: Qwen-Image (diffusers' `QwenImageTransformer2DModel`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   QwenImageTransformer2DModel          vae/        AutoencoderKLQwenImage
    text_encoder/  Qwen2_5_VLForConditionalGeneration   scheduler/  FlowMatchEulerDiscreteScheduler config
    tokenizer/     the Qwen2 tokenizer

What this adapter reproduces of diffusers' `QwenImagePipeline` (checked by `tests/test_qwen_image.py`):
- a prompt is wrapped in Qwen-Image's system/user/assistant template, encoded by Qwen2.5-VL (last hidden
  layer), and the template's first 34 tokens (its system message and the user turn's opening) are dropped;
  at most `max_sequence_length` (512) tokens are kept, so the conditioning is as long as the prompt;
- latents are the VAE's 16 channels (one frame), 2×2-patchified and packed to tokens; the transformer
  places them with `img_shapes` (its own RoPE), decoded as `latents · std + mean` with the VAE's
  `latents_std` / `latents_mean`;
- the schedule is the scheduler's own for `linspace(1, 1/N, N)` with the dynamic shift μ linear in the
  number of image tokens (`diffrl.sampling.resolution_mu` over the scheduler's base/max sequence lengths
  and shifts; Qwen-Image's scheduler also stretches it to its `shift_terminal`); the transformer's timestep
  is the scheduler's timestep (σ·1000) divided by 1000;
- CFG is the pipeline's "true CFG": `uncond + s·(cond − uncond)`, then rescaled per token to the norm of
  the conditional velocity. The scale comes in as `guidance_scale` or, as diffusers and sglang spell it,
  `true_cfg_scale` (which wins when both are set); at s ≤ 1 a step is one conditional forward.

Variable-length text travels inside the conditioning tensor: `PromptEmbeds.embeds` is `[B, 1 + L, D]`,
whose first token is a header holding the number of real text tokens (channel 0), followed by the text
tokens, zero-padded to the batch's longest. The transformer's attention mask is derived from those
lengths in `velocity` (never carried separately), and the text is cut to the longest prompt of each
forward. Zero-padding at the end keeps the meaning, so conditionings of different lengths can share a
batch (`pads_text`): a prompt and its negative prompt run in one CFG forward, and the trainer pads a
rollout's prompts to one length. The RoPE tables are built on the device that runs the transformer, with
diffusers' arithmetic (bit-equal to its tables on CPU); diffusers builds them on the CPU and copies them
over, which is reported to drift every block on a GPU (not measured in this repository).

Qwen-Image-Edit (a checkpoint whose model_index.json names `QwenImageEditPipeline`) and Qwen-Image-Edit Plus
(`QwenImageEditPlusPipeline`, 1 to 3 input images) are this family's image-conditioned mode: the same transformer, a
`processor/` folder (Qwen2-VL's image processor and the tokenizer). What it reproduces of those pipelines (checked by
`tests/test_qwen_image_edit.py`):
- each condition image is resized (Lanczos) to the area `vae_image_area` (1024², the pipelines') at its aspect ratio,
  sides rounded to multiples of 32, VAE-encoded (the distribution's mode), normalized with `latents_mean` /
  `latents_std` and packed 2×2: the reference tokens, placed after the noisy ones in every forward (CFG's negative
  pass too) with their own `img_shapes` entries; the output keeps the generated tokens;
- the prompt (and the negative prompt) is encoded by Qwen2.5-VL *with the images as vision input*, in the editing
  template (its first 64 tokens dropped): Edit shows the VAE-sized image; Plus names each "Picture k:" and shows it
  resized to `vl_image_area` (384²);
- the output size is the request's (the pipelines default it to the last image's size at 1024²); the schedule, the
  true CFG with its norm rescale and the decoding are the text-to-image ones;
- Qwen-Image-Edit-2511 (a Plus checkpoint whose transformer sets `zero_cond_t`: the reference tokens are modulated
  with timestep 0, inside the transformer) runs as Plus.
The conditioning of an edit is `[B, 1 + R + L, D]`: the header token (channel 0 the text length, 1 the number R of
rows of reference tokens, 2 the number of images, then each image's token rows and columns), the reference tokens
laid row-major into R rows of the text width, then the text, zero-padded at the end as above, so padding never
touches the images. A forward whose rows have reference images of different sizes runs one forward per size.
The edit pipelines take an image: a request to an editing checkpoint without one is refused.

Refused with a `ModelLoadError`: the other image-conditioned variants (Layered, inpainting, image-to-image,
ControlNet checkpoints, and the transformer options of Layered, `use_additional_t_cond` and `use_layer3d_rope`, and
Edit-2511's `zero_cond_t` outside a Plus checkpoint), the guidance-distilled option (`guidance_embeds`), and scheduler
options that change the step (`stochastic_sampling`, `invert_sigmas`). Text-to-image checkpoints refuse
image-conditioned requests.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from diffrl.models.batch_invariance import embed_rows_one_at_a_time, rows_share_one_timestep
from diffrl.models.components import read_settings, refuse_scheduler_options
from diffrl.models.condition_rows import pack_image_rows, unpack_image_rows
from diffrl.models.flux1 import flux_sigmas
from diffrl.models.qwen_vae import decode_latents, pack_latents
from diffrl.sampling import randn_per_sample

# The prompt template Qwen-Image was trained with; the tokens before the prompt (34 with Qwen's
# tokenizer) are dropped from the conditioning, as the pipeline does.
PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
TEMPLATE_DROP_TOKENS = 34
TOKENIZER_MAX_LENGTH = 1024  # tokens after the template's prefix that the tokenizer keeps
MAX_SEQUENCE_LENGTH = 512  # text tokens the conditioning keeps (the pipeline's default)
DEFAULT_SAMPLE_SIZE = 128  # latent pixels a side by default (1024 image pixels with the 8x VAE)
ROPE_POSITIONS = 4096  # positions in the transformer's RoPE tables (each sign)
# Transformer options of the image-conditioned variants (Edit-2511, Layered).
VARIANT_OPTIONS = ("zero_cond_t", "use_additional_t_cond", "use_layer3d_rope")
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas")

# Qwen-Image-Edit's prompt template (both edit pipelines'); the user turn holds the image slots, then the prompt.
EDIT_PROMPT_TEMPLATE = (
    "<|im_start|>system\nDescribe the key features of the input image (color, shape, size, texture, objects, "
    "background), then explain how the user's text instruction should alter or modify the image. Generate a new image "
    "that meets the user's requirements while maintaining consistency with the original input where appropriate."
    "<|im_end|>\n<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
EDIT_TEMPLATE_DROP_TOKENS = 64
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_SLOT = "<|vision_start|><|image_pad|><|vision_end|>"
PLUS_IMAGE_SLOT = "Picture {}: " + IMAGE_SLOT  # Plus: each image named in order
EDIT_PIPELINES = {"QwenImageEditPipeline": "edit", "QwenImageEditPlusPipeline": "edit_plus"}
PLUS_MAX_IMAGES = 3  # Qwen-Image-Edit-2509's model card: one to three input images
VAE_IMAGE_AREA = 1024 * 1024  # both edit pipelines' reference-image area
VL_IMAGE_AREA = 384 * 384  # Plus: the area the text encoder sees each image at


@dataclass
class QwenImageSettings:
    """Per-checkpoint values that are not in the components' own configs; a checkpoint may override them
    in the `diffrl` block of its model_index.json (the tiny test checkpoints set a small default size)."""

    default_size: int | None = None  # None: DEFAULT_SAMPLE_SIZE latent pixels times the VAE's scale
    max_sequence_length: int = MAX_SEQUENCE_LENGTH
    edit: str | None = None  # "edit" / "edit_plus" (image-conditioned); None: from the model index's pipeline class
    vae_image_area: int = VAE_IMAGE_AREA  # editing: the reference images' area (pixels)
    vl_image_area: int = VL_IMAGE_AREA  # Plus: the area the text encoder sees each image at


@dataclass
class EditImages:
    """A request's condition images, encoded once (`encode_condition_images`): what the text encoder sees, and the
    packed reference tokens `[1, S, C]` with each image's token grid (rows, columns)."""

    vision: list = field(default_factory=list)  # PIL images, as the pipeline hands its processor
    tokens: torch.Tensor | None = None
    grids: list[tuple[int, int]] = field(default_factory=list)


def calculate_dimensions(area: int, ratio: float) -> tuple[int, int]:
    """(width, height) of `area` pixels at `ratio` = width / height, each rounded to a multiple of 32 (the edit
    pipelines' `calculate_dimensions`)."""
    width = math.sqrt(area * ratio)
    return round(width / 32) * 32, round(width / ratio / 32) * 32


def load_processor(folder: Path, dtype=None):
    """The `processor/` folder: Qwen2-VL's image processor and the tokenizer, as a processor that takes images only
    (building `Qwen2VLProcessor` itself needs its video processor, which needs torchvision)."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from transformers import Qwen2VLProcessor

    image_processor = AutoImageProcessor.from_pretrained(str(folder), local_files_only=True)
    return without_video(Qwen2VLProcessor)(image_processor=image_processor,
                                           tokenizer=AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


@functools.cache
def without_video(processor_class: type) -> type:
    """A Qwen-VL processor class that takes no video processor (the Qwen-Image families never send video, and
    building one needs torchvision)."""

    class ImagesOnly(processor_class):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = f"{processor_class.__name__}ImagesOnly"
    return ImagesOnly


def _check_template_prefix(tokenizer, template: str = PROMPT_TEMPLATE, drop: int = TEMPLATE_DROP_TOKENS) -> None:
    """The pipeline drops a fixed number of tokens (34; editing: 64): the template's prefix must tokenize to exactly
    those, also when a prompt follows it."""
    prefix_ids = list(tokenizer(template.split("{}")[0])["input_ids"])
    in_context = list(tokenizer(template.format("a cat"))["input_ids"][:drop])
    if len(prefix_ids) != drop or in_context != prefix_ids:
        raise ModelLoadError(f"qwen_image: the tokenizer splits the prompt template's prefix into {len(prefix_ids)} "
                             f"tokens; Qwen-Image drops the first {drop} (is this Qwen's tokenizer?)")


class _DeviceRopeTables:
    """Stands in for `QwenEmbedRope._get_device_freqs`: the (positive, negative) position tables computed on
    the device asked for, with the arithmetic of diffusers' `rope_params` (bit-equal to its tables on CPU)."""

    def __init__(self, theta: float, axes_dim: Sequence[int]):
        self.theta = theta
        self.axes_dim = tuple(axes_dim)
        self.tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _axis(self, positions: torch.Tensor, dim: int) -> torch.Tensor:
        exponents = torch.arange(0, dim, 2, device=positions.device).to(torch.float32).div(dim)
        angles = torch.outer(positions, 1.0 / torch.pow(self.theta, exponents))
        return torch.polar(torch.ones_like(angles), angles)

    def __call__(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        device = torch.device(device)
        if device not in self.tables:
            positive = torch.arange(ROPE_POSITIONS, device=device)
            negative = torch.arange(ROPE_POSITIONS, device=device).flip(0) * -1 - 1
            self.tables[device] = tuple(torch.cat([self._axis(p, d) for d in self.axes_dim], dim=1)
                                        for p in (positive, negative))
        return self.tables[device]


def _build_rope_on_the_compute_device(transformer) -> None:
    # Installed before the first forward (the transformer caches its per-shape tables by device).
    rope = transformer.pos_embed
    rope._get_device_freqs = _DeviceRopeTables(rope.theta, rope.axes_dim)


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the layers whose
    matmul row count is the batch size (the timestep MLP, every block's two AdaLN modulations, the output
    modulation) run one distinct row at a time. Their input depends on the timestep alone, so a rollout step (one σ
    for the whole batch) is a single one-row call. Not on GPU, where batched kernels differ anyway."""
    embed_rows_one_at_a_time(transformer.time_text_embed.timestep_embedder)
    for name, module in transformer.named_modules():
        if name.endswith(("img_mod.1", "txt_mod.1", "norm_out.linear")):
            embed_rows_one_at_a_time(module)


def image_position_ids(h: int, w: int, device=None) -> torch.Tensor:
    """(frame 0, row, column) of each image token `[h·w, 3]`; the family reads the grid size off the last."""
    rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1)


def pad_text(embeds: torch.Tensor, length: int) -> torch.Tensor:
    """A conditioning `[B, 1 + L, D]` zero-padded (at the end) to `1 + length` tokens."""
    return torch.nn.functional.pad(embeds, (0, 0, 0, 1 + length - embeds.shape[1]))


def text_lengths(embeds: torch.Tensor) -> torch.Tensor:
    """The number of real text tokens of each row, from the conditioning's header token."""
    return embeds[:, 0, 0]


def forward_by_group(keys: Sequence, rows: torch.Tensor, forward) -> torch.Tensor:
    """`forward(index, key)` over the rows sharing each key (`index`: their positions, a tensor on `rows`' device),
    the outputs put back in row order: one transformer call per group of rows that must run alone (one call when
    all share a key)."""
    groups = list(dict.fromkeys(keys))
    if len(groups) == 1:
        return forward(None, groups[0])
    out = None
    for key in groups:
        index = torch.tensor([k for k, other in enumerate(keys) if other == key], device=rows.device)
        part = forward(index, key)
        out = part.new_empty(len(keys), *part.shape[1:]) if out is None else out
        out[index] = part
    return out


def paired_padded(uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
    """CFG's halves as one batch: the shorter text zero-padded to the longer (behind the header of lengths)."""
    length = max(cond.embeds.shape[1], uncond.embeds.shape[1]) - 1
    return PromptEmbeds(torch.cat([pad_text(uncond.embeds, length), pad_text(cond.embeds, length)]), cond.ids)


def _conditioning(texts: Sequence[torch.Tensor], images: EditImages | None = None) -> PromptEmbeds:
    """`[B, 1 + R + L, D]`: the header token, the reference tokens in R rows (editing), each text `[L_k, D]`,
    zero-padded to the longest (see the module docstring)."""
    longest, width = max(t.shape[0] for t in texts), texts[0].shape[1]
    rows = pack_image_rows(images.tokens.to(texts[0]), width) if images is not None else texts[0].new_zeros(1, 0, width)
    header = texts[0].new_zeros(width)
    if images is not None:
        grid = [v for hw in images.grids for v in hw]
        header[1 : 3 + len(grid)] = torch.tensor([rows.shape[1], len(images.grids), *grid], dtype=header.dtype)
    embeds = texts[0].new_zeros(len(texts), 1 + rows.shape[1] + longest, width)
    for row, text in enumerate(texts):
        embeds[row, 0] = header
        embeds[row, 0, 0] = text.shape[0]
        embeds[row, 1 : 1 + rows.shape[1]] = rows[0]
        embeds[row, 1 + rows.shape[1] : 1 + rows.shape[1] + text.shape[0]] = text
    return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1, device=embeds.device))


@register_family
class QwenImageFamily(FamilyAdapter):
    name = "qwen_image"
    name_patterns = ("qwen-image", "qwen_image", "qwenimage")
    display_name = "Qwen-Image"
    default_guidance_scale = 4.0  # the pipeline's default true_cfg_scale
    default_num_inference_steps = 50  # sglang-diffusion's and diffusers' default
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes them / 1000
    pads_text = True  # conditionings of different lengths share a batch, zero-padded (see the module docstring)
    has_true_cfg = True
    # The joint attention's projections of both streams (the Flow-GRPO LoRA targets).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    block_lists = ("transformer_blocks",)
    components = (
        Component("transformer", "diffusers:QwenImageTransformer2DModel"),
        Component("vae", "diffusers:AutoencoderKLQwenImage"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:Qwen2_5_VLForConditionalGeneration", text_encoder=True),
        # Editing checkpoints: the image processor and tokenizer their pipelines encode the prompt and images with.
        Component("processor", load_processor, kind="tokenizer", optional=True, config_file="preprocessor_config.json",
                  class_name="Qwen2VLProcessor"),
    )
    settings_class = QwenImageSettings

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, processor=None, *,
                 settings: QwenImageSettings | None = None):
        config = transformer.config
        # Edit-2511 (a Plus checkpoint) sets zero_cond_t: the transformer gives the reference tokens timestep 0.
        allowed = ("zero_cond_t",) if (settings or QwenImageSettings()).edit == "edit_plus" else ()
        variant = [key for key in (*VARIANT_OPTIONS, "guidance_embeds") if config.get(key) and key not in allowed]
        if variant:
            raise ModelLoadError(f"qwen_image: the transformer sets {variant}, options of the image-conditioned "
                                 "(Edit-2511, Layered) or guidance-distilled variants; this checkpoint's pipeline "
                                 "does not use them")
        refuse_scheduler_options(self.name, scheduler, UNSUPPORTED_SCHEDULER_OPTIONS)
        if config.in_channels != 4 * vae.config.z_dim:
            raise ModelLoadError(f"qwen_image: the transformer takes {config.in_channels} channels, 2x2 patches of "
                                 f"the VAE's {vae.config.z_dim} latent channels are {4 * vae.config.z_dim}")
        if (settings or QwenImageSettings()).edit and config.joint_attention_dim < 3 + 2 * PLUS_MAX_IMAGES:
            raise ModelLoadError(f"qwen_image: an editing checkpoint's text width must hold the conditioning's header "
                                 f"(at least {3 + 2 * PLUS_MAX_IMAGES}), got {config.joint_attention_dim}")
        if text_encoder is not None and text_encoder.config.text_config.hidden_size != config.joint_attention_dim:
            raise ModelLoadError(f"qwen_image: the text encoder is {text_encoder.config.text_config.hidden_size} "
                                 f"wide, the transformer reads {config.joint_attention_dim}-wide text")
        settings = settings or QwenImageSettings()
        if settings.edit not in (None, *EDIT_PIPELINES.values()):
            raise ModelLoadError(f"qwen_image: edit must be one of {sorted(EDIT_PIPELINES.values())}, got "
                                 f"{settings.edit!r}")
        if settings.edit:
            if processor is None:
                raise ModelLoadError("qwen_image: this Qwen-Image-Edit checkpoint has no processor/ folder (the image "
                                     "processor and tokenizer its pipeline encodes the prompt and images with)")
            _check_template_prefix(processor.tokenizer, EDIT_PROMPT_TEMPLATE, EDIT_TEMPLATE_DROP_TOKENS)
        else:
            _check_template_prefix(tokenizer)
        _build_rope_on_the_compute_device(transformer)
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler, processor=processor, settings=settings)
        self.accepts_image_conditioning = self.requires_image_conditioning = self.prompt_sees_images = bool(settings.edit)
        self.max_condition_images = {"edit": 1, "edit_plus": PLUS_MAX_IMAGES}.get(settings.edit, 0)
        self.vae_scale = 2 ** len(vae.config.temperal_downsample)
        self.pixels_per_token = self.vae_scale * 2  # the VAE's downsampling, then the 2x2 patches

    def reference_pipeline(self):
        """diffusers' `QwenImagePipeline` over this family's own components (no copy of the weights): what the
        tests check the engine against and the benchmarks time it against. Its CFG scale is `true_cfg_scale`,
        on only when a negative prompt is given (its `guidance_scale` is the guidance-distilled variant's)."""
        from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline, QwenImagePipeline

        if self.settings.edit:
            pipeline = QwenImageEditPlusPipeline if self.settings.edit == "edit_plus" else QwenImageEditPipeline
            return self.pipeline_over_components(pipeline, processor=self.processor)
        return self.pipeline_over_components(QwenImagePipeline)

    @property
    def reference_area(self) -> int:
        """The reference images' area: a run's `condition_image_area` (--condition-image-size) in place of
        `vae_image_area` (the pipelines' 1024²); sources are resized to it, up or down, as the pipelines resize to
        theirs. What the text encoder sees (Plus: `vl_image_area`) stays."""
        return self.condition_image_area or self.settings.vae_image_area

    @contextlib.contextmanager
    def reference_image_areas(self):
        """Within it, the edit pipelines resize condition images to this checkpoint's areas (their module constants
        are 1024² and 384²; the tiny test checkpoints set smaller ones)."""
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
        from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

        vae_area, vl_area = self.reference_area, self.settings.vl_image_area
        saved = edit.calculate_dimensions, plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE, plus.calculate_dimensions

        def edit_dimensions(area, ratio):  # Edit's call passes 1024²; Plus's module function is patched below
            return (*calculate_dimensions(vae_area if area == VAE_IMAGE_AREA else area, ratio), None)

        def plus_dimensions(area, ratio):  # the output size's default (1024²) follows the reference area too
            return calculate_dimensions(vae_area if area == VAE_IMAGE_AREA else area, ratio)

        edit.calculate_dimensions, plus.calculate_dimensions = edit_dimensions, plus_dimensions
        plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE = vl_area, vae_area
        try:
            yield
        finally:
            edit.calculate_dimensions, plus.CONDITION_IMAGE_SIZE, plus.VAE_IMAGE_SIZE, plus.calculate_dimensions = saved

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> QwenImageSettings:
        pipeline = str(index.get("_class_name", ""))
        edit = EDIT_PIPELINES.get(pipeline)
        if not edit and pipeline.startswith("QwenImage") and pipeline != "QwenImagePipeline":
            raise ModelLoadError(f"{root / 'model_index.json'}: {pipeline} is a Qwen-Image variant this family does "
                                 f"not run (it runs QwenImagePipeline and, as its editing mode, "
                                 f"{' and '.join(EDIT_PIPELINES)} checkpoints)")
        return read_settings(QwenImageSettings, index, root / "model_index.json", edit=edit)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        size = self.settings.default_size or DEFAULT_SAMPLE_SIZE * self.vae_scale
        return size, size

    def check_size(self, height: int, width: int) -> None:
        step = self.pixels_per_token
        require_pixel_multiple("Qwen-Image", step, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return flux_sigmas(self.scheduler, num_steps, image_tokens, self.device)  # QwenImagePipeline's, to the bit

    def _encode_one(self, prompt: str) -> torch.Tensor:
        """One prompt's text tokens `[L, D]` (fp32): the template's prefix dropped, at most max_sequence_length."""
        batch = self.tokenizer(PROMPT_TEMPLATE.format(prompt), return_tensors="pt", truncation=True,
                               max_length=TOKENIZER_MAX_LENGTH + TEMPLATE_DROP_TOKENS)
        device = next(self.text_encoder.parameters()).device
        out = self.text_encoder(input_ids=batch["input_ids"].to(device),
                                attention_mask=batch["attention_mask"].to(device), output_hidden_states=True)
        return out.hidden_states[-1][0, TEMPLATE_DROP_TOKENS:][: self.settings.max_sequence_length].float()

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt encoded on its own (its conditioning never depends on the prompts beside it), then
        the batch zero-padded to its longest, behind the header token of lengths."""
        if self.text_encoder is None:
            raise RuntimeError("this Qwen-Image model was loaded without its text encoder")
        if self.settings.edit:
            raise RequestError("image_path", "this Qwen-Image-Edit checkpoint edits images: send the condition image "
                                             "in image_path")
        return _conditioning([self._encode_one(p) for p in prompts])

    @torch.no_grad()
    def encode_condition_images(self, images: Sequence[torch.Tensor]) -> EditImages:
        """Each `uint8 [3, H, W]` image resized as the edit pipeline resizes it: what the text encoder sees, and the
        packed, normalized VAE latents of the reference image (see the module docstring)."""
        from PIL import Image

        if not 1 <= len(images) <= self.max_condition_images:
            raise RequestError("image_path", f"this Qwen-Image-Edit checkpoint takes 1 to {self.max_condition_images} "
                                             f"condition images, got {len(images)}")
        encoded, tokens = EditImages(), []
        config, vae_dtype = self.vae.config, next(self.vae.parameters()).dtype
        mean = torch.tensor(config.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(config.latents_std).view(1, -1, 1, 1, 1)
        for image in images:
            pil = Image.fromarray(image.permute(1, 2, 0).numpy())
            width, height = calculate_dimensions(self.reference_area, pil.width / pil.height)
            if not width or not height:
                raise RequestError("image_path", f"a condition image of {pil.width}x{pil.height} pixels is too narrow "
                                                 "for Qwen-Image-Edit's resize (a side rounds to 0)")
            reference = pil.resize((width, height), Image.Resampling.LANCZOS)  # the pipeline's image processor
            if self.settings.edit == "edit_plus":
                encoded.vision.append(pil.resize(calculate_dimensions(self.settings.vl_image_area,
                                                                      pil.width / pil.height),
                                                 Image.Resampling.LANCZOS))
            else:
                encoded.vision.append(reference)
            pixels = torch.from_numpy(np.asarray(reference).astype(np.float32) / 255.0).permute(2, 0, 1)
            pixels = (2.0 * pixels - 1.0)[None, :, None]  # [1, 3, 1, H, W], the image processor's arithmetic
            latents = self.vae.encode(pixels.to(self.device, vae_dtype)).latent_dist.mode()
            latents = (latents - mean.to(latents)) / std.to(latents)
            tokens.append(pack_latents(latents[:, :, 0], 2).float())
            encoded.grids.append((height // self.pixels_per_token, width // self.pixels_per_token))
        encoded.tokens = torch.cat(tokens, dim=1)
        return encoded

    @torch.no_grad()
    def encode_prompts_with_images(self, prompts: Sequence[str], encoded: EditImages) -> PromptEmbeds:
        """Each prompt encoded by Qwen2.5-VL with the images as vision input (the editing template, 64 tokens
        dropped), behind the header and the reference tokens (see the module docstring)."""
        if self.text_encoder is None:
            raise RuntimeError("this Qwen-Image model was loaded without its text encoder")
        if self.settings.edit == "edit_plus":
            slots = "".join(PLUS_IMAGE_SLOT.format(k + 1) for k in range(len(encoded.vision)))
        else:
            slots = IMAGE_SLOT
        device = next(self.text_encoder.parameters()).device
        texts = []
        for prompt in prompts:
            inputs = self.processor(text=[EDIT_PROMPT_TEMPLATE.format(slots + prompt)], images=encoded.vision,
                                    padding=True, return_tensors="pt").to(device)
            out = self.text_encoder(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                                    pixel_values=inputs.get("pixel_values"),
                                    image_grid_thw=inputs.get("image_grid_thw"), output_hidden_states=True)
            texts.append(out.hidden_states[-1][0, EDIT_TEMPLATE_DROP_TOKENS:].float())
        return _conditioning(texts, encoded)

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """sglang's Qwen-Image cond kwargs: the prompt's own tokens (no header, no padding), `txt_seq_lens`
        (the mask is derived from it) and `img_shapes` [[(frames, rows, columns)]] of the latent token grid.
        sglang's `freqs_cis` is left out: the RoPE tables are rebuilt on the compute device from these. Editing: the
        reference images' grids follow in `img_shapes`, their packed tokens `[S, C]` in diffrl's `condition_latents`."""
        length, image_rows, count = (int(v) for v in cond.embeds[0, 0, :3])
        rows, cols = (int(v) + 1 for v in image_ids[-1, 1:3])
        wire = {"encoder_hidden_states": [cond.embeds[0, 1 + image_rows : 1 + image_rows + length]],
                "txt_seq_lens": [length], "img_shapes": [[[1, rows, cols]]]}
        if count:
            grids = [[int(v) for v in cond.embeds[0, 0, 3 + 2 * k : 5 + 2 * k]] for k in range(count)]
            wire["img_shapes"][0] += [[1, r, c] for r, c in grids]
            channels = 4 * self.vae.config.z_dim
            wire["condition_latents"] = unpack_image_rows(cond.embeds[:1, 1 : 1 + image_rows],
                                                          sum(r * c for r, c in grids), channels)[0]
        return wire

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        text = wire_text_tokens(kwargs)
        lengths = kwargs.get("txt_seq_lens") or [text.shape[0]]
        length = min(int(lengths[0]), text.shape[0])
        embeds = text.new_zeros(1, 1 + length, text.shape[1])
        embeds[0, 0, 0] = length  # the header token of lengths (see the module docstring)
        embeds[0, 1:] = text[:length]
        image_ids = None
        shapes = kwargs.get("img_shapes")
        if shapes:
            _, rows, cols = shapes[0][0]
            image_ids = image_position_ids(int(rows), int(cols))
        reference = kwargs.get("condition_latents")
        if reference is not None:  # editing: the reference tokens and their grids (img_shapes after the first)
            grids = [(int(r), int(c)) for _, r, c in (shapes or [[]])[0][1:]]
            if not isinstance(reference, torch.Tensor) or reference.dim() != 2 or not grids or \
                    reference.shape[0] != sum(r * c for r, c in grids):
                raise ValueError("condition_latents: expected [S, C] reference tokens, S the tokens of img_shapes' "
                                 "reference grids")
            return _conditioning([text[:length]], EditImages(tokens=reference[None].float(), grids=grids)), image_ids
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1)), image_ids

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        shape = (len(generators), 1, self.vae.config.z_dim, 2 * h, 2 * w)  # what the pipeline draws per sample
        tokens = pack_latents(randn_per_sample(shape, generators, device=self.device)[:, 0], 2)
        return Latents(tokens, image_position_ids(h, w, device=self.device))

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
        """Always one forward: the shorter text is zero-padded to the longer (see the module docstring)."""
        return paired_padded(uncond, cond)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        x, embeds = latents.tokens, cond.embeds
        # The image grid and each row's header (text length; editing: the reference images), read in one host sync.
        width = 3 + 2 * self.max_condition_images if self.settings.edit else 1
        h, w, *values = torch.cat([latents.ids[-1, 1:] + 1, embeds[:, 0, :width].flatten()]).tolist()
        headers = [tuple(int(v) for v in values[k * width : (k + 1) * width]) for k in range(x.shape[0])]
        def forward(index, kind):  # reference images of different sizes: one forward per size
            if index is None:
                return self._forward(transformer, latents, sigma, cond, (int(h), int(w)), headers)
            return self._forward(transformer, Latents(x[index], latents.ids), sigma[index] if sigma.dim() else sigma,
                                 PromptEmbeds(embeds[index], cond.ids), (int(h), int(w)),
                                 [headers[k] for k in index.tolist()])

        return forward_by_group([header[1:] for header in headers], x, forward)

    def _forward(self, transformer, latents, sigma, cond, grid, headers) -> torch.Tensor:
        """One forward over rows whose reference images (if any) have the same sizes."""
        x, embeds = latents.tokens, cond.embeds
        dtype = next(transformer.parameters()).dtype
        lengths = [header[0] for header in headers]
        image_rows, count, *sizes = headers[0][1:] or (0, 0)  # text to image: no reference images
        grids = [(sizes[2 * k], sizes[2 * k + 1]) for k in range(count)]
        longest = max(lengths)
        text = embeds[:, 1 + image_rows : 1 + image_rows + longest]  # the text of this forward's longest prompt
        mask = None  # like the pipeline: no mask when no row is padded
        if any(n != longest for n in lengths):
            mask = torch.arange(longest, device=x.device)[None] < text_lengths(embeds)[:, None]
        tokens = x
        if count:  # editing: the reference tokens after the noisy ones
            reference = unpack_image_rows(embeds[:, 1 : 1 + image_rows], sum(r * c for r, c in grids), x.shape[-1])
            tokens = torch.cat([x, reference.to(x)], dim=1)
        # The scheduler's timestep, σ·1000, divided by 1000 as the pipeline does.
        timestep = sigma * self.scheduler.config.num_train_timesteps / 1000
        shapes = [(1, *grid), *((1, r, c) for r, c in grids)]
        # zero_cond_t (Edit-2511): the transformer adds rows of timestep 0, so its timestep rows are not all one value.
        zero_cond_t = transformer.config.get("zero_cond_t")
        with self.forward_precision(), rows_share_one_timestep(False) if zero_cond_t else contextlib.nullcontext():
            return transformer(hidden_states=tokens.to(dtype), timestep=timestep.to(dtype),
                               encoder_hidden_states=text.to(dtype), encoder_hidden_states_mask=mask,
                               img_shapes=[shapes] * x.shape[0], return_dict=False)[0][:, : x.shape[1]].float()

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma) -> torch.Tensor:
        combined = v_uncond + guidance_scale * (v_cond - v_uncond)
        # True CFG's rescale: each token's guided velocity gets the norm of its conditional velocity.
        return combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              2, per_call=self.vae_decode_batch)
