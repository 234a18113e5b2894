"""The `cosmos3` family: NVIDIA Cosmos 3 text-to-video (and text-to-image) generation, as diffusers'
`Cosmos3OmniPipeline` runs it.

A checkpoint is a local diffusers-format directory: `model_index.json`, `transformer/` (`Cosmos3OmniTransformer`),
`vae/` (`AutoencoderKLWan`), `text_tokenizer/` (a chat-template tokenizer), `scheduler/`. There is no text
encoder: the transformer is a Mixture-of-Transformers whose causal "understanding" pathway embeds the prompt's
token ids itself, and whose "generation" pathway denoises the video tokens while attending to the text.

What this adapter reproduces of the pipeline's text-to-video mode (`tests/test_cosmos3.py`, ODE sampling from the
same noise):
- the prompt text: the duration and resolution sentences appended to the prompt (their negated forms to the
  negative prompt), a system message, the tokenizer's chat template, then the end-of-text and vision-start tokens;
- one packed sequence per forward: the text tokens, then the video's patch tokens, with 3-D multimodal rotary
  positions (diffusers' own helpers build them) and one timestep per video token;
- latents `[B, C, (F − 1)/4 + 1, H/16, W/16]` (the VAE's factors), decoded as `latents · std + mean` per channel;
- the schedule: the scheduler's own `set_timesteps(N)` (or the pipeline's "native" linear flow σ's when the
  checkpoint asks for them); the transformer's timestep is the scheduler's, σ·num_train_timesteps (integer for
  UniPC, whose timesteps are integers);
- CFG as the pipeline combines it, `uncond + s·(cond − uncond)`, each pass its own forward.

Prompts become text only once the video's size is known (its sentences name the size and duration), which the
engine's `encode_prompts` is not told. So a conditioning row holds the prompt's UTF-8 bytes (zero-padded, one per
token slot: `pads_text`), and `velocity` turns it into token ids for the size its latents have (cached). The
duration is read back from the latent frame count, so a request's `num_frames` must be 4k + 1 (the pipeline
would take any); the frame rate is the pipeline's default, 24.

The transformer's forward takes one sample (its attention has no batch axis), so `velocity` runs the rows of a
batch one after another: sample k's velocity does not depend on its batch, on any device.

Not reproduced: the solver. Our steps are the shared Euler ODE / SDE of `diffrl.sampling`; a checkpoint whose
scheduler is UniPC (as published ones) gets UniPC's flow σ's with our steps. Refused by name: image- and
video-conditioned requests (the engine refuses their fields), distilled checkpoints (few-step students with CFG
baked in) and a scheduler with dynamic shifting. Sound and action generation are not reachable from a request.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    read_json,
    require_pixel_multiple,
)
from diffrl.models.batch_invariance import decode_rows
from diffrl.models.registry import register_family
from diffrl.models.weights import require_finite_modules
from diffrl.sampling import randn_per_sample

SCHEDULERS = ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")
FPS = 24.0  # the pipeline's default frame rate: it enters the prompt's duration sentence and the rotary positions
SYSTEM_PROMPTS = {  # the pipeline's system messages (their wording is what the model was trained with)
    "image": "You are a helpful assistant who will generate images from a give prompt.",
    "video": "You are a helpful assistant who will generate videos from a give prompt.",
}
# Packed sequences kept per (prompt, role, latent grid, device): a request's rows share one, steps reuse it.
SEQUENCE_CACHE_SIZE = 256


def prompt_with_metadata(prompt: str, *, negative: bool, num_frames: int, height: int, width: int,
                         fps: float = FPS) -> str:
    """The user message the pipeline builds: the prompt, then a duration sentence (video only) and a resolution
    sentence, each negated for the negative prompt; a trailing full stop of the text before each is dropped."""
    kind = "image" if num_frames == 1 else "video"
    no = " not" if negative else ""
    sentences = [f"This {kind} is{no} of {height}x{width} resolution."]
    if kind == "video":
        sentences.insert(0, f"The video is{no} {num_frames / fps:.1f} seconds long and is{no} of {fps:.0f} FPS.")
    text = prompt
    for sentence in sentences:
        text = text.rstrip(".")
        text = f"{text}. {sentence}" if text else sentence
    return text


def prompt_bytes(row: torch.Tensor) -> bytes:
    """A conditioning row (`encode_prompts`) back to the prompt's UTF-8 bytes, without the zero padding."""
    values = row.detach().flatten().cpu()
    if not torch.equal(values, values.round()) or values.min() < 0 or values.max() > 255:
        raise ValueError("cosmos3 conditioning must hold a prompt's UTF-8 bytes (integers 0..255)")
    return bytes(values.to(torch.uint8).tolist()).rstrip(b"\0")


@register_family
class Cosmos3Family(FamilyAdapter):
    name = "cosmos3"
    name_patterns = ("cosmos3", "cosmos-3", "cosmos_3")
    generates_video = True
    default_num_frames = 189  # the pipeline's defaults: 189 frames (7.9 s at 24 FPS) of 720 × 1280, CFG 6
    default_guidance_scale = 6.0
    timestep_scale = 1000.0
    pads_text = True  # conditioning rows are zero-padded bytes
    # The generation pathway's attention projections: the understanding pathway is also the model's reasoner
    # (a VLM), which these leave as it is.
    lora_target_modules = ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj",
                           "self_attn.to_add_out")
    block_lists = ("layers",)

    def __init__(self, transformer, vae, tokenizer, scheduler, *, vae_scale_spatial: int, vae_scale_temporal: int,
                 use_system_prompt: bool = True, native_flow_schedule: bool = False):
        self.transformer = transformer
        self.vae = vae
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.vae_scale_spatial = vae_scale_spatial
        self.vae_scale_temporal = vae_scale_temporal
        self.use_system_prompt = use_system_prompt
        self.native_flow_schedule = native_flow_schedule
        self.config = transformer.config
        self.timestep_scale = float(scheduler.config.num_train_timesteps)
        self.integer_timesteps = type(scheduler).__name__ == "UniPCMultistepScheduler"
        self._special = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|vision_start|>")]
        self._sequences: dict[tuple, dict] = {}
        self._sequences_lock = threading.Lock()

    def reference_pipeline(self):
        """diffusers' `Cosmos3OmniPipeline` over this family's own components (no copy, no safety checker), for
        tests and benchmarks."""
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

        if self.vae is None:
            raise RuntimeError("this Cosmos3 model was loaded without its VAE")
        pipe = Cosmos3OmniPipeline(transformer=self.transformer, text_tokenizer=self.tokenizer, vae=self.vae,
                                   scheduler=self.scheduler, enable_safety_checker=False,
                                   default_use_system_prompt=self.use_system_prompt,
                                   use_native_flow_schedule=self.native_flow_schedule)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- load
    @classmethod
    def load(cls, model_path, *, device="cpu", dtype=torch.float32, load_text_encoder=True,
             load_vae: bool = True) -> Cosmos3Family:
        """`load_text_encoder` changes nothing (the transformer reads the tokens itself); `load_vae=False` loads
        what training needs (transformer, tokenizer, scheduler) and leaves decoding out."""
        import diffusers
        from diffusers import AutoencoderKLWan, Cosmos3OmniTransformer
        from transformers import AutoTokenizer

        root = Path(model_path)
        if not root.is_dir():
            raise ModelLoadError(f"model directory not found: {root}")
        index = read_json(root / "model_index.json")
        _refuse_distilled(root, index)
        read_json(root / "transformer" / "config.json")
        vae_config = read_json(root / "vae" / "config.json")
        scheduler_config = read_json(root / "scheduler" / "scheduler_config.json")
        scheduler_name = scheduler_config.get("_class_name")
        if scheduler_name not in SCHEDULERS:
            raise ModelLoadError(f"cosmos3: scheduler {scheduler_name!r} in {root / 'scheduler'}; supported: "
                                 f"{', '.join(SCHEDULERS)}")
        if scheduler_name == "UniPCMultistepScheduler" and not scheduler_config.get("use_flow_sigmas"):
            raise ModelLoadError("cosmos3: a UniPC scheduler without use_flow_sigmas has no flow-matching schedule")
        if scheduler_config.get("use_dynamic_shifting"):
            raise ModelLoadError("cosmos3: the scheduler uses dynamic shifting, which Cosmos3OmniPipeline does not "
                                 "set up")
        try:
            transformer = Cosmos3OmniTransformer.from_pretrained(root / "transformer", torch_dtype=dtype,
                                                                 local_files_only=True)
            vae = (AutoencoderKLWan.from_pretrained(root / "vae", torch_dtype=dtype, local_files_only=True)
                   if load_vae else None)
            scheduler = getattr(diffusers, scheduler_name).from_pretrained(root / "scheduler", local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(str(root / "text_tokenizer"), local_files_only=True)
        except (OSError, ValueError) as err:
            raise ModelLoadError(f"cannot load the Cosmos3 checkpoint {root}: {str(err).splitlines()[0]}") from None
        if tokenizer.convert_tokens_to_ids("<|vision_start|>") in (None, tokenizer.unk_token_id) \
                or tokenizer.eos_token_id is None or tokenizer.chat_template is None:
            raise ModelLoadError(f"cosmos3: the tokenizer in {root / 'text_tokenizer'} needs a chat template, an "
                                 "end-of-text token and <|vision_start|>")
        for module in (transformer, vae):
            if module is not None:
                module.to(device=device).eval().requires_grad_(False)
        require_finite_modules(root, {"transformer": transformer, "vae": vae})
        return cls(transformer, vae, tokenizer, scheduler,
                   vae_scale_spatial=int(vae_config.get("scale_factor_spatial", 8)),
                   vae_scale_temporal=int(vae_config.get("scale_factor_temporal", 4)),
                   use_system_prompt=bool(index.get("default_use_system_prompt", True)),
                   native_flow_schedule=bool(index.get("use_native_flow_schedule", False)))

    # ---------------------------------------------------------------- sizes and schedule
    def default_size(self) -> tuple[int, int]:
        return 720, 1280

    def _num_frames(self, num_frames: int | None) -> int:
        return self.default_num_frames if num_frames is None else num_frames

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        require_pixel_multiple("Cosmos3", self.vae_scale_spatial, height=height, width=width)
        if num_frames is not None:
            t = self.vae_scale_temporal
            if num_frames < 1 or (num_frames - 1) % t:
                raise RequestError("num_frames", f"num_frames={num_frames}: Cosmos3 needs {t}k + 1 frames (1, "
                                                 f"{t + 1}, {2 * t + 1}, …; 1 is an image)")

    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        if self.native_flow_schedule:  # the pipeline's option: linear σ's from 1 − 1/T, shifted by the scheduler
            train_steps = scheduler.config.num_train_timesteps
            scheduler.set_timesteps(num_steps, device="cpu",
                                    sigmas=np.linspace(1.0 - 1.0 / train_steps, 0.0, num_steps + 1)[:-1])
        else:
            scheduler.set_timesteps(num_steps, device="cpu")
        sigmas = scheduler.sigmas.to(device=self.device, dtype=torch.float32)
        if len(sigmas) != num_steps + 1 or float(sigmas[-1]) != 0.0:
            raise ValueError(f"cosmos3: the scheduler's schedule {sigmas.tolist()} does not end at σ = 0 after "
                             f"{num_steps} steps (final_sigmas_type must be 'zero')")
        return sigmas

    # ---------------------------------------------------------------- conditioning
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Each prompt's UTF-8 bytes `[B, L, 1]`, zero-padded to the longest (see the module docstring)."""
        rows = [p.encode("utf-8") for p in prompts]
        length = max([1, *(len(r) for r in rows)])
        embeds = torch.zeros(len(rows), length, 1)
        for i, row in enumerate(rows):
            embeds[i, : len(row), 0] = torch.tensor(list(row), dtype=torch.float32)
        return PromptEmbeds(embeds.to(self.device), torch.zeros(length, 1, device=self.device))

    def prompt_token_ids(self, prompt: str, *, negative: bool, num_frames: int, height: int, width: int) -> list[int]:
        """The token ids the pipeline gives this prompt (or negative prompt) for a video of this size."""
        kind = "image" if num_frames == 1 else "video"
        text = prompt_with_metadata(prompt, negative=negative, num_frames=num_frames, height=height, width=width)
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[kind]}] if self.use_system_prompt else []
        messages.append({"role": "user", "content": text})
        encoded = self.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                     add_vision_id=False, return_dict=True)
        return list(encoded["input_ids"]) + self._special

    def _sequence(self, text: bytes, negative: bool, grid: tuple[int, int, int], device: torch.device) -> dict:
        """The transformer's packing arguments for one sample: the text tokens first (causal), then every video
        patch token (all noisy), with their rotary positions."""
        key = (text, negative, grid, str(device))
        with self._sequences_lock:
            hit = self._sequences.get(key)
        if hit is not None:
            return hit
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import (
            get_3d_mrope_ids_text_tokens,
            get_3d_mrope_ids_vae_tokens,
        )

        frames, height, width = grid  # latent frames and pixels
        config, p = self.config, self.config.latent_patch_size
        num_frames = (frames - 1) * self.vae_scale_temporal + 1
        ids = self.prompt_token_ids(text.decode("utf-8"), negative=negative, num_frames=num_frames,
                                    height=height, width=width)
        text_len = len(ids)
        text_positions, next_offset = get_3d_mrope_ids_text_tokens(
            text_len, temporal_offset=0, use_float_positions=config.enable_fps_modulation)
        patches_h = -(-height // self.vae_scale_spatial // p)  # the transformer pads a latent side to the patch
        patches_w = -(-width // self.vae_scale_spatial // p)
        vision_offset = next_offset + config.unified_3d_mrope_temporal_modality_margin  # after the text, a gap
        vision_positions, _ = get_3d_mrope_ids_vae_tokens(
            frames, patches_h, patches_w, temporal_offset=vision_offset,
            reset_spatial_indices=config.unified_3d_mrope_reset_spatial_ids,
            fps=FPS if config.enable_fps_modulation else None, base_fps=float(config.base_fps),
            temporal_compression_factor=self.vae_scale_temporal)
        tokens = frames * patches_h * patches_w
        vision = torch.arange(text_len, text_len + tokens, device=device)
        packed = {
            "input_ids": torch.tensor(ids, dtype=torch.long, device=device),
            "text_indexes": torch.arange(text_len, device=device),
            "position_ids": torch.cat([text_positions, vision_positions], dim=1).to(device),
            "und_len": text_len,
            "sequence_length": text_len + tokens,
            "vision_token_shapes": [(frames, patches_h, patches_w)],
            "vision_sequence_indexes": vision,
            "vision_mse_loss_indexes": vision,
            "vision_noisy_frame_indexes": [torch.arange(frames, device=device)],
        }
        with self._sequences_lock:
            if len(self._sequences) >= SEQUENCE_CACHE_SIZE:
                self._sequences.clear()
            self._sequences[key] = packed
        return packed

    # ---------------------------------------------------------------- denoising
    def prepare_latents(self, generators, height, width, num_frames: int | None = None) -> Latents:
        num_frames = self._num_frames(num_frames)
        self.check_size(height, width, num_frames)
        shape = (len(generators), self.config.latent_channel, (num_frames - 1) // self.vae_scale_temporal + 1,
                 height // self.vae_scale_spatial, width // self.vae_scale_spatial)
        # The transformer patchifies and positions the latents itself: no position ids to carry.
        return Latents(randn_per_sample(shape, generators, device=self.device), torch.zeros(0, 1, device=self.device))

    def model_timesteps(self, sigma: torch.Tensor) -> torch.Tensor:
        """The scheduler's timestep for σ: σ·num_train_timesteps, truncated where the scheduler's are integers."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32)
        if self.integer_timesteps:
            return torch.floor(sigma.double() * self.timestep_scale).float()
        return sigma * self.timestep_scale

    def velocity(self, transformer, latents, sigma, cond, uncond, guidance_scale):
        x = latents.tokens
        t = self.model_timesteps(torch.as_tensor(sigma, device=x.device)).expand(x.shape[0])
        cfg = guidance_scale > 1.0
        if cfg and uncond is None:
            raise ValueError("guidance_scale > 1 needs the unconditional (negative) conditioning")
        _, _, frames, latent_h, latent_w = x.shape
        grid = (frames, latent_h * self.vae_scale_spatial, latent_w * self.vae_scale_spatial)
        rows = []
        for b in range(x.shape[0]):  # one sample per forward (see the module docstring)
            v = self._forward(transformer, x[b : b + 1], t[b], cond.embeds[b], False, grid)
            if cfg:  # as the pipeline: a second forward for the negative prompt, combined in fp32
                v_uncond = self._forward(transformer, x[b : b + 1], t[b], uncond.embeds[b], True, grid)
                v = v_uncond + guidance_scale * (v - v_uncond)
            rows.append(v)
        return torch.cat(rows)

    def _forward(self, transformer, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor, negative: bool,
                 grid: tuple[int, int, int]) -> torch.Tensor:
        """The transformer's velocity `[1, C, F, h, w]` for one sample `x` at model timestep `t`."""
        packed = self._sequence(prompt_bytes(text), negative, grid, x.device)
        dtype = next(transformer.parameters()).dtype
        timesteps = t.expand(packed["vision_sequence_indexes"].shape[0])  # one per video token
        with self.forward_precision():
            out = transformer(vision_tokens=[x.to(dtype)], vision_timesteps=timesteps, return_dict=False, **packed)
        return out[0][0].float()

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        if self.vae is None:
            raise RuntimeError("this Cosmos3 model was loaded without its VAE (load_vae=False)")
        config = self.vae.config
        vae_dtype = next(self.vae.parameters()).dtype
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, device=latents.device).view(shape)
        inv_std = 1.0 / torch.tensor(config.latents_std, device=latents.device).view(shape)
        latents = latents / inv_std + mean  # the pipeline's arithmetic, to the rounding
        videos = decode_rows(lambda rows: self.vae.decode(rows.to(vae_dtype), return_dict=False)[0], latents)
        return (videos.float() / 2 + 0.5).clamp(0, 1)  # [B, 3, F, H, W]


def _refuse_distilled(root: Path, index: dict) -> None:
    """Distilled students sample on a fixed few-step schedule with CFG baked in, which this adapter does not run."""
    for name in ("model_index.json", "modular_model_index.json"):
        config = index if name == "model_index.json" else None
        if config is None:
            if not (root / name).is_file():
                continue
            config = read_json(root / name)
        if config.get("is_distilled") or config.get("distilled_sigmas"):
            raise ModelLoadError(f"cosmos3: {root / name} describes a distilled checkpoint (a fixed few-step schedule "
                                 "with CFG in its weights), which this adapter does not sample")
