"""The `wan2_2` family: Wan2.2 text-to-video (diffusers' `WanPipeline`), and Wan2.1-style checkpoints with a
single transformer.

A checkpoint is a local diffusers-format directory: `model_index.json` (its `boundary_ratio`), `transformer/`
(`WanTransformer3DModel`, the high-noise expert), optionally `transformer_2/` (the low-noise expert),
`vae/` (`AutoencoderKLWan`), `text_encoder/` (`UMT5EncoderModel`), `tokenizer/`, `scheduler/`.

What this adapter reproduces of `WanPipeline` (`tests/test_wan2_2.py`, ODE sampling from the same noise):
- conditioning: the prompt cleaned as the pipeline cleans it, tokenized to `max_sequence_length` (512),
  the encoder's last hidden state kept over the prompt's own tokens and zero beyond them;
- latents `[B, C, (F − 1)/4 + 1, H/8, W/8]` (the VAE's temporal and spatial factors), decoded as
  `latents · std + mean` per channel, frames in [0, 1];
- the schedule is the scheduler's own (`set_timesteps(N)`), the transformer's timestep the scheduler's: σ·1000
  (truncated to an integer for UniPC, whose timesteps are integers);
- the expert switch: a step whose timestep is at or above `boundary_ratio × num_train_timesteps` runs
  `transformer` with `guidance_scale`, a step below it `transformer_2` with `guidance_scale_2` (unset:
  `guidance_scale`); without `boundary_ratio` every step runs `transformer` (a `transformer_2` on disk is
  then not loaded, as the pipeline never calls it). CFG runs when `guidance_scale > 1`, for both experts,
  as in the pipeline: `uncond + s·(cond − uncond)` with the step's expert's scale (the engine refuses a
  `guidance_scale_2 > 1` with `guidance_scale ≤ 1`, which the pipeline would ignore).

How the two experts are trained: `family.transformer` is `WanExperts`, one module holding both, whose
forward sends each row to the expert its timestep selects. The trainer passes it to `velocity` like any
family's transformer, so engine and trainer run one forward; LoRA targets, `block_lists` (FSDP units,
compilation) and gradient checkpointing cover both experts; a LoRA checkpoint holds each expert's PEFT adapter
(`lora/transformer/`, `lora/transformer_2/`, for WanPipeline's modules of those names) and a full finetune each
expert in diffusers layout.
Sharded by FSDP2 (torchrun), every forward runs both experts on every rank (one row for an expert none
of the rank's rows need), so ranks whose micro-batches route differently issue the same collectives.

Image-to-video (Wan2.2 A14B I2V: a model index naming `WanImageToVideoPipeline`, without `expand_timesteps`, its
transformer without an image encoder's `image_dim`) takes one condition image per request (`image_path`), as
`WanImageToVideoPipeline` does: the image resized to the video's size (Lanczos), followed by `num_frames − 1` black
frames, VAE-encoded (the mode), normalized per channel, after a 4-channel mask marking the first frame (the
pipeline's `condition`); each forward concatenates it to the noisy latents on the channel axis (the transformer's
`in_channels` = noise + mask + image latents). The condition depends on the output's size, so the engine encodes it
per request at that size (`condition_images_need_size`) and it travels inside the conditioning (rows after the text
tokens, `diffrl.models.condition_rows`), for the trainer and replay to read unchanged.

Wan2.2 TI2V-5B (a model index with `expand_timesteps`, one expert) samples text to video as `WanPipeline` does and,
given one condition image, image to video as `WanImageToVideoPipeline(expand_timesteps=True)` does: the image alone,
resized and VAE-encoded, replaces the first latent frame of every forward's input, whose tokens get timestep 0 (the
others the step's); the output's first frame is the image's latents. Our state's first frame is steered there: its
velocity is `(x − c) / σ` (the x0 it predicts is the image's latents `c`), so the last ODE step lands on `c`, to
rounding, and the model's own output for those tokens, which the pipeline discards, is not used.

Wan2.1 image-to-video (a `WanImageToVideoPipeline` checkpoint with `image_encoder/` and `image_processor/`, its
transformer with `image_dim`, one expert) conditions as A14B I2V does and also on the source's CLIP embeddings: the
image as given through the CLIP image processor, the vision model's penultimate hidden states `[1, 257, 1280]`,
which the transformer puts before the 512 text tokens (its attention reads the image tokens as all but the last
512). They travel flattened after the condition's values in the same rows.

Not reproduced: the solver. Our steps are the shared Euler ODE / SDE of `diffrl.sampling`; a checkpoint
whose scheduler is UniPC (as Wan's published ones) gets UniPC's flow σ's with our steps.
"""

from __future__ import annotations

import contextlib
import copy
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers.loaders.peft import PeftAdapterMixin
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from torch.distributed.fsdp import FSDPModule

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    register_family,
    require_frame_multiple,
    require_pixel_multiple,
    wire_text_tokens,
)
from diffrl.models.batch_invariance import embed_rows_one_at_a_time
from diffrl.models.condition_rows import pack_image_rows, unpack_image_rows
from diffrl.models.components import read_flow_scheduler, scheduler_sigmas
from diffrl.models.vae_latents import decode_images, latent_noise
from diffrl.models.weights import load_weights
from diffrl.utils.offload import FrozenOffload

SCHEDULERS = ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")


@dataclass
class WanSettings:
    """What the checkpoint's model_index.json and scheduler config decide: the expert switch and the scheduler."""

    boundary_ratio: float | None  # None: one expert (Wan2.1-style, or a transformer_2 the pipeline never calls)
    scheduler_class: str
    image_to_video: bool = False  # WanImageToVideoPipeline (A14B I2V): the first frame's latents as extra channels
    ti2v: bool = False  # expand_timesteps (TI2V-5B): an optional first frame replaces the first latent frame
    image_embeds: bool = False  # Wan2.1 I2V: also the image's CLIP embeddings, as image tokens before the text


class ExpertOffload:
    """Each expert's frozen weights (its parameters that take no gradient, and its buffers) in pinned host memory, on
    the device only while a forward needs them (`--offload-idle-expert`): Wan2.2 A14B's steps run one 14 B expert at a
    time, so the other's 28.6 GB (bf16) wait on the host. An expert leaves only when a forward asks for the other and no
    forward is using it (threads of one engine may denoise batches on both sides of the boundary at once); a trained
    adapter's parameters never move. The copy in costs one expert's bytes over PCIe; nothing is copied back."""

    def __init__(self, experts: Sequence[torch.nn.Module], device: torch.device):
        self.device = torch.device(device)
        self.offloads = {id(e): FrozenOffload([e], frozen_only=True) for e in experts}
        self.users = dict.fromkeys(self.offloads, 0)
        self._lock = threading.Lock()
        self.visits = 0  # copies in so far (what the switches cost)

    @contextlib.contextmanager
    def resident(self, experts: Sequence[torch.nn.Module]):
        needed = {id(e) for e in experts}
        with self._lock:
            for key, offload in self.offloads.items():  # the idle ones out first: at most one expert's bytes extra
                if key not in needed and offload.visiting is not None and self.users[key] == 0:
                    offload.leave()
            for key in needed:
                if self.offloads[key].visiting is None:
                    self.offloads[key].visit(self.device)
                    self.visits += 1
                self.users[key] += 1
        try:
            yield
        finally:
            with self._lock:
                for key in needed:
                    self.users[key] -= 1


class WanExperts(PeftAdapterMixin, torch.nn.Module):
    """Wan2.2's experts as one module: rows whose timestep is ≥ `boundary_timestep` go to `transformer`
    (high noise), the others to `transformer_2` (low noise). With one expert (Wan2.1, or no boundary)
    every row goes to `transformer`. Takes and returns what `WanTransformer3DModel` does."""

    def __init__(self, transformer: torch.nn.Module, transformer_2: torch.nn.Module | None = None,
                 boundary_timestep: float | None = None):
        super().__init__()
        if (transformer_2 is None) != (boundary_timestep is None):
            raise ValueError("a second expert needs a boundary timestep, and a boundary needs a second expert")
        self.transformer = transformer
        self.transformer_2 = transformer_2
        self.boundary_timestep = boundary_timestep
        self.expert_offload: ExpertOffload | None = None  # --offload-idle-expert

    @property
    def experts(self) -> list[torch.nn.Module]:
        return [self.transformer] + ([self.transformer_2] if self.transformer_2 is not None else [])

    @property
    def dtype(self) -> torch.dtype:
        """The experts' weights' dtype, as diffusers reads it (their `_keep_in_fp32_modules` are fp32 in any dtype)."""
        return self.transformer.dtype

    @property
    def expert_blocks(self) -> torch.nn.ModuleList:
        """Both experts' blocks, in order (the family's `block_lists`); not registered, so names stay the experts'."""
        return torch.nn.ModuleList([block for expert in self.experts for block in expert.blocks])

    def high_noise(self, timestep: torch.Tensor) -> torch.Tensor:
        """Per row: whether `transformer` (rather than `transformer_2`) denoises it, as WanPipeline decides."""
        if self.boundary_timestep is None:
            return torch.ones(timestep.shape, dtype=torch.bool, device=timestep.device)
        return timestep >= self.boundary_timestep

    def enable_gradient_checkpointing(self, gradient_checkpointing_func=None) -> None:
        for expert in self.experts:
            expert.enable_gradient_checkpointing(gradient_checkpointing_func=gradient_checkpointing_func)

    def forward(self, hidden_states, timestep, encoder_hidden_states, return_dict: bool = False, **kwargs):
        out = self._route(hidden_states, timestep, encoder_hidden_states, **kwargs)
        return Transformer2DModelOutput(sample=out) if return_dict else (out,)

    def _route(self, hidden_states, timestep, encoder_hidden_states, **kwargs) -> torch.Tensor:
        def run(expert, rows):
            per_row = {k: v[rows] for k, v in kwargs.items() if k == "encoder_hidden_states_image" and v is not None}
            return expert(hidden_states[rows], timestep[rows], encoder_hidden_states[rows], return_dict=False,
                          **{**kwargs, **per_row})[0]

        everything = slice(None)
        if self.transformer_2 is None:
            return run(self.transformer, everything)
        high = self.high_noise(timestep)
        if not isinstance(self, FSDPModule):  # one expert for the whole batch (every engine step): no split
            if bool(high.all()):
                with self._resident([self.transformer]):
                    return run(self.transformer, everything)
            if not bool(high.any()):
                with self._resident([self.transformer_2]):
                    return run(self.transformer_2, everything)
        with self._resident(self.experts):
            return self._route_rows(run, high, hidden_states)

    def _resident(self, experts: Sequence[torch.nn.Module]):
        """The experts' weights on the device for the block (`ExpertOffload`; a no-op without it)."""
        return contextlib.nullcontext() if self.expert_offload is None else self.expert_offload.resident(experts)

    def _route_rows(self, run, high: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # Each row to its expert (a training micro-batch mixes steps). Sharded by FSDP2 under torchrun, every
        # expert runs on every rank, on one row when none of this rank's is its: ranks whose micro-batches
        # route differently still gather (forward) and reduce (backward) the same units, in the same order.
        out, idle = None, 0.0
        for expert, rows in ((self.transformer, high), (self.transformer_2, ~high)):
            index = rows.nonzero().squeeze(1)
            if len(index) == 0:
                idle = idle + 0.0 * run(expert, slice(0, 1)).sum()  # in the graph, with zero gradients
                continue
            part = run(expert, index)
            if out is None:
                out = part.new_empty((hidden_states.shape[0], *part.shape[1:]))
            out[index] = part
        return out + idle


def _run_per_sample_layers_row_by_row(transformer: WanExperts) -> None:
    """Sample k bit-identical in any batch, on CPU (docs/architecture.md, "Rollout contract"): the timestep MLP and
    its projection to the blocks' modulations are Wan's only matmuls whose row count is the batch size (the blocks
    add the modulation to a table, without a matmul); in each expert they run one distinct row at a time."""
    for expert in transformer.experts:
        embedder = expert.condition_embedder
        embed_rows_one_at_a_time(embedder.time_embedder)
        embed_rows_one_at_a_time(embedder.time_proj)  # its rows are the time embedding's: shared within a step


@register_family
class Wan22Family(FamilyAdapter):
    name = "wan2_2"
    name_patterns = ("wan2.2", "wan2_2", "wan2.1", "wan2_1", "wan")
    display_name = "Wan"
    generates_video = True
    default_num_frames = 81  # WanPipeline's defaults: 81 frames of 480 × 832
    default_guidance_scale = 5.0
    timestep_scale = 1000.0
    # Self- and cross-attention projections of every block (of both experts: the names match in each).
    lora_target_modules = ("attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
                           "attn2.to_q", "attn2.to_k", "attn2.to_v", "attn2.to_out.0")
    block_lists = ("expert_blocks",)
    lora_components = ("transformer", "transformer_2")  # a LoRA checkpoint: one PEFT adapter per expert
    components = (
        Component("transformer", "diffusers:WanTransformer3DModel"),
        Component("vae", "diffusers:AutoencoderKLWan"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
        Component("text_encoder", "transformers:UMT5EncoderModel", text_encoder=True),
    )
    model_index_required = True

    def __init__(self, transformer: WanExperts, vae, text_encoder, tokenizer, scheduler, *,
                 boundary_ratio: float | None = None, max_sequence_length: int = 512, image_to_video: bool = False,
                 ti2v: bool = False):
        self.adopt_components(transformer, _run_per_sample_layers_row_by_row, vae=vae, text_encoder=text_encoder,
                              tokenizer=tokenizer, scheduler=scheduler)
        self.image_to_video, self.ti2v = image_to_video, ti2v
        self.image_encoder = self.image_processor = None  # Wan2.1 I2V's CLIP vision model (`set_image_encoder`)
        self.image_embed_shape: tuple[int, int] | None = None
        self.accepts_image_conditioning = self.condition_images_need_size = image_to_video or ti2v
        self.requires_image_conditioning = image_to_video
        self.max_condition_images = 1 if self.accepts_image_conditioning else 0
        self.boundary_ratio = boundary_ratio
        self.max_sequence_length = max_sequence_length
        self.uses_guidance_scale_2 = transformer.transformer_2 is not None
        # sglang-diffusion's defaults: Wan2.2 A14B (two experts) 40 steps; one expert (TI2V 5B, Wan2.1) 50.
        self.default_num_inference_steps = 40 if self.uses_guidance_scale_2 else 50
        self.timestep_scale = float(scheduler.config.num_train_timesteps)
        self.integer_timesteps = type(scheduler).__name__ == "UniPCMultistepScheduler"  # as the pipeline's t
        self.vae_scale_temporal = vae.config.scale_factor_temporal
        self.vae_scale_spatial = vae.config.scale_factor_spatial

    @property
    def device(self) -> torch.device:
        """The compute device; with the experts' weights on the host between forwards, the one they visit."""
        offload = self.transformer.expert_offload
        return offload.device if offload is not None else super().device

    def offload_idle_expert(self, device: torch.device) -> int:
        experts = self.transformer
        if experts.transformer_2 is None:
            return super().offload_idle_expert(device)
        if experts.expert_offload is None:
            experts.expert_offload = ExpertOffload(experts.experts, device)
        return sum(o.nbytes for o in experts.expert_offload.offloads.values())

    @property
    def expert_config(self):
        """The (high-noise) expert's config: both experts of a checkpoint share the latent layout."""
        return self.transformer.transformer.config

    def reference_pipeline(self, with_image: bool = True):
        """diffusers' `WanPipeline` (image-to-video: `WanImageToVideoPipeline`; TI2V: that one, or `WanPipeline` for
        text to video without `with_image`) over this family's own components (no copy), for tests and benchmarks."""
        from diffusers import WanImageToVideoPipeline, WanPipeline

        image = self.image_to_video or (self.ti2v and with_image)
        extra = {"expand_timesteps": True} if self.ti2v else {}
        pipe = (WanImageToVideoPipeline if image else WanPipeline)(
            tokenizer=self.tokenizer, text_encoder=self.text_encoder, vae=self.vae, scheduler=self.scheduler,
            transformer=self.transformer.transformer, transformer_2=self.transformer.transformer_2,
            boundary_ratio=self.boundary_ratio, **extra,
            **({"image_encoder": self.image_encoder, "image_processor": self.image_processor} if image else {}))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- load
    @classmethod
    def read_settings(cls, root: Path, index: dict) -> WanSettings:
        pipeline = index.get("_class_name", "WanPipeline")
        if pipeline not in ("WanPipeline", "WanImageToVideoPipeline"):
            raise ModelLoadError(f"wan2_2: {root} is a {pipeline} checkpoint (another conditioned mode), which this "
                                 "adapter does not sample; it samples WanPipeline and WanImageToVideoPipeline")
        ti2v = bool(index.get("expand_timesteps"))
        if ti2v and index.get("boundary_ratio") is not None:
            raise ModelLoadError(f"wan2_2: {root} is a TI2V checkpoint (expand_timesteps: per-token timesteps) with "
                                 "two experts, which this adapter does not reproduce (TI2V-5B has one)")
        image_to_video = pipeline == "WanImageToVideoPipeline" and not ti2v
        image_embeds = False
        if image_to_video or ti2v:
            import json

            config = root / "transformer" / "config.json"
            image_dim = json.loads(config.read_text()).get("image_dim") if config.is_file() else None
            if image_dim is not None and (ti2v or index.get("boundary_ratio") is not None):
                raise ModelLoadError(f"wan2_2: {config} sets image_dim={image_dim} in a "
                                     f"{'TI2V' if ti2v else 'two-expert'} checkpoint, which no Wan pipeline samples "
                                     "(CLIP image embeddings are Wan2.1 image-to-video's, one expert)")
            image_embeds = image_dim is not None
        scheduler_name, _ = read_flow_scheduler("wan2_2", root, SCHEDULERS, pipeline)
        return WanSettings(index.get("boundary_ratio"), scheduler_name, image_to_video, ti2v, image_embeds)

    @classmethod
    def checkpoint_components(cls, settings: WanSettings) -> list[Component]:
        """The scheduler of the checkpoint's class, and the low-noise expert when the pipeline switches to it
        (optional here, so that a missing one is named by `from_components`, after the other components)."""
        table = [c if c.folder != "scheduler" else Component("scheduler", f"diffusers:{settings.scheduler_class}",
                                                                kind="scheduler") for c in cls.components]
        if settings.boundary_ratio is not None:
            table.append(Component("transformer_2", "diffusers:WanTransformer3DModel", optional=True))
        if settings.image_embeds:  # Wan2.1 I2V: the image's CLIP embeddings condition every block
            table += [Component("image_encoder", "transformers:CLIPVisionModel"),
                      Component("image_processor", "transformers:CLIPImageProcessor", kind="tokenizer",
                                config_file="preprocessor_config.json")]
        return table

    @classmethod
    def from_components(cls, root, parts, settings: WanSettings, *, max_sequence_length: int = 512) -> Wan22Family:
        scheduler, boundary_ratio = parts["scheduler"], settings.boundary_ratio
        if boundary_ratio is not None and parts["transformer_2"] is None:
            raise ModelLoadError(f"wan2_2: {root / 'model_index.json'} sets boundary_ratio={boundary_ratio} but "
                                 f"there is no {root / 'transformer_2' / 'config.json'} (the low-noise expert)")
        boundary = None if boundary_ratio is None else boundary_ratio * scheduler.config.num_train_timesteps
        if settings.image_to_video:  # the noise, the first-frame mask and the image's latents on the channel axis
            vae_config, config = parts["vae"].config, parts["transformer"].config
            expected = 2 * vae_config.z_dim + vae_config.scale_factor_temporal
            if config.in_channels != expected:
                raise ModelLoadError(f"wan2_2: {root} is a WanImageToVideoPipeline checkpoint but its transformer has "
                                     f"in_channels={config.in_channels}; image-to-video takes {expected} (the VAE's "
                                     f"{vae_config.z_dim} latent channels twice and a "
                                     f"{vae_config.scale_factor_temporal}-channel first-frame mask)")
        if settings.image_embeds and max_sequence_length != 512:
            raise ModelLoadError("wan2_2: Wan2.1 image-to-video reads its image tokens as all but the last 512 of "
                                 f"the conditioning (diffusers' WanAttnProcessor), so the text window is 512, not "
                                 f"{max_sequence_length}")
        experts = WanExperts(parts["transformer"], parts.get("transformer_2"), boundary)
        family = cls(experts, parts["vae"], parts["text_encoder"], parts["tokenizer"], scheduler,
                     boundary_ratio=boundary_ratio, max_sequence_length=max_sequence_length,
                     image_to_video=settings.image_to_video, ti2v=settings.ti2v)
        if settings.image_embeds:
            family.set_image_encoder(parts["image_encoder"], parts["image_processor"])
        return family

    def set_image_encoder(self, image_encoder, image_processor) -> None:
        """Wan2.1 image-to-video: the CLIP vision model whose penultimate hidden states (`[1, T, D]`, T its patches
        and the class token) condition every block beside the text, as `WanImageToVideoPipeline.encode_image`."""
        config = image_encoder.config
        self.image_encoder, self.image_processor = image_encoder, image_processor
        self.image_embed_shape = ((config.image_size // config.patch_size) ** 2 + 1, config.hidden_size)

    def save(self, path: str | Path) -> None:
        """Each expert in diffusers layout (`transformer/`, `transformer_2/`), what a full finetune changes."""
        for folder, expert in zip(("transformer", "transformer_2"), self.transformer.experts):
            expert.save_pretrained(Path(path) / folder, safe_serialization=True, max_shard_size="1000GB")

    def load_saved_transformer(self, model_dir: Path) -> None:
        for folder, expert in zip(("transformer", "transformer_2"), self.transformer.experts):
            load_weights(expert, Path(model_dir) / folder / "diffusion_pytorch_model.safetensors")

    # ---------------------------------------------------------------- the family's conventions
    def default_size(self) -> tuple[int, int]:
        return 480, 832

    def _latent_frames(self, num_frames: int | None) -> int:
        return ((self.default_num_frames if num_frames is None else num_frames) - 1) // self.vae_scale_temporal + 1

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        _, p_h, p_w = self.expert_config.patch_size
        # WanPipeline asks for multiples of 16 and of the VAE's factor × the patch (it rounds down; we refuse).
        for name, value, patch in (("height", height, p_h), ("width", width, p_w)):
            step = math.lcm(16, self.vae_scale_spatial * patch)
            require_pixel_multiple("Wan", step, **{name: value})
            if value // (self.vae_scale_spatial * patch) > self.expert_config.rope_max_seq_len:
                raise RequestError(name, f"{name}={value}: more patches than the model's rotary table "
                                         f"({self.expert_config.rope_max_seq_len})")
        if num_frames is not None:
            require_frame_multiple("Wan", self.vae_scale_temporal, num_frames)
            latent, p_t = self._latent_frames(num_frames), self.expert_config.patch_size[0]
            if latent % p_t or latent // p_t > self.expert_config.rope_max_seq_len:
                raise RequestError("num_frames", f"num_frames={num_frames}: {latent} latent frames do not fit the "
                                                 f"temporal patch {p_t} and the rotary table")

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler_sigmas("wan2_2", scheduler, num_steps, self.device)

    @torch.no_grad()
    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """sglang's Wan cond kwargs: the T5 tokens (zero past the prompt) as a one-element list; no positions.
        Image-to-video: the packed condition rows as diffrl's `condition_rows` [R, D] (unpacked by the forward)."""
        length = self.max_sequence_length
        wire = {"encoder_hidden_states": [cond.embeds[0, :length]]}
        if cond.embeds.shape[1] > length:
            wire["condition_rows"] = cond.embeds[0, length:]
        return wire

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        tokens = wire_text_tokens(kwargs)
        rows = kwargs.get("condition_rows")
        if rows is not None:
            if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != tokens.shape[1]:
                raise ValueError("condition_rows: expected [R, D] rows as wide as the text tokens")
            tokens = torch.cat([tokens, rows.float()])
        return PromptEmbeds(tokens[None], torch.zeros(tokens.shape[0], 1)), torch.zeros(0, 1)

    # ---------------------------------------------------------------- image-to-video
    @torch.no_grad()
    def encode_condition_images(self, images, height: int | None = None, width: int | None = None,
                                num_frames: int | None = None) -> torch.Tensor:
        """Image-to-video: the pipeline's `condition` `[1, 4 + C, F', H', W']` (the first-frame mask, then the latents
        of the image resized to `height × width` followed by `num_frames − 1` black frames), as
        `WanImageToVideoPipeline.prepare_latents` makes it."""
        if not self.accepts_image_conditioning or len(images) != 1:
            raise RequestError("image_path", f"this Wan checkpoint takes {self.max_condition_images} condition "
                                             f"images, got {len(images)}")
        if height is None or width is None:
            height, width = self.default_size()
        num_frames = self.default_num_frames if num_frames is None else num_frames
        image = source = images[0]
        if (height, width) != tuple(image.shape[1:]):  # the pipeline's video processor: PIL, Lanczos
            import numpy as np
            from PIL import Image

            pil = Image.fromarray(image.permute(1, 2, 0).numpy()).resize((width, height), Image.Resampling.LANCZOS)
            image = torch.from_numpy(np.asarray(pil).copy()).permute(2, 0, 1)
        pixels = (image.float() / 255 * 2 - 1)[None, :, None]  # the image processor's arithmetic; [1, 3, 1, H, W]
        video = pixels if self.ti2v else torch.cat([pixels, pixels.new_zeros(1, 3, num_frames - 1, height, width)], 2)
        vae_dtype = next(self.vae.parameters()).dtype
        latents = self.vae.encode(video.to(self.device, vae_dtype)).latent_dist.mode().float()
        config = self.vae.config
        shape = (1, config.z_dim, 1, 1, 1)
        mean = torch.tensor(config.latents_mean, device=latents.device).view(shape)
        inv_std = 1.0 / torch.tensor(config.latents_std, device=latents.device).view(shape)
        latents = (latents - mean) * inv_std
        if self.ti2v:  # TI2V: the first frame's latents alone [1, C, 1, H', W']
            return latents
        t = self.vae_scale_temporal
        mask = torch.zeros(1, t, latents.shape[2], latents.shape[3], latents.shape[4], device=latents.device)
        mask[:, :, 0] = 1  # the first frame (repeated t times, as the pipeline's mask) is given, the rest generated
        condition = torch.cat([mask, latents], dim=1)
        if self.image_encoder is None:
            return condition
        # Wan2.1: the source as given (the processor resizes it itself), flattened after the condition's values.
        return torch.cat([condition.flatten(), self._clip_embeds(source).flatten()])[None]

    def _clip_embeds(self, image: torch.Tensor) -> torch.Tensor:
        """`WanImageToVideoPipeline.encode_image` of one uint8 image `[3, H, W]`: the CLIP vision model's penultimate
        hidden states `[1, T, D]`, fp32."""
        from PIL import Image

        pil = Image.fromarray(image.permute(1, 2, 0).numpy())
        pixels = self.image_processor(images=pil, return_tensors="pt").pixel_values
        encoder_dtype = next(self.image_encoder.parameters()).dtype
        out = self.image_encoder(pixel_values=pixels.to(self.image_encoder.device, encoder_dtype),
                                 output_hidden_states=True)
        return out.hidden_states[-2].float()

    def condition_on_images(self, cond: PromptEmbeds, encoded: torch.Tensor) -> PromptEmbeds:
        """Image-to-video: the condition's values laid into rows after the text tokens (`pack_image_rows`), with an
        id per row, so that the engine batches only conditionings of one layout (TI2V: with an image or without)."""
        rows = pack_image_rows(encoded.reshape(1, 1, -1).to(cond.embeds), cond.embeds.shape[-1])
        return PromptEmbeds(torch.cat([cond.embeds, rows.expand(len(cond), -1, -1)], dim=1),
                            torch.cat([cond.ids, cond.ids.new_zeros(rows.shape[1], cond.ids.shape[1])]))

    def unpack_conditioning(self, cond: PromptEmbeds, latents: torch.Tensor) -> tuple[torch.Tensor,
                                                                                     torch.Tensor | None,
                                                                                     torch.Tensor | None]:
        """(text tokens `[B, L, D]`, the image-to-video condition `[B, 4 + C, F', H', W']` for latents
        `[B, C, F', H', W']` or None without one, Wan2.1's CLIP image embeddings `[B, T, D']` or None)."""
        length = self.max_sequence_length
        text = cond.embeds[:, :length]
        if not self.accepts_image_conditioning or (self.ti2v and cond.embeds.shape[1] <= length):
            return text, None, None  # TI2V without an image: text to video
        if cond.embeds.shape[1] <= length:
            raise RequestError("image_path", "this Wan image-to-video checkpoint needs one condition image")
        _, channels, *grid = latents.shape
        if self.ti2v:  # the first frame's latents
            grid[0] = 1
        count = (channels if self.ti2v else self.vae_scale_temporal + channels) * math.prod(grid)
        extra = 0 if self.image_embed_shape is None else math.prod(self.image_embed_shape)
        values = unpack_image_rows(cond.embeds[:, length:], 1, count + extra)[:, 0]
        condition = values[:, :count].reshape(len(values), -1, *grid)
        if self.image_embed_shape is None:
            return text, condition, None
        return text, condition, values[:, count:].reshape(len(values), *self.image_embed_shape)

    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        # The pipeline's own text cleaning.
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if self.text_encoder is None:
            raise RuntimeError("this Wan model was loaded without its text encoder")
        length = self.max_sequence_length
        tokens = self.tokenizer([prompt_clean(p) for p in prompts], padding="max_length", max_length=length,
                                truncation=True, add_special_tokens=True, return_attention_mask=True,
                                return_tensors="pt")
        device = self.text_encoder.device
        hidden = self.text_encoder(tokens.input_ids.to(device), tokens.attention_mask.to(device)).last_hidden_state
        # The first `seq_len` tokens (the prompt's own: as many as the mask marks) kept, the rest zero.
        seq_lens = tokens.attention_mask.gt(0).sum(dim=1).to(device)
        keep = torch.arange(length, device=device)[None] < seq_lens[:, None]
        embeds = torch.where(keep[..., None], hidden, torch.zeros_like(hidden)).float()
        return PromptEmbeds(embeds, torch.zeros(length, 1, device=embeds.device))

    def prepare_latents(self, generators, height, width, num_frames: int | None = None) -> Latents:
        self.check_size(height, width, self.default_num_frames if num_frames is None else num_frames)
        channels = self.vae.config.z_dim if self.image_to_video else self.expert_config.in_channels
        shape = (channels, self._latent_frames(num_frames),
                 height // self.vae_scale_spatial, width // self.vae_scale_spatial)
        return latent_noise(generators, shape, self.device)

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        dtype = transformer.dtype  # not the first parameter's: Wan keeps some modules in fp32
        # WanPipeline's timestep: the scheduler's (σ·num_train_timesteps; an integer for UniPC) in fp32, whatever the
        # weights' dtype.
        text, condition, image_embeds = self.unpack_conditioning(cond, latents.tokens)
        hidden, timestep = latents.tokens, self.model_timesteps(sigma)
        if condition is not None and self.ti2v:  # TI2V: the image's latents as the first frame, at timestep 0
            return self._run_ti2v(transformer, hidden, sigma, timestep, text, condition.to(hidden))
        if condition is not None:  # image-to-video: the condition after the noise on the channel axis
            hidden = torch.cat([hidden, condition.to(hidden)], dim=1)
        extra = {} if image_embeds is None else {"encoder_hidden_states_image": image_embeds.to(dtype)}
        with self.forward_precision():
            return transformer(hidden_states=hidden.to(dtype), timestep=timestep,
                               encoder_hidden_states=text.to(dtype), return_dict=False, **extra)[0].float()

    def _run_ti2v(self, transformer, latents, sigma, timestep, text, condition) -> torch.Tensor:
        """`WanImageToVideoPipeline(expand_timesteps=True)`'s forward: the first latent frame replaced by the image's
        latents, per-token timesteps (0 over the first frame's tokens); the first frame's velocity steers our state to
        the image's latents (module docstring)."""
        dtype = transformer.dtype
        hidden = torch.cat([condition.expand(len(latents), -1, -1, -1, -1), latents[:, :, 1:]], dim=2)
        _, p_h, p_w = self.expert_config.patch_size
        frames, height, width = latents.shape[2], latents.shape[3] // p_h, latents.shape[4] // p_w
        given = torch.ones(frames, height, width, device=latents.device)
        given[0] = 0
        per_token = timestep[:, None] * given.flatten()[None]  # the pipeline's mask · t, token by token
        with self.forward_precision():
            out = transformer(hidden_states=hidden.to(dtype), timestep=per_token,
                              encoder_hidden_states=text.to(dtype), return_dict=False)[0].float()
        first = (latents[:, :, :1] - condition) / sigma.clamp_min(1e-6).view(-1, 1, 1, 1, 1)  # σ > 0 when sampling
        return torch.cat([first, out[:, :, 1:]], dim=2)

    def combine_guidance(self, v_uncond, v_cond, guidance_scale, *, transformer, sigma,
                         guidance_scale_2: float | None = None) -> torch.Tensor:
        """As the pipeline: CFG for both experts (or for neither), each with its own scale."""
        scale_2 = guidance_scale if guidance_scale_2 is None else guidance_scale_2
        high = transformer.high_noise(self.model_timesteps(sigma))
        if bool(high.all()):
            scale = guidance_scale
        elif not bool(high.any()):
            scale = scale_2
        else:  # a training micro-batch with rows of both experts
            scale = torch.where(high, guidance_scale, scale_2).to(v_cond.dtype).view(-1, *[1] * (v_cond.dim() - 1))
        return v_uncond + scale * (v_cond - v_uncond)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        return decode_wan_latents(self.vae, latents, per_call=self.vae_decode_batch)


def decode_wan_latents(vae, latents: torch.Tensor, per_call: int | None = None) -> torch.Tensor:
    """Latents `[B, C, F', H', W']` normalized per channel → videos `[B, 3, F, H, W]` in [0, 1] through an
    AutoencoderKLWan (Wan2.2's VAE, also Cosmos3's), rows per call as `decode_rows` says (`per_call`: the family's
    `vae_decode_batch`), with the pipelines' arithmetic."""
    config = vae.config
    shape = (1, config.z_dim, 1, 1, 1)
    mean = torch.tensor(config.latents_mean, device=latents.device).view(shape)
    inv_std = 1.0 / torch.tensor(config.latents_std, device=latents.device).view(shape)
    latents = latents / inv_std + mean  # the pipeline's arithmetic, to the rounding
    return decode_images(vae, latents, per_call=per_call)
