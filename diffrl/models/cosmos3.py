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
- CFG as the pipeline combines it, `uncond + s·(cond − uncond)` (the base class's `combine_guidance`), the
  negative prompt's pass its own forward.

Prompts become text only once the video's size is known (its sentences name the size and duration), which the
engine's `encode_prompts` is not told. So a conditioning row holds the prompt's UTF-8 bytes (zero-padded, one per
token slot: `pads_text`), and `run_transformer` turns it into token ids for the size its latents have (cached;
the negative prompt's rows are marked by `pair_conditionings`). The
duration is read back from the latent frame count, so a request's `num_frames` must be 4k + 1 (the pipeline
would take any); the frame rate is the pipeline's default, 24.

The transformer's forward takes one sample (its attention has no batch axis), so where it runs whole (a full
finetune's forwards with gradients) the rows of a batch run one after another. Elsewhere, on a GPU, the rows that
share a prompt (the outputs of a request, the requests the engine batches together) run as one batch through the
video pathway below, a batch axis the transformer lacks: one forward of B × ~390 tokens instead of B launch-bound
ones, with the batch-size-dependent kernel roundings of every other family (docs/architecture.md, "Rollout contract").
On the CPU they run one after another, so sample k is the same in any microgroup exactly (`batch_rows` sets it).

The text pathway is computed once per prompt, not once per forward (`TextPathwayCache`): the text tokens attend
causally to text only, so their hidden states, and the keys and values the video tokens read from them in every
layer, depend on neither the latents nor the timestep. Forwards run the transformer's layers on the video tokens
alone against those keys and values, the same operations on the same numbers as the full forward's video half:
rollouts, and the trainer's forwards while no text-pathway weight is trained (LoRA on the video pathway, the
default targets; its gradient checkpointing per layer as the transformer's). A full finetune's forwards with
gradients run the transformer whole. At one frame of 480 × 832 a forward is ~390
video tokens and ~80 text tokens: launch-bound on a GPU, where the text half is about half of the kernels. The cache is keyed by the text and by the identity and version counter of every
text-pathway parameter, so a weight update in place (an optimizer step, a weight sync) or new tensors miss it.

Not reproduced: the solver. Our steps are the shared Euler ODE / SDE of `diffrl.sampling`; a checkpoint whose
scheduler is UniPC (as published ones) gets UniPC's flow σ's with our steps. Refused by name: image- and
video-conditioned requests (the engine refuses their fields), distilled checkpoints (few-step students with CFG
baked in) and a scheduler with dynamic shifting. Sound and action generation are not reachable from a request.
"""

from __future__ import annotations

import copy
import functools
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from diffrl.errors import ModelLoadError
from diffrl.models.base import (
    Component,
    FamilyAdapter,
    Latents,
    PromptEmbeds,
    read_json,
    register_family,
    require_frame_multiple,
    require_pixel_multiple,
)
from diffrl.models.compile import batch_dynamic
from diffrl.models.components import (
    checkpoint_root,
    load_components,
    read_flow_scheduler,
    read_model_index,
    refuse_another_familys,
    scheduler_sigmas,
)
from diffrl.models.vae_latents import latent_noise
from diffrl.models.wan2_2 import decode_wan_latents

SCHEDULERS = ("FlowMatchEulerDiscreteScheduler", "UniPCMultistepScheduler")
FPS = 24.0  # the pipeline's default frame rate: it enters the prompt's duration sentence and the rotary positions
SYSTEM_PROMPTS = {  # the pipeline's system messages (their wording is what the model was trained with)
    "image": "You are a helpful assistant who will generate images from a give prompt.",
    "video": "You are a helpful assistant who will generate videos from a give prompt.",
}
# Packed sequences kept per (prompt, role, latent grid, device): a request's rows share one, steps reuse it.
SEQUENCE_CACHE_SIZE = 256
# Text pathways kept (`TextPathwayCache`): each holds a key and a value per layer for the text tokens (at the
# default size, 36 layers × 2 × 8 heads × 128 × ~80 tokens in bf16: ~12 MB).
TEXT_CACHE_SIZE = 32


@dataclass
class Cosmos3Settings:
    """What the checkpoint decides: its scheduler class, the pipeline's prompt and schedule options
    (model_index.json) and the VAE's factors (vae/config.json)."""

    scheduler_class: str
    use_system_prompt: bool = True
    native_flow_schedule: bool = False
    vae_scale_spatial: int = 8
    vae_scale_temporal: int = 4


@dataclass
class GuidancePair(PromptEmbeds):
    """Both CFG halves in one conditioning, the negative prompt's rows first: the pipeline writes the negative
    prompt's metadata sentences negated, so the rows must say which they are."""

    negative_rows: int = 0


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
    display_name = "Cosmos3"
    generates_video = True
    default_num_frames = 189  # the pipeline's defaults: 189 frames (7.9 s at 24 FPS) of 720 × 1280, CFG 6
    frame_rate = FPS
    default_guidance_scale = 6.0
    default_num_inference_steps = 35  # diffusers' Cosmos3 pipeline default (sglang-diffusion has no Cosmos3)
    timestep_scale = 1000.0
    pads_text = True  # conditioning rows are zero-padded bytes
    one_sample_per_forward = True  # the attention has no batch axis (see the module docstring)
    # The generation pathway's attention projections: the understanding pathway is also the model's reasoner
    # (a VLM), which these leave as it is.
    lora_target_modules = ("self_attn.add_q_proj", "self_attn.add_k_proj", "self_attn.add_v_proj",
                           "self_attn.to_add_out")
    block_lists = ("layers",)
    components = (
        Component("transformer", "diffusers:Cosmos3OmniTransformer"),
        Component("vae", "diffusers:AutoencoderKLWan"),
        Component("scheduler", "diffusers:FlowMatchEulerDiscreteScheduler", kind="scheduler"),
        Component("text_tokenizer", "transformers:AutoTokenizer", kind="tokenizer"),
    )
    model_index_required = True
    # Whether rollout forwards run the samples of one prompt as one batch through the video pathway (see the module
    # docstring); None: on a GPU, not on the CPU.
    batch_rows: bool | None = None

    def __init__(self, transformer, vae, scheduler, text_tokenizer, *, settings: Cosmos3Settings):
        self.transformer = transformer
        self.vae = vae
        self.scheduler = scheduler
        self.tokenizer = text_tokenizer
        self.settings = settings
        self.vae_scale_spatial = settings.vae_scale_spatial
        self.vae_scale_temporal = settings.vae_scale_temporal
        self.config = transformer.config
        _keep_vision_tokens_in_the_weights_dtype(transformer)
        self.timestep_scale = float(scheduler.config.num_train_timesteps)
        self.integer_timesteps = type(scheduler).__name__ == "UniPCMultistepScheduler"
        self._special = [text_tokenizer.eos_token_id, text_tokenizer.convert_tokens_to_ids("<|vision_start|>")]
        self._sequences: dict[tuple, dict] = {}
        self._sequences_lock = threading.Lock()
        self._texts: tuple[torch.Tensor, list[bytes]] | None = None  # the last conditioning decoded, and its rows
        self._last_pair: tuple[torch.Tensor, torch.Tensor, GuidancePair] | None = None
        self.text_cache = TextPathwayCache()
        self.video_layer = _video_layer  # the video pathway's per-layer step; compiled by `compile`

    def compile(self, *, mode: str | None = None, eager_numerics: bool = True, dynamic: bool = False) -> int:
        """The layers (the transformer's whole forward: under FSDP2, a full finetune, adapters on the text pathway)
        and the video pathway's per-layer step, which bypasses the layers' calls: one graph serves every layer, as
        one compiled block does (their parameters are graph inputs). The text pathway runs once per prompt and
        weights, eager."""
        count = super().compile(mode=mode, eager_numerics=eager_numerics, dynamic=dynamic)
        self.video_layer = torch.compile(_video_layer, mode=None if mode == "default" else mode)
        if dynamic:
            self.video_layer = batch_dynamic(self.video_layer)
        return count

    def compiled_units(self) -> dict[str, list]:
        """A layer kind ran compiled through its own forward or through the compiled video pathway step."""
        units = super().compiled_units()
        if self.video_layer is not _video_layer:
            for codes in units.values():
                codes.append(_video_layer.__code__)
        return units

    def reference_pipeline(self):
        """diffusers' `Cosmos3OmniPipeline` over this family's own components (no copy, no safety checker), for
        tests and benchmarks."""
        from diffusers.pipelines.cosmos.pipeline_cosmos3_omni import Cosmos3OmniPipeline

        if self.vae is None:
            raise RuntimeError("this Cosmos3 model was loaded without its VAE")
        pipe = Cosmos3OmniPipeline(transformer=self.transformer, text_tokenizer=self.tokenizer, vae=self.vae,
                                   scheduler=self.scheduler, enable_safety_checker=False,
                                   default_use_system_prompt=self.settings.use_system_prompt,
                                   use_native_flow_schedule=self.settings.native_flow_schedule)
        pipe.set_progress_bar_config(disable=True)
        return pipe

    # ---------------------------------------------------------------- load
    @classmethod
    def load(cls, model_path, *, device="cpu", dtype=torch.float32, load_text_encoder=True,
             load_vae: bool = True) -> Cosmos3Family:
        """The base class's load, less the VAE with `load_vae=False` (training needs the transformer, tokenizer
        and scheduler only). `load_text_encoder` changes nothing: the transformer reads the tokens itself."""
        root = checkpoint_root(model_path)
        refuse_another_familys(root, cls.name, cls.display_name, cls.components)
        settings = cls.read_settings(root, read_model_index(root, required=True))
        table = [c for c in cls.checkpoint_components(settings) if load_vae or c.folder != "vae"]
        parts = load_components(root, table, label=cls.display_name, device=device, dtype=dtype,
                                load_text_encoder=load_text_encoder)
        return cls.from_components(root, parts, settings)

    @classmethod
    def read_settings(cls, root: Path, index: dict) -> Cosmos3Settings:
        _refuse_distilled(root, index)
        scheduler_name, _ = read_flow_scheduler("cosmos3", root, SCHEDULERS, "Cosmos3OmniPipeline")
        vae_config = read_json(root / "vae" / "config.json")  # its factors size the latents, with or without it
        return Cosmos3Settings(scheduler_name, use_system_prompt=bool(index.get("default_use_system_prompt", True)),
                               native_flow_schedule=bool(index.get("use_native_flow_schedule", False)),
                               vae_scale_spatial=int(vae_config.get("scale_factor_spatial", 8)),
                               vae_scale_temporal=int(vae_config.get("scale_factor_temporal", 4)))

    @classmethod
    def checkpoint_components(cls, settings: Cosmos3Settings) -> list[Component]:
        """The table with the checkpoint's own scheduler class."""
        return [c if c.folder != "scheduler" else Component("scheduler", f"diffusers:{settings.scheduler_class}",
                                                            kind="scheduler") for c in cls.components]

    @classmethod
    def from_components(cls, root, parts, settings: Cosmos3Settings) -> Cosmos3Family:
        tokenizer = parts["text_tokenizer"]
        if tokenizer.convert_tokens_to_ids("<|vision_start|>") in (None, tokenizer.unk_token_id) \
                or tokenizer.eos_token_id is None or tokenizer.chat_template is None:
            raise ModelLoadError(f"cosmos3: the tokenizer in {root / 'text_tokenizer'} needs a chat template, an "
                                 "end-of-text token and <|vision_start|>")
        return cls(parts["transformer"], parts.get("vae"), parts["scheduler"], tokenizer, settings=settings)

    # ---------------------------------------------------------------- sizes and schedule
    def default_size(self) -> tuple[int, int]:
        return 720, 1280

    def check_size(self, height: int, width: int, num_frames: int | None = None) -> None:
        require_pixel_multiple("Cosmos3", self.vae_scale_spatial, height=height, width=width)
        if num_frames is not None:
            require_frame_multiple("Cosmos3", self.vae_scale_temporal, num_frames, note="; 1 is an image")

    def sigmas(self, num_steps: int, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        scheduler = copy.deepcopy(self.scheduler)  # set_timesteps changes the scheduler's state
        if self.settings.native_flow_schedule:  # the pipeline's option: linear σ's from 1 − 1/T, then shifted
            train_steps = scheduler.config.num_train_timesteps
            scheduler.set_timesteps(num_steps, device="cpu",
                                    sigmas=np.linspace(1.0 - 1.0 / train_steps, 0.0, num_steps + 1)[:-1])
        else:
            scheduler.set_timesteps(num_steps, device="cpu")
        return scheduler_sigmas("cosmos3", scheduler, num_steps, self.device)

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
        messages = [{"role": "system", "content": SYSTEM_PROMPTS[kind]}] if self.settings.use_system_prompt else []
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
        num_frames = self.default_num_frames if num_frames is None else num_frames
        self.check_size(height, width, num_frames)
        shape = (self.config.latent_channel, (num_frames - 1) // self.vae_scale_temporal + 1,
                 height // self.vae_scale_spatial, width // self.vae_scale_spatial)
        return latent_noise(generators, shape, self.device)

    def pair_conditionings(self, uncond: PromptEmbeds, cond: PromptEmbeds) -> GuidancePair:
        """Both halves as one conditioning (zero padding to the longer is harmless), the negative rows marked.
        `run_transformer` still runs one forward per row, as the pipeline's two passes; `combine_guidance`
        (the base class's) combines them as the pipeline does."""
        last = self._last_pair  # a denoising loop pairs the same two tensors at every step
        if last is not None and last[0] is uncond.embeds and last[1] is cond.embeds:
            return last[2]
        length = max(uncond.embeds.shape[1], cond.embeds.shape[1])

        def padded(e: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(e, (0, 0, 0, length - e.shape[1]))

        pair = GuidancePair(torch.cat([padded(uncond.embeds), padded(cond.embeds)]),
                            cond.ids.new_zeros(length, cond.ids.shape[1]), negative_rows=len(uncond))
        self._last_pair = (uncond.embeds, cond.embeds, pair)  # holding the tensors keeps their identity
        return pair

    def split_pair(self, both: GuidancePair, rows: int) -> tuple[GuidancePair, GuidancePair]:
        negative, positive = super().split_pair(both, rows)
        return replace(negative, negative_rows=rows), replace(positive, negative_rows=0)

    def _row_texts(self, embeds: torch.Tensor) -> list[bytes]:
        """Each conditioning row's prompt bytes, remembered for the last tensor decoded: decoding reads the
        rows back to the host, a sync that would stall a GPU's kernel queue once per forward."""
        last = self._texts
        if last is not None and last[0] is embeds:
            return last[1]
        texts = [prompt_bytes(row) for row in embeds.detach().cpu()]  # one copy for every row
        self._texts = (embeds, texts)  # holding the tensor keeps its identity from being reused
        return texts

    def run_transformer(self, transformer, latents, sigma, cond) -> torch.Tensor:
        x = latents.tokens
        t = self.model_timesteps(sigma)
        negative_rows = cond.negative_rows if isinstance(cond, GuidancePair) else 0
        _, _, frames, latent_h, latent_w = x.shape
        grid = (frames, latent_h * self.vae_scale_spatial, latent_w * self.vae_scale_spatial)
        dtype = next(transformer.parameters()).dtype
        texts = self._row_texts(cond.embeds)
        rows: list[torch.Tensor | None] = [None] * x.shape[0]
        samples: dict[tuple[bytes, bool], list[int]] = {}  # the rows of each prompt, in order
        for b in range(x.shape[0]):
            samples.setdefault((texts[b], b < negative_rows), []).append(b)
        together = self.batch_rows if self.batch_rows is not None else x.device.type != "cpu"
        for (text_bytes, negative), indices in samples.items():
            packed = self._sequence(text_bytes, negative, grid, x.device)
            with self.forward_precision():
                key = self.text_cache.key(transformer, (text_bytes, negative, grid, str(x.device)),
                                          self.attention_backend)
                if key is None:  # the transformer's own forward, one sample at a time
                    for b in indices:
                        timesteps = t[b].expand(packed["vision_sequence_indexes"].shape[0])  # one per video token
                        rows[b] = transformer(vision_tokens=[x[b : b + 1].to(dtype)], vision_timesteps=timesteps,
                                              return_dict=False, **packed)[0][0].float()
                    continue
                text = self.text_cache.get(key, transformer, lambda: text_pathway(transformer, packed))
                for part in [indices] if together else [[b] for b in indices]:
                    out = video_pathway(transformer, packed, text, x[part].to(dtype), t[part],
                                        layer_step=self.video_layer).float()
                    for i, b in enumerate(part):
                        rows[b] = out[i : i + 1]
        return torch.cat(rows)

    def decode(self, latents: torch.Tensor, height: int, width: int, num_frames: int | None = None) -> torch.Tensor:
        if self.vae is None:
            raise RuntimeError("this Cosmos3 model was loaded without its VAE (load_vae=False)")
        return decode_wan_latents(self.vae, latents, per_call=self.vae_decode_batch)


def _keep_vision_tokens_in_the_weights_dtype(transformer) -> None:
    """Under bf16 autocast over fp32 weights (a full finetune's masters), `proj_in` returns bf16 tokens while the
    packed sequence they are written into and the timestep embeddings added to them stay fp32, a mix the
    transformer's scatter refuses: its output goes back to the weights' dtype (a no-op without autocast)."""
    if _to_weights_dtype not in transformer.proj_in._forward_hooks.values():
        transformer.proj_in.register_forward_hook(_to_weights_dtype)


def _to_weights_dtype(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    return output.to(module.weight.dtype)


def _refuse_distilled(root: Path, index: dict) -> None:
    """Distilled students sample on a fixed few-step schedule with CFG baked in, which this adapter does not run.
    diffusers marks them in the model index or in the modular pipeline's index."""
    configs = {root / "model_index.json": index}
    modular = root / "modular_model_index.json"
    if modular.is_file():
        configs[modular] = read_json(modular)
    for path, config in configs.items():
        if config.get("is_distilled") or config.get("distilled_sigmas"):
            raise ModelLoadError(f"cosmos3: {path} describes a distilled checkpoint (a fixed few-step schedule with "
                                 "CFG in its weights), which this adapter does not sample")


# ---------------------------------------------------------------------------------------------- text pathway
@dataclass
class TextPathway:
    """What the video tokens read from the text tokens in every layer (rotary embedding applied to the keys),
    and the rotary tables of the video tokens."""

    keys: list[torch.Tensor]  # per layer [text tokens, key heads, head dim]
    values: list[torch.Tensor]
    cos: torch.Tensor  # [video tokens, head dim]
    sin: torch.Tensor


class TextPathwayCache:
    """Text pathways by prompt, sequence and weights (see the module docstring). Thread-safe."""

    def __init__(self, size: int = TEXT_CACHE_SIZE):
        self.size = size
        self._entries: dict[tuple, tuple[weakref.ref, TextPathway]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(transformer, sequence: tuple, attention_backend: str) -> tuple | None:
        """The entry's key, or None where the cache does not apply and the transformer runs whole: a transformer
        that is not diffusers' own layout (context-parallel, another attention processor), whose layers are
        FSDP2 units (which act where a layer is called, which the pathways bypass), or whose text pathway has
        adapters (their scale and switch are not parameters a key can see). Compiled layers keep the cache: with
        --compile the video pathway runs a compiled step of its own (`Cosmos3Family.compile`)."""
        from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor

        if transformer._cp_shard_fn is not None or transformer._cp_gather_fn is not None:
            return None
        state = _weights_state(transformer.embed_tokens)
        for layer in transformer.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(attn.processor) is not Cosmos3AttnProcessor or type(layer) is not _decoder_layer_class():
                return None
            linears = [attn.to_q, attn.to_k, attn.to_v, attn.to_out, mlp.up_proj, mlp.down_proj]
            if mlp.hidden_act == "silu":
                linears.append(mlp.gate_proj)
            if any(type(m) is not torch.nn.Linear for m in linears):  # an adapter wraps it
                return None
            for module in (*linears, layer.input_layernorm, layer.post_attention_layernorm, attn.norm_q, attn.norm_k,
                           attn.k_norm_und_for_gen):
                if module is not None:
                    state += _weights_state(module)
        if torch.is_grad_enabled() and any(trained for *_, trained in state):
            return None  # a full finetune: the text pathway's gradients need the forward whole
        device_type = transformer.embed_tokens.weight.device.type  # (ModelMixin.device walks every module)
        autocast = (torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        return (id(transformer), sequence, attention_backend, autocast, tuple(state))

    def get(self, key: tuple, transformer, build) -> TextPathway:
        """The entry for `key` (made by `key(transformer, ...)`), built by `build()` when missing. An entry also
        remembers its transformer, weakly: a new transformer at a freed one's address is not served its text."""
        with self._lock:
            hit = self._entries.get(key)
        if hit is not None and hit[0]() is transformer:
            return hit[1]
        entry = build()
        with self._lock:
            if len(self._entries) >= self.size:
                self._entries.clear()
            self._entries[key] = (weakref.ref(transformer), entry)
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()


@functools.cache
def _decoder_layer_class() -> type:
    """diffusers' decoder layer class (FSDP2 swaps a sharded layer's class for a subclass of it)."""
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3VLTextMoTDecoderLayer

    return Cosmos3VLTextMoTDecoderLayer


def _weights_state(module: torch.nn.Module) -> list:
    """Identity, version counter (moved by every in-place update) and storage of a module's own parameters."""
    if module._modules:
        raise ValueError(f"cosmos3: {type(module).__name__} has submodules; the text cache reads leaf modules")
    return [(id(p), p._version, p.data_ptr(), p.requires_grad) for p in module._parameters.values() if p is not None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    from diffusers.models.transformers.transformer_cosmos3 import _rotate_half

    return x * cos + _rotate_half(x) * sin


@torch.no_grad()
def text_pathway(transformer, packed: dict) -> TextPathway:
    """The text half of `Cosmos3OmniTransformer.forward` and of its attention processor, keeping each layer's
    keys and values for the video tokens (the text tokens fill the sequence's first `und_len` places)."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    und_len = packed["und_len"]  # `_sequence` puts the text tokens first
    hidden = transformer.embed_tokens(packed["input_ids"])
    position_ids = packed["position_ids"]
    cos, sin = transformer.rotary_emb(
        position_ids=position_ids.unsqueeze(0) if position_ids.ndim == 1 else position_ids.unsqueeze(1),
        device=hidden.device, dtype=hidden.dtype)
    cos, sin = cos.squeeze(0), sin.squeeze(0)
    cos_und, sin_und = cos[:und_len].unsqueeze(1), sin[:und_len].unsqueeze(1)
    keys, values = [], []
    last = len(transformer.layers) - 1
    for i, layer in enumerate(transformer.layers):
        attn = layer.self_attn
        normed = layer.input_layernorm(hidden)
        q = attn.norm_q(attn.to_q(normed).view(-1, attn.num_attention_heads, attn.head_dim))
        k = attn.norm_k(attn.to_k(normed).view(-1, attn.num_key_value_heads, attn.head_dim))
        v = attn.to_v(normed).view(-1, attn.num_key_value_heads, attn.head_dim)
        k_for_video = attn.k_norm_und_for_gen(k) if attn.k_norm_und_for_gen is not None else k
        keys.append(_rotate(k_for_video, cos_und, sin_und))
        values.append(v)
        if i == last:  # the last layer's text outputs feed nothing the video tokens read
            break
        q, k = _rotate(q, cos_und, sin_und), _rotate(k, cos_und, sin_und)
        processor = attn.processor
        out = dispatch_attention_fn(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), is_causal=True, enable_gqa=True,
                                    backend=processor._attention_backend,
                                    parallel_config=processor._parallel_config)
        hidden = hidden + attn.to_out(out.squeeze(0).flatten(-2, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return TextPathway(keys, values, cos[und_len:], sin[und_len:])


def video_pathway(transformer, packed: dict, text: TextPathway, latents: torch.Tensor,
                  timesteps: torch.Tensor, layer_step=None) -> torch.Tensor:
    """`Cosmos3OmniTransformer.forward`'s video velocity `[B, C, T, H, W]` for B samples of one prompt (latents
    `[B, C, T, H, W]`, timesteps `[B]`), the layers run on the video tokens alone against the text's keys and values
    (`text_pathway`), with the samples on a batch axis (one sample: the forward's own operations). `layer_step`:
    `_video_layer` (the default) or its compiled form."""
    layer_step = layer_step or _video_layer
    und_len = packed["und_len"]
    batch, tokens = latents.shape[0], packed["vision_sequence_indexes"].shape[0]
    if packed["sequence_length"] != und_len + tokens:
        raise ValueError("cosmos3: the video pathway expects the video tokens right after the text")
    token_shapes = packed["vision_token_shapes"] * batch
    noisy_frames = packed["vision_noisy_frame_indexes"] * batch
    target_dtype = transformer.embed_tokens.weight.dtype
    packed_tokens, shapes = transformer._patchify_and_pack_latents(list(latents.split(1)))
    packed_tokens = transformer.proj_in(packed_tokens)
    time_dtype = next(transformer.time_embedder.parameters()).dtype
    per_token = timesteps.repeat_interleave(tokens)  # one per video token, as the forward takes them
    embeds = transformer.time_embedder(transformer.time_proj(per_token * transformer.config.timestep_scale)
                                       .to(time_dtype)).to(target_dtype)
    packed_tokens = transformer._apply_timestep_embeds_to_noisy_tokens(
        packed_tokens=packed_tokens, packed_timestep_embeds=embeds, noisy_frame_indexes=noisy_frames,
        token_shapes=token_shapes)
    hidden = packed_tokens.to(target_dtype).view(batch, tokens, -1)  # the forward's sequence has this dtype
    cos, sin = text.cos.unsqueeze(1), text.sin.unsqueeze(1)
    checkpointed = torch.is_grad_enabled() and transformer.gradient_checkpointing
    for layer, key, value in zip(transformer.layers, text.keys, text.values, strict=True):
        if checkpointed:  # as the transformer's own forward: each layer's activations recomputed in the backward
            hidden = transformer._gradient_checkpointing_func(layer_step, layer, hidden, key, value, cos, sin)
        else:
            hidden = layer_step(layer, hidden, key, value, cos, sin)
    preds = transformer.proj_out(transformer.norm_moe_gen(hidden)).flatten(0, 1)
    return torch.cat(transformer._unpatchify_and_unpack_latents(
        preds, token_shapes_vision=token_shapes, noisy_frame_indexes_vision=noisy_frames,
        original_latent_shapes=shapes))


def _video_layer(layer, hidden: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """One decoder layer's video half (its attention processor's and its own), on `[B, tokens, width]`."""
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    batch, tokens, _ = hidden.shape
    attn = layer.self_attn
    heads, kv_heads, head_dim = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    normed = layer.input_layernorm_moe_gen(hidden)
    q = attn.norm_added_q(attn.add_q_proj(normed).view(batch, tokens, heads, head_dim))
    k = attn.norm_added_k(attn.add_k_proj(normed).view(batch, tokens, kv_heads, head_dim))
    v = attn.add_v_proj(normed).view(batch, tokens, kv_heads, head_dim)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    keys = torch.cat([key.expand(batch, *key.shape), k], dim=1)
    values = torch.cat([value.expand(batch, *value.shape), v], dim=1)
    processor = attn.processor
    out = dispatch_attention_fn(q, keys, values, is_causal=False, enable_gqa=True,
                                backend=processor._attention_backend, parallel_config=processor._parallel_config)
    hidden = hidden + attn.to_add_out(out.flatten(-2, -1))
    hidden = hidden + layer.mlp_moe_gen(layer.post_attention_layernorm_moe_gen(hidden))
    return hidden
