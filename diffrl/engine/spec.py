"""What makes an engine, in one place: `EngineSpec`, and `build_engine(spec)`, the one way an engine is made.

The trainer's in-process engine, its colocated engine process, a Ray engine actor and `diffrl serve` are all built
from an `EngineSpec`, so they load the same checkpoint in the same dtypes with the same forward precision, speed
options, compilation and batching, and denoise a request to the same bits. The spec travels as JSON (to an engine
process, to a Ray actor).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.models.base import FamilyAdapter
from diffrl.models.checkpoint import load_model
from diffrl.models.registry import resolve_family
from diffrl.models.speed import SpeedOptions

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineSpec:
    """An engine: the model it loads and how, its speed options and its batching limits."""

    model_path: str | None = None
    """The model's folder (None: the engine samples with a model already loaded, handed to `build_engine`)."""
    family: str | None = None
    """The model family (None: resolved from the checkpoint, `diffrl.models.registry.resolve_family`)."""
    checkpoint: str | None = None
    """A training checkpoint applied to the model (`diffrl.models.checkpoint.load_model`)."""
    device: str = "cpu"
    dtype: str = "float32"
    """dtype every component is loaded in."""
    transformer_dtype: str | None = None
    """The transformer's dtype after loading when it differs (a full finetune's fp32 masters)."""
    autocast_dtype: str | None = None
    """The family's forward precision (`FamilyAdapter.autocast_dtype`)."""
    detach_uncond: bool = False
    """CFG's halves as two forwards, the unconditional one detached (`FamilyAdapter.detach_uncond`): a trainer's
    `--detach-uncond`, so the engine's forward is the replay's."""
    flow_shift: float | None = None
    """A static schedule shift in place of the checkpoint's (`FamilyAdapter.set_flow_shift`; a trainer's --flow-shift)."""
    condition_image_size: int | None = None
    """The side of a condition image's largest area (`FamilyAdapter.set_condition_image_area`; --condition-image-size)."""
    offload_text_encoder: bool = False
    compile: bool = False
    compile_eager_numerics: bool = True
    compile_mode: str = "default"
    attention_backend: str = "auto"
    fuse_qkv: bool = False
    vae_decode_batch: int | None = None
    float8: bool = False
    """The speed options (`diffrl.models.speed.SpeedOptions`): the same forward wherever the engine runs."""
    max_outputs_per_request: int = 64
    max_batch_outputs: int = 64
    """Outputs denoised as one batch at most; a deterministic run's is fixed (`determinism.engine_batch_outputs`)."""
    limits: dict = field(default_factory=dict)
    """Other `EngineConfig` fields (what `diffrl serve` bounds: prompt length, pixels, time per request, ...)."""
    num_threads: int | None = None
    """torch's CPU threads in an engine process of its own (None: torch's default)."""
    float32_matmul_precision: str = "high"
    deterministic: bool = False

    def speed(self) -> SpeedOptions:
        return SpeedOptions.of(self)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(max_outputs_per_request=self.max_outputs_per_request,
                            max_batch_outputs=self.max_batch_outputs, **self.limits)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> EngineSpec:
        return cls(**json.loads(text))


def load_family(spec: EngineSpec, device: torch.device | str | None = None) -> FamilyAdapter:
    """The model of `spec`, loaded and set up for sampling: dtypes, forward precision, text encoder placement,
    speed options and compilation (a trainer's LoRA adapter comes later, so q/k/v fusion allows one)."""
    if spec.model_path is None:
        raise ValueError("an engine spec without a model_path is built around a loaded model: "
                         "build_engine(spec, family=...)")
    device = torch.device(spec.device if device is None else device)
    dtype = DTYPES[spec.dtype]
    if spec.checkpoint is not None:
        family = load_model(Path(spec.model_path), Path(spec.checkpoint), family=spec.family, device=device)
    else:
        family = resolve_family(spec.family, spec.model_path).load(spec.model_path, device=device, dtype=dtype)
    if spec.transformer_dtype is not None:
        family.transformer.to(DTYPES[spec.transformer_dtype])
    if spec.autocast_dtype is not None:
        family.autocast_dtype = DTYPES[spec.autocast_dtype]
    family.detach_uncond = spec.detach_uncond
    if spec.flow_shift is not None:
        family.set_flow_shift(spec.flow_shift)
    if spec.condition_image_size is not None:
        family.set_condition_image_area(spec.condition_image_size ** 2)
    if spec.offload_text_encoder:
        family.offload_text_encoders_to_cpu()
    speed = spec.speed()
    speed.apply(family, deterministic=spec.deterministic, lora_allowed_on_qkv=True)
    speed.compile_family(family)
    return family


def build_engine(spec: EngineSpec, family: FamilyAdapter | None = None) -> Engine:
    """The engine `spec` describes. `family`: a model already loaded and set up from the same spec (the
    trainer's in-process engine samples with the policy's own model, which the policy set up; evaluation and
    `diffrl bench` sample with a model they loaded)."""
    return Engine(load_family(spec) if family is None else family, spec.engine_config())
