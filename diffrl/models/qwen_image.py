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

Refused with a `ModelLoadError`: the image-conditioned variants (Qwen-Image-Edit and Layered checkpoints,
and the transformer options only they use: `zero_cond_t`, `use_additional_t_cond`, `use_layer3d_rope`),
the guidance-distilled option (`guidance_embeds`), and scheduler options that change the step
(`stochastic_sampling`, `invert_sigmas`). Image-conditioned requests are refused by the engine.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.qwen_vae import decode_latents, pack_latents
from diffrl.sampling import randn_per_sample, resolution_mu

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


@dataclass
class QwenImageSettings:
    """Per-checkpoint values that are not in the components' own configs; a checkpoint may override them
    in the `diffrl` block of its model_index.json (the tiny test checkpoints set a small default size)."""

    default_size: int | None = None  # None: DEFAULT_SAMPLE_SIZE latent pixels times the VAE's scale
    max_sequence_length: int = MAX_SEQUENCE_LENGTH


def _check_template_prefix(tokenizer) -> None:
    """The pipeline drops a fixed 34 tokens: the template's prefix must tokenize to exactly those, also
    when a prompt follows it."""
    prefix_ids = list(tokenizer(PROMPT_TEMPLATE.split("{}")[0])["input_ids"])
    in_context = list(tokenizer(PROMPT_TEMPLATE.format("a cat"))["input_ids"][:TEMPLATE_DROP_TOKENS])
    if len(prefix_ids) != TEMPLATE_DROP_TOKENS or in_context != prefix_ids:
        raise ModelLoadError(f"qwen_image: the tokenizer splits the prompt template's prefix into {len(prefix_ids)} "
                             f"tokens; Qwen-Image drops the first {TEMPLATE_DROP_TOKENS} (is this Qwen's tokenizer?)")


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
    )
    settings_class = QwenImageSettings

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, *,
                 settings: QwenImageSettings | None = None):
        config = transformer.config
        variant = [key for key in (*VARIANT_OPTIONS, "guidance_embeds") if config.get(key)]
        if variant:
            raise ModelLoadError(f"qwen_image: the transformer sets {variant}, options of the image-conditioned "
                                 "(Edit, Layered) or guidance-distilled variants; this family is Qwen-Image text "
                                 "to image")
        unsupported = [key for key in UNSUPPORTED_SCHEDULER_OPTIONS if scheduler.config.get(key)]
        if unsupported:
            raise ModelLoadError(f"qwen_image: unsupported scheduler options {unsupported} (they change the step "
                                 "that the sampling module reproduces)")
        if config.in_channels != 4 * vae.config.z_dim:
            raise ModelLoadError(f"qwen_image: the transformer takes {config.in_channels} channels, 2x2 patches of "
                                 f"the VAE's {vae.config.z_dim} latent channels are {4 * vae.config.z_dim}")
        if text_encoder is not None and text_encoder.config.text_config.hidden_size != config.joint_attention_dim:
            raise ModelLoadError(f"qwen_image: the text encoder is {text_encoder.config.text_config.hidden_size} "
                                 f"wide, the transformer reads {config.joint_attention_dim}-wide text")
        _check_template_prefix(tokenizer)
        # Everything checked: now the transformer is prepared (once; it is shared with whoever holds it).
        self.transformer = transformer
        _build_rope_on_the_compute_device(transformer)
        if next(transformer.parameters()).device.type == "cpu":
            _run_per_sample_layers_row_by_row(transformer)
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.settings = settings or QwenImageSettings()
        self.vae_scale = 2 ** len(vae.config.temperal_downsample)
        self.pixels_per_token = self.vae_scale * 2  # the VAE's downsampling, then the 2x2 patches

    def reference_pipeline(self):
        """diffusers' `QwenImagePipeline` over this family's own components (no copy of the weights): what the
        tests check the engine against and the benchmarks time it against. Its CFG scale is `true_cfg_scale`,
        on only when a negative prompt is given (its `guidance_scale` is the guidance-distilled variant's)."""
        from diffusers import QwenImagePipeline

        # A copy of the scheduler: the pipeline's set_timesteps and steps rewrite its state (timesteps, σ's,
        # step index), and the family's scheduler is the engine's.
        pipe = QwenImagePipeline(scheduler=copy.deepcopy(self.scheduler), vae=self.vae, text_encoder=self.text_encoder,
                                 tokenizer=self.tokenizer, transformer=self.transformer)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> QwenImageSettings:
        pipeline = str(index.get("_class_name", ""))
        if "Edit" in pipeline or "Layered" in pipeline:
            raise ModelLoadError(f"{root / 'model_index.json'}: {pipeline} is an image-conditioned Qwen-Image variant; "
                                 "the qwen_image family is text to image only")
        return super().read_settings(root, index)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        size = self.settings.default_size or DEFAULT_SAMPLE_SIZE * self.vae_scale
        return size, size

    def check_size(self, height: int, width: int) -> None:
        step = self.pixels_per_token
        require_pixel_multiple("Qwen-Image", step, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        config = self.scheduler.config
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        mu = resolution_mu(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 4096),
                           config.get("base_shift", 0.5), config.get("max_shift", 1.15))
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu, device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

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
        texts = [self._encode_one(p) for p in prompts]
        longest = max(t.shape[0] for t in texts)
        embeds = texts[0].new_zeros(len(texts), 1 + longest, texts[0].shape[1])
        for row, text in enumerate(texts):
            embeds[row, 0, 0] = text.shape[0]
            embeds[row, 1 : 1 + text.shape[0]] = text
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1, device=embeds.device))

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """sglang's Qwen-Image cond kwargs: the prompt's own tokens (no header, no padding), `txt_seq_lens`
        (the mask is derived from it) and `img_shapes` [[(frames, rows, columns)]] of the latent token grid.
        sglang's `freqs_cis` is left out: the RoPE tables are rebuilt on the compute device from these."""
        length = int(cond.embeds[0, 0, 0])
        rows, cols = (int(v) + 1 for v in image_ids[-1, 1:3])
        return {"encoder_hidden_states": [cond.embeds[0, 1 : 1 + length]], "txt_seq_lens": [length],
                "img_shapes": [[[1, rows, cols]]]}

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
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 1)), image_ids

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        shape = (len(generators), 1, self.vae.config.z_dim, 2 * h, 2 * w)  # what the pipeline draws per sample
        tokens = pack_latents(randn_per_sample(shape, generators, device=self.device)[:, 0], 2)
        return Latents(tokens, image_position_ids(h, w, device=self.device))

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> PromptEmbeds:
        """Always one forward: the shorter text is zero-padded to the longer (see the module docstring)."""
        length = max(cond.embeds.shape[1], uncond.embeds.shape[1]) - 1
        return PromptEmbeds(torch.cat([pad_text(uncond.embeds, length), pad_text(cond.embeds, length)]), cond.ids)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        x, embeds = latents.tokens, cond.embeds
        dtype = next(transformer.parameters()).dtype
        # The image grid and each row's text length, read in one host sync.
        h, w, *lengths = torch.cat([latents.ids[-1, 1:] + 1, text_lengths(embeds)]).tolist()
        longest = int(max(lengths))
        text = embeds[:, 1 : 1 + longest]  # the text of this forward's longest prompt
        mask = None  # like the pipeline: no mask when no row is padded
        if any(n != longest for n in lengths):
            mask = torch.arange(longest, device=x.device)[None] < text_lengths(embeds)[:, None]
        # The scheduler's timestep, σ·1000, divided by 1000 as the pipeline does.
        timestep = sigma * self.scheduler.config.num_train_timesteps / 1000
        with self.forward_precision():
            return transformer(hidden_states=x.to(dtype), timestep=timestep.to(dtype),
                               encoder_hidden_states=text.to(dtype), encoder_hidden_states_mask=mask,
                               img_shapes=[[(1, int(h), int(w))]] * x.shape[0], return_dict=False)[0].float()

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma) -> torch.Tensor:
        combined = v_uncond + guidance_scale * (v_cond - v_uncond)
        # True CFG's rescale: each token's guided velocity gets the norm of its conditional velocity.
        return combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              2, per_call=self.vae_decode_batch)
