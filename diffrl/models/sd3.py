"""The `sd3` family: Stable Diffusion 3 / 3.5 (diffusers' `SD3Transformer2DModel`), text to image, the
model the published Flow-GRPO recipes train.

A checkpoint is a local diffusers-format directory: `transformer/`, `vae/` (AutoencoderKL),
`text_encoder/` and `text_encoder_2/` (CLIP-L and CLIP-G with projection), `text_encoder_3/` (T5; may
be left out, as diffusers allows: its part of the conditioning is then zeros), `tokenizer/`,
`tokenizer_2/`, `tokenizer_3/`, `scheduler/`.

What this adapter reproduces of diffusers' `StableDiffusion3Pipeline` (`tests/test_sd3.py`):
- conditioning: the penultimate hidden states of both CLIPs (77 tokens) side by side, zero-padded to
  T5's width, then T5's `max_sequence_length` tokens; the pooled embedding is both CLIPs' projections;
- the schedule is the scheduler's own (`set_timesteps(N)`: a linspace between the shifted σ_max and
  σ_min, shifted again), and the transformer's timestep is σ·1000;
- latents are the VAE's `[B, 16, H/8, W/8]` (the transformer patchifies them itself), decoded as
  `latents / scaling_factor + shift_factor`; CFG is `uncond + s·(cond − uncond)` in one batch.

The pooled embedding travels inside the conditioning tensor: `PromptEmbeds.embeds` is `[B, L + 1, D]`
whose last token holds the pooled vector (zero-padded to D), so the engine, the denoising env and the
trainer carry SD3's two text inputs as the one tensor they carry for every family.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

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
    decode_rows,
    embed_rows_one_at_a_time,
    one_value_for_all_rows,
    rows_share_one_timestep,
)
from diffrl.models.registry import register_family
from diffrl.models.weights import require_finite_modules
from diffrl.sampling import randn_per_sample

CLIP_TOKENS = 77


def _run_per_sample_layers_row_by_row(transformer) -> None:
    """Sample k bit-identical in any batch, on CPU (DESIGN §2): the layers whose matmul row count is the
    batch size (the timestep and pooled-text MLPs, every block's AdaLN modulation) run one distinct row
    at a time, since BLAS rounds other row counts differently. Not on GPU, where batched kernels differ
    anyway and a row-by-row modulation would cost ~50 small launches per forward."""
    embed_rows_one_at_a_time(transformer.time_text_embed.timestep_embedder)
    embed_rows_one_at_a_time(transformer.time_text_embed.text_embedder, timestep=False)
    for name, module in transformer.named_modules():
        if name.endswith(("norm1.linear", "norm1_context.linear", "norm_out.linear")):
            embed_rows_one_at_a_time(module, timestep=False)


@register_family
class SD3Family(FamilyAdapter):
    name = "sd3"
    name_patterns = ("stable-diffusion-3", "sd3", "sd-3")
    default_guidance_scale = 4.5  # the Flow-GRPO recipes' CFG for SD3.5 (diffusers' pipeline default is 7)
    timestep_scale = 1000.0
    # Flow-GRPO's SD3 LoRA targets: the joint attention's projections of both streams.
    lora_target_modules = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")
    block_lists = ("transformer_blocks",)

    def __init__(self, transformer, vae, text_encoders, tokenizers, scheduler, *, max_sequence_length: int = 256):
        self.transformer = transformer
        if next(transformer.parameters()).device.type == "cpu":
            _run_per_sample_layers_row_by_row(transformer)
        self.vae = vae
        self.text_encoders = text_encoders  # [CLIP-L, CLIP-G, T5 or None]
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.max_sequence_length = max_sequence_length
        self.vae_scale = 2 ** (len(vae.config.block_out_channels) - 1)
        if scheduler.config.get("use_dynamic_shifting"):
            raise ModelLoadError("sd3: the scheduler uses dynamic shifting, which this adapter does not reproduce "
                                 "(SD3 and SD3.5 ship a static shift)")

    def reference_pipeline(self):
        """diffusers' `StableDiffusion3Pipeline` over this family's own components (no copy): what the
        tests check the engine against and the benchmarks time it against."""
        from diffusers import StableDiffusion3Pipeline

        (clip_l, clip_g, t5), (tok_l, tok_g, tok_t5) = self.text_encoders, self.tokenizers
        pipe = StableDiffusion3Pipeline(transformer=self.transformer, scheduler=self.scheduler, vae=self.vae,
                                        text_encoder=clip_l, tokenizer=tok_l, text_encoder_2=clip_g, tokenizer_2=tok_g,
                                        text_encoder_3=t5, tokenizer_3=tok_t5)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- load
    @classmethod
    def load(cls, model_path, *, device="cpu", dtype=torch.float32, load_text_encoder=True,
             max_sequence_length: int = 256) -> SD3Family:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
        from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

        root = Path(model_path)
        if not root.is_dir():
            raise ModelLoadError(f"model directory not found: {root}")
        for component in ("transformer", "vae", "text_encoder", "text_encoder_2"):
            read_json(root / component / "config.json")
        read_json(root / "scheduler" / "scheduler_config.json")
        has_t5 = (root / "text_encoder_3" / "config.json").is_file()
        try:
            transformer = SD3Transformer2DModel.from_pretrained(root / "transformer", torch_dtype=dtype,
                                                                local_files_only=True)
            vae = AutoencoderKL.from_pretrained(root / "vae", torch_dtype=dtype, local_files_only=True)
            scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(root / "scheduler", local_files_only=True)
            names = ["tokenizer", "tokenizer_2"] + (["tokenizer_3"] if has_t5 else [])
            tokenizers = [AutoTokenizer.from_pretrained(str(root / n), local_files_only=True) for n in names]
            encoders = [None, None, None]
            if load_text_encoder:
                encoders = [CLIPTextModelWithProjection.from_pretrained(str(root / n), dtype=dtype, local_files_only=True)
                            for n in ("text_encoder", "text_encoder_2")]
                encoders.append(T5EncoderModel.from_pretrained(str(root / "text_encoder_3"), dtype=dtype,
                                                               local_files_only=True) if has_t5 else None)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the SD3 checkpoint {root}: {str(err).splitlines()[0]}") from None
        for module in (transformer, vae, *encoders):
            if module is not None:
                module.to(device=device).eval().requires_grad_(False)
        require_finite_modules(root, {"transformer": transformer, "vae": vae, "text_encoder": encoders[0],
                                      "text_encoder_2": encoders[1], "text_encoder_3": encoders[2]})
        if len(tokenizers) == 2:
            tokenizers.append(None)
        return cls(transformer, vae, encoders, tokenizers, scheduler, max_sequence_length=max_sequence_length)

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        size = self.transformer.config.sample_size * self.vae_scale
        return size, size

    def check_size(self, height: int, width: int) -> None:
        step = self.vae_scale * self.transformer.config.patch_size
        require_pixel_multiple("SD3", step, height=height, width=width)

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler.sigmas.to(device=self.device, dtype=torch.float32)

    def _clip(self, index: int, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        encoder, tokenizer = self.text_encoders[index], self.tokenizers[index]
        ids = tokenizer(prompts, padding="max_length", max_length=CLIP_TOKENS, truncation=True,
                        return_tensors="pt").input_ids
        out = encoder(ids.to(encoder.device), output_hidden_states=True)
        return out.hidden_states[-2], out[0]  # penultimate layer, pooled projection

    def _t5(self, prompts: list[str], width: int) -> torch.Tensor:
        encoder, tokenizer = self.text_encoders[2], self.tokenizers[2]
        if encoder is None:
            return torch.zeros(len(prompts), self.max_sequence_length, width, device=self.device)
        ids = tokenizer(prompts, padding="max_length", max_length=self.max_sequence_length, truncation=True,
                        add_special_tokens=True, return_tensors="pt").input_ids
        return encoder(ids.to(encoder.device))[0]

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        if self.text_encoders[0] is None:
            raise RuntimeError("this SD3 model was loaded without its text encoders")
        prompts = list(prompts)
        (hidden_l, pooled_l), (hidden_g, pooled_g) = self._clip(0, prompts), self._clip(1, prompts)
        width = self.transformer.config.joint_attention_dim
        clip = torch.cat([hidden_l, hidden_g], dim=-1).float()
        clip = torch.nn.functional.pad(clip, (0, width - clip.shape[-1]))
        tokens = torch.cat([clip, self._t5(prompts, width).float()], dim=1)
        pooled = torch.cat([pooled_l, pooled_g], dim=-1).float()
        packed = torch.cat([tokens, torch.nn.functional.pad(pooled, (0, width - pooled.shape[-1]))[:, None]], dim=1)
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1, device=packed.device))

    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """sglang's SD3 cond kwargs: the joint CLIP+T5 tokens and `pooled_projections` [P] (unpadded). Its
        `encoder_hidden_states` goes out as a one-element list, which its clients iterate; a bare tensor reads too."""
        tokens = cond.embeds[0, :-1]
        pooled = cond.embeds[0, -1]
        return {"encoder_hidden_states": [tokens],
                "pooled_projections": pooled[: self.transformer.config.pooled_projection_dim]}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        tokens = wire_text_tokens(kwargs)
        pooled = kwargs.get("pooled_projections")
        if not isinstance(pooled, torch.Tensor) or pooled.dim() != 1 or pooled.shape[0] > tokens.shape[1]:
            raise ValueError("pooled_projections: expected a [P] tensor no wider than the text tokens")
        row = torch.nn.functional.pad(pooled.float(), (0, tokens.shape[1] - pooled.shape[0]))
        packed = torch.cat([tokens, row[None]])[None]
        return PromptEmbeds(packed, torch.zeros(packed.shape[1], 1)), torch.zeros(0, 1)

    def _unpack(self, embeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(text tokens [B, L, D], pooled [B, P]) from the packed conditioning."""
        return embeds[:, :-1], embeds[:, -1, : self.transformer.config.pooled_projection_dim]

    def prepare_latents(self, generators, height, width) -> Latents:
        self.check_size(height, width)
        shape = (len(generators), self.transformer.config.in_channels, height // self.vae_scale, width // self.vae_scale)
        # The transformer patchifies and positions the latents itself: no position ids to carry.
        return Latents(randn_per_sample(shape, generators, device=self.device), torch.zeros(0, 1, device=self.device))

    def velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        with rows_share_one_timestep(one_value_for_all_rows(sigma)):
            return self._velocity(transformer, latents, sigma, cond, uncond, guidance_scale)

    def _velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale) -> torch.Tensor:
        x = latents.tokens
        sigma = torch.as_tensor(sigma, device=x.device, dtype=torch.float32).expand(x.shape[0])
        dtype = next(transformer.parameters()).dtype
        if guidance_scale > 1.0:
            if uncond is None:
                raise ValueError("guidance_scale > 1 needs the unconditional (negative) conditioning")
            x, sigma, both = torch.cat([x, x]), torch.cat([sigma, sigma]), torch.cat([uncond.embeds, cond.embeds])
        else:
            both = cond.embeds
        text, pooled = self._unpack(both)
        with self.forward_precision():
            out = transformer(hidden_states=x.to(dtype), timestep=(sigma * self.timestep_scale).to(dtype),
                              encoder_hidden_states=text.to(dtype), pooled_projections=pooled.to(dtype),
                              return_dict=False)[0].float()
        if guidance_scale > 1.0:
            v_uncond, v_cond = out.chunk(2)
            return v_uncond + guidance_scale * (v_cond - v_uncond)
        return out

    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        config = self.vae.config
        latents = latents / config.scaling_factor + (config.shift_factor or 0.0)
        vae_dtype = next(self.vae.parameters()).dtype
        images = decode_rows(lambda rows: self.vae.decode(rows.to(vae_dtype), return_dict=False)[0], latents)
        return (images.float() / 2 + 0.5).clamp(0, 1)


# -------------------------------------------------------------------- random checkpoints
def _clip_tokenizer(path: Path):
    """A CLIP BPE tokenizer over lowercase letters (no merges), written to `path` and loaded from it."""
    from transformers import CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for code in range(97, 123):
        vocab[chr(code)] = len(vocab)
        vocab[chr(code) + "</w>"] = len(vocab)
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"), model_max_length=CLIP_TOKENS)


@dataclass
class SD3Sizes:
    """Component sizes of a random checkpoint. The defaults are tiny (tests); `medium()` is SD3.5-Medium's
    transformer and VAE (benchmarks), with shallow text encoders of the real widths: a prompt is encoded
    once per request, so their depth does not change what a benchmark of sampling and training measures."""

    transformer: dict = field(default_factory=lambda: dict(
        sample_size=16, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pos_embed_max_size=32))
    clip_widths: tuple[int, int] = (8, 16)
    clip_layers: tuple[int, int] = (2, 3)
    t5: dict = field(default_factory=lambda: dict(d_kv=8, d_ff=64, num_layers=1, num_heads=2))
    vae: dict = field(default_factory=lambda: dict(
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), latent_channels=4, norm_num_groups=4))

    @classmethod
    def medium(cls) -> SD3Sizes:
        """SD3.5-Medium: 24 MMDiT blocks of width 1536, dual attention in the first 13, QK RMSNorm."""
        return cls(
            transformer=dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                             attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                             caption_projection_dim=1536, pos_embed_max_size=384,
                             dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
            clip_widths=(768, 1280), clip_layers=(2, 2),
            t5=dict(d_kv=64, d_ff=2 * 4096, num_layers=1, num_heads=64),
            vae=dict(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                     block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=16,
                     norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False))


def save_random_checkpoint(path: str | Path, sizes: SD3Sizes | None = None, *, seed: int = 0, with_t5: bool = True,
                           device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """An SD3 checkpoint in diffusers layout with random weights and tokenizers made in code (no download),
    built on `device` and stored in `dtype`."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from diffrl.models.demo import build_word_tokenizer

    sizes = sizes or SD3Sizes()
    path = Path(path)
    torch.manual_seed(seed)
    width = sizes.transformer["joint_attention_dim"]

    def save(module, folder: str) -> None:
        module.to(dtype).save_pretrained(path / folder, safe_serialization=True)

    with torch.device(device):
        for index, (encoder_dir, tokenizer_dir) in enumerate(
                zip(("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"))):
            tokenizer = _clip_tokenizer(path / tokenizer_dir)
            tokenizer.save_pretrained(path / tokenizer_dir)
            hidden = sizes.clip_widths[index]
            save(CLIPTextModelWithProjection(CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                num_hidden_layers=sizes.clip_layers[index], num_attention_heads=2, max_position_embeddings=CLIP_TOKENS,
                projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=1)), encoder_dir)
        if with_t5:
            t5_tokenizer = build_word_tokenizer("a an the red blue green cat dog circle square of on".split(), 256)
            t5_tokenizer.save_pretrained(path / "tokenizer_3")
            save(T5EncoderModel(T5Config(vocab_size=len(t5_tokenizer), d_model=width, decoder_start_token_id=0,
                                         pad_token_id=0, **sizes.t5)), "text_encoder_3")
        save(SD3Transformer2DModel(pooled_projection_dim=sum(sizes.clip_widths), **sizes.transformer), "transformer")
        save(AutoencoderKL(in_channels=3, out_channels=3, scaling_factor=1.5305, shift_factor=0.0609, **sizes.vae),
             "vae")
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_pretrained(path / "scheduler")
    return path
