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
over, which DESIGN §5 reports drifts every block on a GPU (not measured by this repository's tests).

Refused with a `ModelLoadError`: the image-conditioned variants (Qwen-Image-Edit and Layered checkpoints,
and the transformer options only they use: `zero_cond_t`, `use_additional_t_cond`, `use_layer3d_rope`),
the guidance-distilled option (`guidance_embeds`), and scheduler options that change the step
(`stochastic_sampling`, `invert_sigmas`). Image-conditioned requests are refused by the engine.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from diffrl.errors import ModelLoadError
from diffrl.models.base import (
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    read_json,
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import (
    embed_rows_one_at_a_time,
    one_value_for_all_rows,
    rows_share_one_timestep,
)
from diffrl.models.qwen_vae import decode_latents, pack_latents
from diffrl.models.registry import register_family
from diffrl.models.weights import require_finite_modules
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
    """Sample k bit-identical in any batch, on CPU (DESIGN §2): the layers whose matmul row count is the
    batch size (the timestep MLP, every block's two AdaLN modulations, the output modulation) run one
    distinct row at a time. Their input depends on the timestep alone, so a rollout step (one σ for the
    whole batch) is a single one-row call. Not on GPU, where batched kernels differ anyway."""
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
    default_guidance_scale = 4.0  # the pipeline's default true_cfg_scale
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes them / 1000
    pads_text = True  # conditionings of different lengths share a batch, zero-padded (see the module docstring)
    has_true_cfg = True
    # The joint attention's projections of both streams (the Flow-GRPO LoRA targets).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    block_lists = ("transformer_blocks",)

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

    # ---------------------------------------------------------------- load
    @classmethod
    def load(cls, model_path, *, device="cpu", dtype=torch.float32, load_text_encoder=True) -> QwenImageFamily:
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

        root = Path(model_path)
        if not root.is_dir():
            raise ModelLoadError(f"model directory not found: {root}")
        for component in ("transformer", "vae") + (("text_encoder",) if load_text_encoder else ()):
            read_json(root / component / "config.json")
        read_json(root / "tokenizer" / "tokenizer_config.json")
        read_json(root / "scheduler" / "scheduler_config.json")
        settings = QwenImageSettings()
        index_file = root / "model_index.json"
        if index_file.is_file():
            index = read_json(index_file)
            pipeline = str(index.get("_class_name", ""))
            if "Edit" in pipeline or "Layered" in pipeline:
                raise ModelLoadError(f"{index_file}: {pipeline} is an image-conditioned Qwen-Image variant; the "
                                     "qwen_image family is text to image only")
            overrides = dict(index.get("diffrl", {}))
            overrides.pop("family", None)
            try:
                settings = QwenImageSettings(**overrides)
            except TypeError as err:
                raise ModelLoadError(f"corrupt file: {index_file} (bad 'diffrl' block: {err})") from None
        try:
            transformer = QwenImageTransformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype,
                                                                      local_files_only=True)
            vae = AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype, local_files_only=True)
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler", local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
            text_encoder = (Qwen2_5_VLForConditionalGeneration.from_pretrained(
                str(root / "text_encoder"), dtype=dtype, local_files_only=True) if load_text_encoder else None)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the Qwen-Image checkpoint {root}: {str(err).splitlines()[0]}") from None
        for module in (transformer, vae, text_encoder):
            if module is not None:
                module.to(device=device).eval().requires_grad_(False)
        require_finite_modules(root, {"transformer": transformer, "vae": vae, "text_encoder": text_encoder})
        return cls(transformer, vae, text_encoder, tokenizer, scheduler, settings=settings)

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

    def velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        with rows_share_one_timestep(one_value_for_all_rows(sigma)):
            return self._velocity(transformer, latents, sigma, cond, uncond, guidance_scale)

    def _velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        x = latents.tokens
        batch = x.shape[0]
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(batch)
        dtype = next(transformer.parameters()).dtype
        cfg = guidance_scale > 1.0
        if cfg:
            if uncond is None:
                raise ValueError("guidance_scale > 1 needs the unconditional (negative) conditioning")
            length = max(cond.embeds.shape[1], uncond.embeds.shape[1]) - 1  # the longer of the two (pad)
            embeds = torch.cat([pad_text(uncond.embeds, length), pad_text(cond.embeds, length)])
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        else:
            embeds = cond.embeds
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
            out = transformer(hidden_states=x.to(dtype), timestep=timestep.to(dtype),
                              encoder_hidden_states=text.to(dtype), encoder_hidden_states_mask=mask,
                              img_shapes=[[(1, int(h), int(w))]] * x.shape[0], return_dict=False)[0].float()
        if not cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        combined = v_uncond + guidance_scale * (v_cond - v_uncond)
        # True CFG's rescale: each token's guided velocity gets the norm of its conditional velocity.
        return combined * (torch.norm(v_cond, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              2)


# -------------------------------------------------------------------- random checkpoints
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TOKENIZER_WORDS = (
    "system user assistant describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background a an on in to left right above below with one two three four "
    "circle circles square squares triangle triangles diamond diamonds red green blue yellow purple orange "
    "black white cat cats dog dogs mat blurry ugly picture photo very long prompt about").split()


def build_qwen_tokenizer():
    """A word-level tokenizer made in code with Qwen's chat markers. Like Qwen's own BPE tokenizer it
    keeps newlines and punctuation as tokens, so the template's prefix is the 34 tokens the pipeline drops."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, "<unk>", "\n", ",", ":", ".", "'", '"'))}
    for word in TOKENIZER_WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),
        pre_tokenizers.Split(Regex(r"\n|[^\w\s]"), behavior="isolated"),
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                        eos_token="<|im_end|>", model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


@dataclass
class QwenImageSizes:
    """Component sizes of a random checkpoint. The defaults are tiny (tests); `class_defaults()` is the
    diffusers classes' default transformer and VAE (Qwen-Image's 20 B transformer), for benchmarks."""

    transformer: dict = field(default_factory=lambda: dict(
        patch_size=2, num_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6)))
    text_hidden: int = 32
    text_layers: int = 2
    text_heads: int = 2
    vae: dict = field(default_factory=lambda: dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]))
    default_size: int | None = 32

    @classmethod
    def class_defaults(cls) -> QwenImageSizes:
        """`QwenImageTransformer2DModel` and `AutoencoderKLQwenImage` at their defaults (Qwen-Image's sizes),
        with a text encoder of Qwen2.5-VL-7B's width (3,584) but 2 layers: a prompt is encoded once per
        request, so its depth does not change what a benchmark of sampling and training measures."""
        return cls(transformer={}, text_hidden=3584, text_layers=2, text_heads=28, vae={}, default_size=None)


def save_random_checkpoint(path: str | Path, sizes: QwenImageSizes | None = None, *, seed: int = 0,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """A Qwen-Image checkpoint in diffusers layout with random weights and a tokenizer made in code (no
    download), with random latent statistics so that decoding exercises them; built on `device`, stored in
    `dtype`. The scheduler config is Qwen-Image's (dynamic shift, stretched to a terminal σ of 0.02)."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    sizes = sizes or QwenImageSizes()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_qwen_tokenizer()
    heads = sizes.text_heads
    half_head = sizes.text_hidden // heads // 2  # the rotary sections (t, h, w) split half a head
    special = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=sizes.text_hidden,
                             intermediate_size=2 * sizes.text_hidden, num_hidden_layers=sizes.text_layers,
                             num_attention_heads=heads, num_key_value_heads=1,
                             bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
                             pad_token_id=special["<|endoftext|>"],
                             rope_scaling={"rope_type": "default", "mrope_section": [
                                 half_head - 2 * (half_head // 4), half_head // 4, half_head // 4]}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=sizes.text_hidden, fullatt_block_indexes=[0])))
        z_dim = sizes.vae.get("z_dim", 16)
        generator = torch.Generator().manual_seed(seed)
        # Drawn on the CPU (the generator's device) whatever `device` builds the modules.
        latents_mean = (0.5 * torch.randn(z_dim, generator=generator, device="cpu")).tolist()
        latents_std = (0.5 + 1.5 * torch.rand(z_dim, generator=generator, device="cpu")).tolist()
        vae = AutoencoderKLQwenImage(latents_mean=latents_mean, latents_std=latents_std, **sizes.vae)
        transformer = QwenImageTransformer2DModel(in_channels=4 * z_dim, out_channels=z_dim,
                                                  joint_attention_dim=sizes.text_hidden, **sizes.transformer)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    # Qwen-Image's published scheduler settings.
    FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=256, max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential",
    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "QwenImagePipeline",
        "transformer": ["diffusers", "QwenImageTransformer2DModel"], "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
        "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "diffrl": {"family": QwenImageFamily.name, "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
