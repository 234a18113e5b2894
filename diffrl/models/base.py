"""What every model family provides: the adapter interface shared by the engine and the trainer.

A family adapter owns the loaded components of one checkpoint and knows the family's
conventions (prompt encoding, latent packing, position ids, timestep scaling, CFG, decoding).
`velocity` takes the transformer as an argument so the trainer can pass its own (LoRA-wrapped,
sharded) copy and still run exactly the code the engine runs.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.weights import load_weights


def read_json(path: Path) -> dict:
    """A checkpoint's JSON file (config, scheduler, model index), or a `ModelLoadError` naming the file."""
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"corrupt file: {path} ({err.__class__.__name__}: {err})") from None


@dataclass
class PromptEmbeds:
    """Text conditioning for a batch of prompts, as the family's transformer consumes it."""

    embeds: torch.Tensor  # [B, L, D]
    ids: torch.Tensor  # [L, n_axes] position ids, shared by the batch

    def __len__(self) -> int:
        return self.embeds.shape[0]

    def repeat(self, n: int) -> PromptEmbeds:
        """Each prompt's conditioning repeated n times in place (prompt-major), without re-encoding."""
        return replace(self, embeds=self.embeds.repeat_interleave(n, dim=0))

    def cat(self, other: PromptEmbeds) -> PromptEmbeds:
        """Stack two conditionings along the batch (CFG: uncond then cond in one forward)."""
        if not torch.equal(self.ids, other.ids):
            raise ValueError("cannot batch conditionings with different position ids")
        return replace(self, embeds=torch.cat([self.embeds, other.embeds]))

    def to(self, device: torch.device | str) -> PromptEmbeds:
        return PromptEmbeds(self.embeds.to(device), self.ids.to(device))


@dataclass
class Latents:
    """Packed noisy latents `[B, S, C]` and their position ids `[S, n_axes]`."""

    tokens: torch.Tensor
    ids: torch.Tensor


class FamilyAdapter(ABC):
    """One model family. Subclasses register themselves in `diffrl.models.registry`."""

    name: ClassVar[str]
    # Substrings matched (case-insensitively) against a checkpoint directory's name.
    name_patterns: ClassVar[tuple[str, ...]]
    # Text-to-image families refuse image-conditioned requests instead of ignoring them.
    accepts_image_conditioning: ClassVar[bool] = False
    # Guidance scale used when a request leaves it unset.
    default_guidance_scale: ClassVar[float] = 1.0
    # Model timestep = timestep_scale · σ (1 for families whose transformer takes σ itself).
    timestep_scale: ClassVar[float] = 1.0
    # Whether conditionings of different lengths may share a batch zero-padded at the end of the token
    # axis (the family derives its text mask from the conditioning itself and its text ids are all
    # zeros): the trainer then pads a rollout's prompts to the longest instead of refusing the mix.
    pads_text: ClassVar[bool] = False
    # Module names peft wraps when training a LoRA.
    lora_target_modules: ClassVar[tuple[str, ...]]
    # Attributes of the transformer holding its repeated blocks (each one an FSDP unit).
    block_lists: ClassVar[tuple[str, ...]]
    # Video families: `prepare_latents`, `check_size` and `decode` also take a keyword `num_frames` (None: the
    # family's `default_num_frames`) and `decode` returns `[B, C, F, H, W]`. Image families keep the signatures
    # below; the engine refuses `num_frames` other than 1 for them.
    generates_video: ClassVar[bool] = False
    default_num_frames: ClassVar[int] = 1
    # Whether requests may set `guidance_scale_2` (the CFG scale of a second, low-noise expert); `velocity`
    # then takes it as a keyword (None: the same as guidance_scale). A family may set it per checkpoint.
    uses_guidance_scale_2: bool = False
    # Whether the family's CFG is what sglang and diffusers call "true CFG" (`true_cfg_scale`): requests may then
    # set the scale as `true_cfg_scale` (it wins over `guidance_scale`); other families refuse the field.
    has_true_cfg: ClassVar[bool] = False

    transformer: torch.nn.Module
    # Mixed precision of the transformer forward (weights stay as loaded, e.g. fp32 masters):
    # None = the weights' dtype, torch.bfloat16 = bf16 autocast. Set once on the shared object, so
    # the engine's rollouts and the trainer's forwards always run at the same precision.
    autocast_dtype: torch.dtype | None = None

    def forward_precision(self):
        """The context every transformer call of `velocity` runs in (see `autocast_dtype`)."""
        device_type = next(self.transformer.parameters()).device.type
        return torch.autocast(device_type, dtype=self.autocast_dtype or torch.float32,
                              enabled=self.autocast_dtype is not None)

    @classmethod
    @abstractmethod
    def load(
        cls,
        model_path: str | Path,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        load_text_encoder: bool = True,
    ) -> FamilyAdapter:
        """Load a local diffusers-format directory (never a hub id)."""

    @abstractmethod
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Encode each prompt once."""

    @abstractmethod
    def prepare_latents(self, generators: Sequence[torch.Generator], height: int, width: int) -> Latents:
        """Initial noise, one row per generator (per-sample streams, see `diffrl.sampling.noise`)."""

    @abstractmethod
    def sigmas(self, num_steps: int, height: int, width: int) -> torch.Tensor:
        """The family's schedule `[N + 1]` for this resolution (terminal 0 included)."""

    @abstractmethod
    def velocity(
        self,
        transformer: torch.nn.Module,
        latents: Latents,
        sigma: torch.Tensor,
        cond: PromptEmbeds,
        uncond: PromptEmbeds | None,
        guidance_scale: float,
    ) -> torch.Tensor:
        """Predicted velocity for `latents` at `sigma` ([B]); CFG when guidance_scale > 1,
        a single conditional forward otherwise."""

    @abstractmethod
    def decode(self, latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
        """Packed latents → images `[B, 3, H, W]` in [0, 1]."""

    @abstractmethod
    def default_size(self) -> tuple[int, int]:
        """(height, width) used when a request leaves them unset."""

    @abstractmethod
    def check_size(self, height: int, width: int) -> None:
        """Raise `RequestError` naming `height`/`width` when the model cannot take this size."""

    # ---------------------------------------------------------------- conditioning on sglang's wire
    # sglang-diffusion sends a request's conditioning as `pos_cond_kwargs` / `neg_cond_kwargs`: the keyword
    # arguments of its transformer's forward, per output. These two map one prompt's `PromptEmbeds` (a batch
    # of one) and the image position ids to and from that dict; families that exist in sglang override them
    # to use its names and layout. Decoding needs no weights (a class method), so a client can decode with it.
    def cond_kwargs_to_wire(self, cond: PromptEmbeds, image_ids: torch.Tensor) -> dict:
        """Default (the FLUX-style families): the text tokens as sglang's one-element `encoder_hidden_states`
        list, `txt_seq_lens`, and the position ids under the diffusers transformer's names `txt_ids`/`img_ids`."""
        embeds = cond.embeds[0]
        return {"encoder_hidden_states": [embeds], "txt_seq_lens": [int(embeds.shape[0])], "txt_ids": cond.ids,
                "img_ids": image_ids}

    @classmethod
    def cond_kwargs_from_wire(cls, kwargs: dict) -> tuple[PromptEmbeds, torch.Tensor | None]:
        """(one prompt's conditioning, image position ids or None when the wire does not carry them)."""
        text = wire_text_tokens(kwargs)
        ids = kwargs.get("txt_ids")
        if ids is None:  # all-zero ids (one axis), what families without text positions use
            ids = torch.zeros(text.shape[0], 1)
        if ids.shape[0] != text.shape[0]:
            raise ValueError(f"txt_ids has {ids.shape[0]} rows for {text.shape[0]} text tokens")
        return PromptEmbeds(text[None], ids), kwargs.get("img_ids")

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    # ---------------------------------------------------------------- text encoders off the GPU
    # With `offload_text_encoders` (`--offload-text-encoder`) the text encoders live on the CPU and visit
    # the transformer's device only while prompts are encoded: their memory (Qwen-Image's is 7 B
    # parameters) is free for rollouts and training, at the cost of one copy each way per encode block.
    offload_text_encoders: bool = False

    def text_encoder_modules(self) -> list[torch.nn.Module]:
        encoders = getattr(self, "text_encoders", None) or [getattr(self, "text_encoder", None)]
        return [m for m in encoders if m is not None]

    def offload_text_encoders_to_cpu(self) -> None:
        self.offload_text_encoders = True
        for module in self.text_encoder_modules():
            module.to("cpu")

    @contextlib.contextmanager
    def text_encoders_on_device(self):
        """Inside the block the text encoders are on the compute device (a no-op without offload)."""
        if not self.offload_text_encoders:
            yield
            return
        device, modules = self.device, self.text_encoder_modules()
        for module in modules:
            module.to(device)
        try:
            yield
        finally:
            for module in modules:
                module.to("cpu")

    def save(self, path: str | Path) -> None:
        """The transformer in diffusers layout (one file): what a full finetune changes. The text encoder
        and VAE stay in the base checkpoint; `diffrl.models.checkpoint.load_model` puts the two together."""
        self.transformer.save_pretrained(Path(path) / "transformer", safe_serialization=True, max_shard_size="1000GB")

    def load_saved_transformer(self, model_dir: Path) -> None:
        """Load into `transformer` the weights a full finetune saved with `save(model_dir)` (diffusers layout)."""
        load_weights(self.transformer, model_dir / "transformer" / "diffusion_pytorch_model.safetensors")


def wire_text_tokens(kwargs: dict) -> torch.Tensor:
    """`encoder_hidden_states` of sglang cond kwargs as one `[L, D]` tensor: sglang sends a list (one entry
    per text encoder, concatenated along the tokens as its trainers do) or, for some families, a bare tensor."""
    value = kwargs.get("encoder_hidden_states")
    parts = value if isinstance(value, list | tuple) else [value]
    if not parts or any(not isinstance(p, torch.Tensor) for p in parts):
        raise ValueError("encoder_hidden_states: expected a tensor or a list of tensors")
    parts = [p[0] if p.dim() == 3 and p.shape[0] == 1 else p for p in parts]
    if any(p.dim() != 2 for p in parts):
        raise ValueError(f"encoder_hidden_states: expected [L, D] tensors, got {[tuple(p.shape) for p in parts]}")
    return torch.cat(parts).float() if len(parts) > 1 else parts[0].float()


def require_pixel_multiple(label: str, step: int, **sizes: int) -> None:
    """A `RequestError` naming the first of `sizes` (height=…, width=…) that is not a positive multiple of
    `step` pixels; `label` names the model in the message."""
    for name, value in sizes.items():
        if value < step or value % step:
            raise RequestError(name, f"{name}={value}: {label} needs a positive multiple of {step} pixels")


def repeated_blocks(transformer: torch.nn.Module, block_lists: Sequence[str]) -> list[torch.nn.Module]:
    """The blocks named by a family's `block_lists`, in order: a ModuleList's items, each ModuleList of a
    ModuleDict (per-mode blocks), or a single module. One unit each for FSDP2 and for compilation."""

    def blocks(container: torch.nn.Module) -> list[torch.nn.Module]:
        if isinstance(container, torch.nn.ModuleDict):
            return [b for child in container.values() for b in blocks(child)]
        if isinstance(container, torch.nn.ModuleList):
            return list(container)
        return [container]

    return [b for name in block_lists for b in blocks(getattr(transformer, name))]
