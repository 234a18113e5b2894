"""The `krea2` family: Krea 2 (diffusers' `Krea2Transformer2DModel`, driven by `Krea2Pipeline`), text to image.

A checkpoint is a local diffusers-format directory:

    transformer/   Krea2Transformer2DModel   vae/        AutoencoderKLQwenImage (16 latent channels, f8)
    text_encoder/  Qwen3VLModel              scheduler/  FlowMatchEulerDiscreteScheduler (dynamic shift)
    tokenizer/     the Qwen3-VL tokenizer    model_index.json  the pipeline's own settings (below)

`model_index.json` carries what `Krea2Pipeline` registers in its config: `text_encoder_select_layers` (which
hidden states of the text encoder are stacked), `is_distilled` (the few-step checkpoint) and `patch_size`.
Missing, they take the pipeline's defaults. Its `diffrl` block may set `max_sequence_length` (the pipeline's
call argument, 512) and `default_size` (1024); the tiny test checkpoints make both small.

What this adapter reproduces of diffusers' `Krea2Pipeline` (checked by `tests/test_krea2.py`):
- prompt encoding: Qwen-Image's system/user template prefix plus the prompt, truncated and right-padded to
  `max_sequence_length + 34 − 5` tokens, then the 5-token assistant suffix appended *after* the padding, so the
  window is `[prefix | prompt | padding | suffix]`. Qwen3-VL runs it with the padding masked and position ids
  that count real tokens only (the suffix keeps the phase it had next to the prompt); the selected hidden states
  are stacked per token and the 34 prefix tokens dropped: a fixed window of `max_sequence_length` tokens and its
  boolean mask (real prompt tokens and the suffix);
- latents: the VAE's `[B, 16, H/8, W/8]` noise, packed into 2×2 patches `[B, h·w, 64]`; position ids are zeros
  for text and `(0, row, column)` for image tokens, one table for the whole `[text, image]` sequence;
- schedule: the scheduler's own for `linspace(1, 1/N, N)`, with the dynamic shift μ linear in the number of
  image tokens over the scheduler's `base/max_image_seq_len` and `base/max_shift` (the pipeline's defaults
  256, 6400, 0.5, 1.15); the distilled checkpoint uses μ = 1.15 at every size. The transformer's timestep is
  the scheduler's timestep (σ·1000) divided by `num_train_timesteps`, as the pipeline computes it;
- CFG in Krea's form `cond + g·(cond − uncond)`; the pipeline's scale g is on for g > 0 and equals the usual
  scale s = 1 + g. Requests carry the usual scale, as for every family (`guidance_scale`, on above 1; the
  pipeline's default g = 4.5 is s = 5.5). The pipeline runs the two halves as two forwards; here they share one;
- decode: tokens unpacked to `[B, 16, 1, H/8, W/8]`, `latents · std + mean` with the VAE's `latents_std` /
  `latents_mean` (the pipeline's arithmetic), decoded, first frame, `x/2 + 0.5` clamped.

The conditioning travels as the one tensor every family carries: `PromptEmbeds.embeds` is
`[B, L, layers·D + 1]`, each token's stacked hidden states (layer-major) followed by one channel holding its
text mask (1 real, 0 padding). `velocity` unpacks both, so the denoising env and the trainer replay the exact
forward without a separate mask. Every prompt has the same window, so prompts, negative prompts and
microgroups always share a batch.

Batching (the recipe default of DESIGN §5 is DiffusionNFT with microgroup 1): nothing in diffusers' Krea 2 makes
a batch incorrect. The text is a fixed window with a per-row key-padding mask (not packed, not variable
length), the timestep modulation is per row and the position table is shared by rows of one resolution. So
requests of several outputs are served as one batch, and sample k is bit-identical in any microgroup on CPU
(the timestep MLP and its modulation projection, the only matmuls whose row count is the batch size, run one
distinct row at a time there). So DESIGN §5's microgroup 1 (with NFT) is not needed for correctness; what it
bounds is size: the transformer has 12.8 B parameters, a 1024² sample is 512 text + 4,096 image tokens in every
block, and one prompt's conditioning (512 tokens × 12 layers × 2,560, fp32) is 63 MB, repeated per output.

Refused with a `ModelLoadError`: a transformer whose input channels are not the VAE's channels in patches, a
text encoder or layer selection that does not fit the transformer's text input, a tokenizer that does not split
the template into the 34 + 5 tokens the pipeline cuts at, and scheduler options that change the step
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
from diffrl.models.base import FamilyAdapter, Latents, PromptEmbeds, read_json, require_pixel_multiple
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.qwen_vae import decode_latents, pack_latents
from diffrl.models.registry import register_family
from diffrl.models.weights import require_finite_modules
from diffrl.sampling import randn_per_sample, resolution_mu

# The pipeline's text layout: this prefix (34 tokens with Qwen's tokenizer, dropped from the conditioning), the
# prompt, padding, then this suffix (5 tokens).
TEMPLATE_PREFIX = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n")
TEMPLATE_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n"
PREFIX_TOKENS = 34
SUFFIX_TOKENS = 5
# Krea 2's taps of Qwen3-VL-4B's 37 hidden states (0 is the embedding output).
DEFAULT_SELECT_LAYERS = (2, 5, 8, 11, 14, 17, 20, 23, 26, 29, 32, 35)
DISTILLED_MU = 1.15  # the few-step checkpoint's fixed shift
UNSUPPORTED_SCHEDULER_OPTIONS = ("stochastic_sampling", "invert_sigmas")


@dataclass
class Krea2Settings:
    """Per-checkpoint values outside the components' configs: the pipeline's registered config
    (`text_encoder_select_layers`, `is_distilled`, `patch_size`, top level of model_index.json) and this
    adapter's (`max_sequence_length`, `default_size`, its `diffrl` block)."""

    text_encoder_select_layers: tuple[int, ...] = DEFAULT_SELECT_LAYERS
    is_distilled: bool = False
    patch_size: int = 2
    max_sequence_length: int = 512
    default_size: int = 1024


def _read_settings(index_file: Path) -> Krea2Settings:
    if not index_file.is_file():
        return Krea2Settings()
    index = read_json(index_file)
    values = {key: index[key] for key in ("text_encoder_select_layers", "is_distilled", "patch_size") if key in index}
    extra = dict(index.get("diffrl", {}))
    extra.pop("family", None)
    try:
        settings = Krea2Settings(**values, **extra)
    except TypeError as err:
        raise ModelLoadError(f"corrupt file: {index_file} (bad 'diffrl' block: {err})") from None
    settings.text_encoder_select_layers = tuple(int(k) for k in settings.text_encoder_select_layers)
    if settings.max_sequence_length < 1 or settings.patch_size < 1:
        raise ModelLoadError(f"{index_file}: max_sequence_length and patch_size must be positive")
    return settings


def _check_template(tokenizer) -> None:
    """The pipeline cuts the window at fixed token counts: the tokenizer must split the template's prefix into
    34 tokens (also with a prompt after it) and its suffix into 5."""
    prefix = list(tokenizer(TEMPLATE_PREFIX)["input_ids"])
    in_context = list(tokenizer(TEMPLATE_PREFIX + "a cat")["input_ids"][:PREFIX_TOKENS])
    suffix = list(tokenizer(TEMPLATE_SUFFIX)["input_ids"])
    if len(prefix) != PREFIX_TOKENS or in_context != prefix or len(suffix) != SUFFIX_TOKENS:
        raise ModelLoadError(f"krea2: the tokenizer splits the prompt template into {len(prefix)} + {len(suffix)} "
                             f"tokens; Krea 2 cuts it at {PREFIX_TOKENS} + {SUFFIX_TOKENS} (is this Qwen's tokenizer?)")


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (DESIGN §2): the timestep embedding (sinusoid and MLP) and
    the shared modulation projection are the only layers whose matmul row count is the batch size; they run
    one distinct row at a time. (Each block and the final layer only add a learned table to that modulation.)
    Not on GPU, where batched kernels differ anyway."""
    # `timestep=False`: their outputs keep a token axis of 1, which the shared-timestep shortcut does not expand.
    embed_rows_one_at_a_time(transformer.time_embed, timestep=False)
    embed_rows_one_at_a_time(transformer.time_mod_proj, timestep=False)


def image_position_ids(h: int, w: int, device=None) -> torch.Tensor:
    """(0, row, column) of each image token `[h·w, 3]`."""
    rows = torch.arange(h, device=device, dtype=torch.float32).repeat_interleave(w)
    cols = torch.arange(w, device=device, dtype=torch.float32).repeat(h)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1)


@register_family
class Krea2Family(FamilyAdapter):
    name = "krea2"
    name_patterns = ("krea2", "krea-2", "krea_2")
    default_guidance_scale = 5.5  # the pipeline's default g = 4.5 in Krea's form (s = 1 + g)
    timestep_scale = 1000.0  # reported timesteps are the scheduler's (σ·1000); the transformer takes them / 1000
    # The gated attention's projections: the 28 single-stream blocks' and the text fusion's (peft matches by suffix).
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_gate", "attn.to_out.0")
    block_lists = ("transformer_blocks",)

    def __init__(self, transformer, vae, text_encoder, tokenizer, scheduler, *, settings: Krea2Settings | None = None):
        settings = settings or Krea2Settings()
        config = transformer.config
        patch = settings.patch_size
        if config.in_channels != vae.config.z_dim * patch**2:
            raise ModelLoadError(f"krea2: the transformer takes {config.in_channels} channels; {patch}x{patch} patches "
                                 f"of the VAE's {vae.config.z_dim} latent channels are {vae.config.z_dim * patch**2}")
        layers = settings.text_encoder_select_layers
        if len(layers) != config.num_text_layers:
            raise ModelLoadError(f"krea2: text_encoder_select_layers has {len(layers)} entries, the transformer fuses "
                                 f"{config.num_text_layers} text-encoder layers")
        if text_encoder is not None:
            text_config = text_encoder.config.text_config
            if text_config.hidden_size != config.text_hidden_dim:
                raise ModelLoadError(f"krea2: the text encoder is {text_config.hidden_size} wide, the transformer "
                                     f"reads {config.text_hidden_dim}-wide text")
            if not all(0 <= k <= text_config.num_hidden_layers for k in layers):
                raise ModelLoadError(f"krea2: text_encoder_select_layers {list(layers)} out of range for a text "
                                     f"encoder of {text_config.num_hidden_layers} layers (hidden states 0.."
                                     f"{text_config.num_hidden_layers})")
        unsupported = [key for key in UNSUPPORTED_SCHEDULER_OPTIONS if scheduler.config.get(key)]
        if unsupported:
            raise ModelLoadError(f"krea2: unsupported scheduler options {unsupported} (they change the step that "
                                 "the sampling module reproduces)")
        _check_template(tokenizer)
        # Everything checked: now the transformer is prepared (once; it is shared with whoever holds it).
        self.transformer = transformer
        if next(transformer.parameters()).device.type == "cpu":
            _run_per_sample_layers_row_by_row(transformer)
        self.vae = vae
        self.text_encoder = text_encoder
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.settings = settings
        if settings.is_distilled:
            self.default_guidance_scale = 1.0  # the few-step checkpoint samples without CFG (g = 0)
        self.vae_scale = 2 ** len(vae.config.temperal_downsample)
        self.pixels_per_token = self.vae_scale * patch

    def reference_pipeline(self):
        """diffusers' `Krea2Pipeline` over this family's own components (a copy of the scheduler, whose state
        sampling changes): what the tests check the engine against."""
        from diffusers import Krea2Pipeline

        pipe = Krea2Pipeline(scheduler=copy.deepcopy(self.scheduler), vae=self.vae, text_encoder=self.text_encoder,
                             tokenizer=self.tokenizer, transformer=self.transformer,
                             text_encoder_select_layers=self.settings.text_encoder_select_layers,
                             is_distilled=self.settings.is_distilled, patch_size=self.settings.patch_size)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- load
    @classmethod
    def load(cls, model_path, *, device="cpu", dtype=torch.float32, load_text_encoder=True) -> Krea2Family:
        from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel
        from transformers import AutoTokenizer, Qwen3VLModel

        root = Path(model_path)
        if not root.is_dir():
            raise ModelLoadError(f"model directory not found: {root}")
        for component in ("transformer", "vae") + (("text_encoder",) if load_text_encoder else ()):
            read_json(root / component / "config.json")
        read_json(root / "tokenizer" / "tokenizer_config.json")
        read_json(root / "scheduler" / "scheduler_config.json")
        settings = _read_settings(root / "model_index.json")
        try:
            transformer = Krea2Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype,
                                                                  local_files_only=True)
            vae = AutoencoderKLQwenImage.from_pretrained(root / "vae", torch_dtype=dtype, local_files_only=True)
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler", local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
            text_encoder = (Qwen3VLModel.from_pretrained(str(root / "text_encoder"), dtype=dtype, local_files_only=True)
                            if load_text_encoder else None)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the Krea 2 checkpoint {root}: {str(err).splitlines()[0]}") from None
        for module in (transformer, vae, text_encoder):
            if module is not None:
                module.to(device=device).eval().requires_grad_(False)
        require_finite_modules(root, {"transformer": transformer, "vae": vae, "text_encoder": text_encoder})
        return cls(transformer, vae, text_encoder, tokenizer, scheduler, settings=settings)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return self.settings.default_size, self.settings.default_size

    def check_size(self, height: int, width: int) -> None:
        step = self.pixels_per_token
        require_pixel_multiple("Krea 2", step, height=height, width=width)

    def shift_mu(self, height: int, width: int) -> float:
        """The schedule's μ: fixed for the distilled checkpoint, else linear in the number of image tokens."""
        if self.settings.is_distilled:
            return DISTILLED_MU
        config = self.scheduler.config
        image_tokens = (height // self.pixels_per_token) * (width // self.pixels_per_token)
        return resolution_mu(image_tokens, config.get("base_image_seq_len", 256), config.get("max_image_seq_len", 6400),
                             config.get("base_shift", 0.5), config.get("max_shift", 1.15))

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=self.shift_mu(height, width),
                                device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def text_window(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and mask `[1, 34 + L]` of `[prefix | prompt | padding | suffix]` (the prefix not yet dropped)."""
        length = self.settings.max_sequence_length + PREFIX_TOKENS - SUFFIX_TOKENS
        text = self.tokenizer(TEMPLATE_PREFIX + prompt, truncation=True, padding="max_length", max_length=length,
                              padding_side="right", return_tensors="pt")
        suffix = self.tokenizer(TEMPLATE_SUFFIX, return_tensors="pt")
        ids = torch.cat([text["input_ids"], suffix["input_ids"]], dim=1)
        mask = torch.cat([text["attention_mask"], suffix["attention_mask"]], dim=1).bool()
        return ids, mask

    def _encode_one(self, prompt: str) -> torch.Tensor:
        """One prompt's conditioning `[L, layers·D + 1]` (fp32): stacked hidden states, then the mask channel."""
        ids, mask = self.text_window(prompt)
        device = next(self.text_encoder.parameters()).device
        ids, mask = ids.to(device), mask.to(device)
        # Padding takes no position: each token's position is the number of real tokens before it (all 3 mRoPE axes).
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)[None].expand(3, -1, -1)
        out = self.text_encoder(input_ids=ids, attention_mask=mask, position_ids=positions, output_hidden_states=True)
        hidden = torch.stack([out.hidden_states[k] for k in self.settings.text_encoder_select_layers], dim=2)
        hidden = hidden[0, PREFIX_TOKENS:].flatten(1).float()  # [L, layers·D], layer-major per token
        return torch.cat([hidden, mask[0, PREFIX_TOKENS:, None].float()], dim=1)

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt encoded on its own (its conditioning never depends on the prompts beside it); every
        window has `max_sequence_length` tokens, so they stack."""
        if self.text_encoder is None:
            raise RuntimeError("this Krea 2 model was loaded without its text encoder")
        embeds = torch.stack([self._encode_one(p) for p in prompts])
        return PromptEmbeds(embeds, torch.zeros(embeds.shape[1], 3, device=embeds.device))

    def unpack_conditioning(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(stacked hidden states `[B, L, layers, D]`, text mask `[B, L]` bool) from the packed conditioning."""
        config = self.transformer.config
        hidden = embeds[..., :-1].unflatten(-1, (config.num_text_layers, config.text_hidden_dim))
        return hidden, embeds[..., -1] > 0.5

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        patch = self.settings.patch_size
        h, w = height // self.pixels_per_token, width // self.pixels_per_token
        shape = (len(generators), self.vae.config.z_dim, h * patch, w * patch)  # what the pipeline draws per sample
        tokens = pack_latents(randn_per_sample(shape, generators, device=self.device), patch)
        return Latents(tokens, image_position_ids(h, w, device=self.device))

    def velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        x = latents.tokens
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])
        dtype = next(transformer.parameters()).dtype
        cfg = guidance_scale > 1.0
        embeds = cond.embeds
        if cfg:
            if uncond is None:
                raise ValueError("guidance_scale > 1 needs the unconditional (negative) conditioning")
            if uncond.embeds.shape[1:] != cond.embeds.shape[1:]:
                raise ValueError(f"the negative conditioning {tuple(uncond.embeds.shape[1:])} does not match the "
                                 f"conditioning {tuple(cond.embeds.shape[1:])}")
            embeds = torch.cat([uncond.embeds, cond.embeds])
            x, sigma = torch.cat([x, x]), torch.cat([sigma, sigma])
        text, mask = self.unpack_conditioning(embeds)
        position_ids = torch.cat([cond.ids.to(latents.ids), latents.ids])  # [text | image] `[L + S, 3]`
        # The scheduler's timestep (σ·1000) divided by num_train_timesteps, as the pipeline does.
        train_steps = self.scheduler.config.num_train_timesteps
        timestep = sigma * train_steps / train_steps
        with self.forward_precision():
            out = transformer(hidden_states=x.to(dtype), encoder_hidden_states=text.to(dtype),
                              timestep=timestep.to(dtype), position_ids=position_ids, encoder_attention_mask=mask,
                              return_dict=False)[0].float()
        if not cfg:
            return out
        v_uncond, v_cond = out.chunk(2)
        return v_cond + (guidance_scale - 1.0) * (v_cond - v_uncond)  # Krea's form, g = s − 1

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        return decode_latents(self.vae, latents, height // self.pixels_per_token, width // self.pixels_per_token,
                              self.settings.patch_size)


# -------------------------------------------------------------------- random checkpoints
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCABULARY = (
    "system user assistant Describe the image by detailing color shape size texture quantity text spatial "
    "relationships of objects and background a an on in at to left right above below with one two three four "
    "circle circles square squares triangle triangles red green blue yellow purple orange black white cat cats "
    "dog dogs mat fox snow blurry ugly low quality picture photo very long prompt about").split()


def build_template_tokenizer():
    """A word-level tokenizer made in code, with Qwen's chat markers as special tokens. Newlines and
    punctuation are tokens of their own (as in Qwen's BPE), so the template splits into the 34 + 5 tokens the
    pipeline cuts at; unknown words map to `<unk>`."""
    from tokenizers import Regex, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate((*SPECIAL_TOKENS, "<unk>", "\n", ",", ".", ":", "'"))}
    for word in VOCABULARY:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"[ \t]+"), behavior="removed"),  # spaces separate words
        pre_tokenizers.Split(Regex(r"\n|[^\w\s]"), behavior="isolated"),  # newlines and punctuation stand alone
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>", unk_token="<unk>",
                                        eos_token="<|im_end|>", model_max_length=32768)
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    return tokenizer


@dataclass
class Krea2Sizes:
    """Component sizes of a random checkpoint. The defaults are tiny (tests: grouped-query attention in the
    blocks, two fused text layers); `class_defaults()` is `Krea2Transformer2DModel`'s default configuration
    (Krea 2's 12 B transformer) with the real VAE, for benchmarks."""

    transformer: dict = field(default_factory=lambda: dict(
        num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1, intermediate_size=64,
        timestep_embed_dim=32, text_num_attention_heads=2, text_num_key_value_heads=2, text_intermediate_size=64,
        num_layerwise_text_blocks=1, num_refiner_text_blocks=1, axes_dims_rope=(4, 6, 6)))
    text_hidden: int = 32
    text_layers: int = 4
    text_heads: int = 2
    select_layers: tuple[int, ...] = (2, 4)
    vae: dict = field(default_factory=lambda: dict(
        base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[False]))
    max_sequence_length: int = 24
    default_size: int = 32

    @classmethod
    def class_defaults(cls) -> Krea2Sizes:
        """The transformer and VAE at the diffusers classes' defaults; a text encoder of Qwen3-VL-4B's width
        (2,560) with 12 layers, one per fused tap: a prompt is encoded once per request, so its depth does not
        change what a benchmark of sampling and training measures. 1024² and 512 text tokens, as the pipeline."""
        return cls(transformer={}, text_hidden=2560, text_layers=12, text_heads=20,
                   select_layers=tuple(range(1, 13)), vae={}, max_sequence_length=512, default_size=1024)


def save_random_checkpoint(path: str | Path, sizes: Krea2Sizes | None = None, *, seed: int = 0,
                           is_distilled: bool = False, device: str | torch.device = "cpu",
                           dtype: torch.dtype = torch.float32) -> Path:
    """A Krea 2 checkpoint in diffusers layout with random weights and a tokenizer made in code (no download):
    random latent statistics, modulation tables and norm scales (zeros at init) so that every one of them is
    exercised; the scheduler is Krea 2's (dynamic shift). Built on `device`, stored in `dtype`."""
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, Krea2Transformer2DModel
    from transformers import Qwen3VLConfig, Qwen3VLModel

    sizes = sizes or Krea2Sizes()
    path = Path(path)
    torch.manual_seed(seed)
    tokenizer = build_template_tokenizer()
    heads = sizes.text_heads
    half_head = sizes.text_hidden // heads // 2  # the rotary sections (t, h, w) split half a head
    special = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    with torch.device(device):  # build where it is fast
        text_encoder = Qwen3VLModel(Qwen3VLConfig(
            text_config=dict(vocab_size=len(tokenizer), hidden_size=sizes.text_hidden,
                             intermediate_size=2 * sizes.text_hidden, num_hidden_layers=sizes.text_layers,
                             num_attention_heads=heads, num_key_value_heads=1, head_dim=sizes.text_hidden // heads,
                             bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
                             pad_token_id=special["<|endoftext|>"],
                             rope_scaling={"rope_type": "default", "mrope_section": [
                                 half_head - 2 * (half_head // 4), half_head // 4, half_head // 4]}),
            vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                               out_hidden_size=sizes.text_hidden, deepstack_visual_indexes=[0])))
        z_dim = sizes.vae.get("z_dim", 16)
        generator = torch.Generator().manual_seed(seed)
        latents_mean = (0.5 * torch.randn(z_dim, generator=generator)).tolist()
        latents_std = (0.5 + 1.5 * torch.rand(z_dim, generator=generator)).tolist()
        vae = AutoencoderKLQwenImage(latents_mean=latents_mean, latents_std=latents_std, **sizes.vae)
        transformer = Krea2Transformer2DModel(in_channels=4 * z_dim, text_hidden_dim=sizes.text_hidden,
                                              num_text_layers=len(sizes.select_layers), **sizes.transformer)
        with torch.no_grad():  # at init the tables and norm scales are zeros; the text's effect is then faint
            for name, p in transformer.named_parameters():
                if name.endswith("scale_shift_table"):
                    p.normal_(0, 1.0, generator=generator)
                elif "norm" in name:
                    p.normal_(0, 0.1, generator=generator)
    for module, folder in ((transformer, "transformer"), (vae, "vae"), (text_encoder, "text_encoder")):
        (module if dtype == torch.float32 else module.to(dtype)).save_pretrained(path / folder, safe_serialization=True)
    tokenizer.save_pretrained(path / "tokenizer")
    # Krea 2's scheduler settings (Krea2Pipeline's docstring).
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True, base_shift=0.5,
                                    max_shift=1.15, base_image_seq_len=256, max_image_seq_len=6400,
                                    ).save_pretrained(path / "scheduler")
    index = {
        "_class_name": "Krea2Pipeline",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"], "vae": ["diffusers", "AutoencoderKLQwenImage"],
        "text_encoder": ["transformers", "Qwen3VLModel"], "tokenizer": ["transformers", "PreTrainedTokenizerFast"],
        "transformer": ["diffusers", "Krea2Transformer2DModel"],
        "text_encoder_select_layers": list(sizes.select_layers), "is_distilled": is_distilled, "patch_size": 2,
        "diffrl": {"family": Krea2Family.name, "max_sequence_length": sizes.max_sequence_length,
                   "default_size": sizes.default_size},
    }
    (path / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
