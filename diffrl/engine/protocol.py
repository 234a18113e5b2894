"""Rollout request and response types (docs/architecture.md, "Wire formats").

The request declares every field of sglang-diffusion's `/rollout/generate` request model, so its
clients (miles-diffusion's among them) are served unchanged; a field neither side knows is refused
by name, and so are image-conditioning fields on a text-to-image family (see `Engine.plan`). Fields
sglang declares that change nothing here are accepted and documented (`rollout_debug_mode`,
`suppress_logs`, and `fps` where the family's samples do not depend on it). The response is one `RolloutOutput` per output; `wire.py` and `sglang.py`
put it on the wire (docs/wire-format.md).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from diffrl.errors import RequestError  # noqa: F401  (re-exported: part of the protocol)

# Image-conditioned inputs: accepted by the schema so they can be refused by name, never ignored. Image-conditioned
# families read `image_path` and refuse the others.
IMAGE_CONDITIONING_FIELDS = ("image", "image_url", "input_reference", "mask_image", "image_path")

# Fields sglang declares as nullable where diffrl has a concrete default: null means that default.
_NULL_MEANS_DEFAULT = ("negative_prompt", "num_inference_steps", "num_outputs_per_prompt", "seed", "rollout",
                       "rollout_sde_type", "rollout_noise_level", "rollout_log_prob_no_const",
                       "rollout_return_denoising_env", "rollout_return_dit_trajectory", "rollout_debug_mode",
                       "suppress_logs")
# `extra_sampling_params` may not override these (sglang keeps `rollout` from the request itself).
_NOT_IN_EXTRA = ("prompt", "rollout", "extra_sampling_params")
# The pydantic error type of a refused `extra_sampling_params` key (its context holds the key).
EXTRA_KEY_ERROR = "extra_sampling_param"


# The schema's own bounds (what no engine could serve); each engine's limits are checked in `Engine.plan`.
MAX_STEPS = 1000


def utf8_text(value: str | None) -> str | None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate from a JSON escape): tokenizers cannot."""
    if value is None:
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text is not valid Unicode (a lone surrogate)") from None
    return value


def _holds_numbers(annotation: Any) -> bool:
    """Whether a field's type is (or contains) int or float: `int | None`, `list[int] | None`."""
    return annotation is int or annotation is float or any(_holds_numbers(arg) for arg in get_args(annotation))


@functools.cache
def number_fields(model: type[BaseModel]) -> frozenset[str]:
    """The fields of a request model whose values are numbers, or lists of numbers."""
    return frozenset(name for name, field in model.model_fields.items() if _holds_numbers(field.annotation))


def json_number(value: Any, info: ValidationInfo, model: type[BaseModel]) -> Any:
    """Refuse a JSON boolean or string where a number belongs (alone or in a list), which pydantic's lax mode
    would read as one (true as 1, "2" as 2): a client that sends `"num_outputs_per_prompt": true` has a bug that
    reading it as 1 would hide. An integer field still takes a float with an integral value (2.0 as 2, not 2.5)."""
    if info.field_name not in number_fields(model):
        return value
    for item in value if isinstance(value, list) else (value,):
        if isinstance(item, (bool, str)):
            kind = "a boolean" if isinstance(item, bool) else "a string"
            raise ValueError(f"must be a number, not {kind} ({json.dumps(item)[:40]})")
    return value


def cfg_scale(req: "RolloutRequest", default: float | None, true_cfg: bool) -> float | None:
    """The CFG scale a request asks of a family, read as sglang-diffusion reads it (`Req.validate` and the pipeline
    configs' `get_classifier_free_guidance_scale`): a true-CFG family's (Qwen-Image's) is `true_cfg_scale` when set;
    any other family's is `guidance_scale` (else `default`), and `true_cfg_scale` only switches CFG on (above 1) or
    off (1 or below: one conditional forward, scale 1)."""
    scale = default if req.guidance_scale is None else req.guidance_scale
    if req.true_cfg_scale is None:
        return scale
    if true_cfg:
        return req.true_cfg_scale
    return scale if req.true_cfg_scale > 1 else 1.0


class RolloutRequest(BaseModel):
    # NaN and ±Infinity (which Python's JSON parser accepts) are refused for every float field.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    prompt: str
    negative_prompt: str = ""
    seed: int = Field(0, ge=0, lt=2**63)
    """Output i of the request uses seed `seed + i` for its own generator."""
    num_outputs_per_prompt: int = 1
    width: int | None = Field(None, ge=1)
    height: int | None = Field(None, ge=1)
    """None: the family's default (0 is refused, not read as the default)."""
    num_frames: int | None = Field(None, ge=1)
    num_inference_steps: int = Field(10, ge=1, le=MAX_STEPS)
    guidance_scale: float | None = Field(None, ge=0)
    """None: the family's default. ≤ 1 runs one conditional forward per step."""
    guidance_scale_2: float | None = Field(None, ge=0)
    """CFG scale of a second (low-noise) expert, for families that have one (Wan2.2); None: guidance_scale."""
    true_cfg_scale: float | None = Field(None, ge=0)
    rollout: bool = False
    """True: the SDE steps inject noise and return log-probs; False: plain ODE sampling."""
    rollout_sde_type: Literal["sde", "cps", "dance", "ode"] = "sde"
    """sde: Flow-GRPO's; cps: coefficient-preserving; dance: DanceGRPO's constant-noise SDE (a diffrl extension of
    sglang-diffusion's values); ode: no noise."""
    rollout_noise_level: float = Field(0.7, ge=0)
    rollout_sde_step_indices: list[int] | None = Field(None, max_length=MAX_STEPS + 1)
    """Steps that inject noise and return log-probs (default: every step); the rest run ODE."""
    rollout_return_step_indices: list[int] | None = Field(None, max_length=MAX_STEPS + 2)
    """Steps whose entering latents come back (default: each SDE step and the one after)."""
    rollout_return_denoising_env: bool = False
    rollout_return_negative_env: bool = False
    """With rollout_return_denoising_env, a diffrl extension: the negative prompt's conditioning comes back in the env
    even when the request runs without CFG (its sampling unchanged), for a trainer whose KL reference is guided."""
    rollout_return_dit_trajectory: bool = False
    rollout_return_uncond_velocity: bool = False
    """A diffrl extension: with CFG on and the family's unconditional half run apart (`EngineSpec.detach_uncond`),
    each output also returns that half's velocity at every SDE step (`RolloutOutput.uncond_velocities`), which a
    trainer replaying the steps under the same weights takes in place of a forward. Otherwise nothing comes back."""
    rollout_log_prob_no_const: bool = False
    generator_device: str | None = None
    """Where each output's generator lives: "cpu" (CPU generators, the same noise on any machine) or
    "cuda"/"device" (the engine's device; CPU on a CPU engine). None: the engine's device."""
    rollout_debug_mode: bool = False
    """Accepted for sglang clients; diffrl returns no debug tensors (`rollout_debug_tensors` is null)."""
    suppress_logs: bool = False
    """Accepted for sglang clients; the engine logs nothing per request anyway."""
    fps: int | None = Field(None, ge=1)
    """Accepted for sglang clients (video playback rate). Families whose samples depend on the frame rate (LTX-2,
    Cosmos3: `FamilyAdapter.frame_rate`) refuse any other than theirs; for the others it changes nothing."""
    extra_sampling_params: dict[str, Any] | None = None
    """Further sampling fields, as sglang merges them into its sampling params: each key must be a field
    of this request (it overrides the top-level value; `rollout` and `prompt` cannot be set here)."""
    image_path: list[str | bytes] | None = Field(None, max_length=64)
    """Condition images (an edit's source), for image-conditioned families: sglang-diffusion's field. Each entry is
    a path on the server's disk (read only under its allowed roots), a `data:` URL with base64 bytes, or raw bytes
    (msgpack and in-process requests): `diffrl.engine.condition_images`."""
    image: str | list[str] | None = None
    image_url: str | list[str] | None = None
    input_reference: str | None = None
    mask_image: str | None = None

    _text = field_validator("prompt", "negative_prompt", "generator_device")(utf8_text)

    @field_validator("negative_prompt")
    @classmethod
    def _negative_prompt_whitespace(cls, value: str) -> str:
        """Whitespace around a negative prompt is dropped, as sglang-diffusion drops it, unless the prompt is nothing
        but whitespace (Qwen-Image's and Flow-GRPO's " " stays " ": it encodes differently from "")."""
        return value if value.isspace() else value.strip()

    @field_validator("*", mode="before")
    @classmethod
    def _numbers(cls, value: Any, info: ValidationInfo) -> Any:
        return json_number(value, info, cls)

    @model_validator(mode="before")
    @classmethod
    def _sglang_spellings(cls, data: Any) -> Any:
        """Nulls sglang allows mean diffrl's default; `extra_sampling_params` keys map onto fields."""
        if not isinstance(data, dict):
            return data
        data = {k: v for k, v in data.items() if not (k in _NULL_MEANS_DEFAULT and v is None)}
        extra = data.get("extra_sampling_params")
        if isinstance(extra, dict) and extra:
            for key, value in extra.items():
                if key in _NOT_IN_EXTRA or key not in cls.model_fields:
                    # The key is client text: escaped, since pydantic cannot carry a lone surrogate in a message.
                    name = str(key).encode("utf-8", "backslashreplace").decode("utf-8")[:100]
                    # Its own error type carries the key, so the server names `extra_sampling_params.<key>`
                    # as the field (a model-level error has no location of its own).
                    raise PydanticCustomError(
                        EXTRA_KEY_ERROR, "extra_sampling_params.{key}: " + (
                            "not a sampling parameter this engine knows" if key not in _NOT_IN_EXTRA else
                            "cannot be set through extra_sampling_params"), {"key": name})
                if value is not None or key not in _NULL_MEANS_DEFAULT:
                    data[key] = value
            data["extra_sampling_params"] = None  # merged: the request now says it all
        return data


@dataclass
class DitTrajectory:
    latents: torch.Tensor  # [K, *latent_shape], the latents entering each returned step
    timesteps: torch.Tensor  # [K] the model timesteps of those steps
    sigmas: torch.Tensor  # [N + 1] the whole schedule
    latent_step_indices: torch.Tensor  # [K] int64


@dataclass
class RolloutOutput:
    seed: int
    generated_output: torch.Tensor  # image [C, H, W] in [0, 1] (video [C, F, H, W]); sglang's JSON adds F = 1
    rollout_log_probs: torch.Tensor | None  # one per SDE step, ascending (sglang's JSON: one per step, 0 on ODE)
    dit_trajectory: DitTrajectory | None
    # Conditioning to replay a step; only on the first output of a request (sent once, not per output).
    denoising_env: dict[str, torch.Tensor] | None
    weight_version: int
    inference_time_s: float
    peak_memory_mb: float
    # CFG's unconditional velocity at each SDE step, ascending `[K, *latent_shape]` fp32, when the request asked for
    # it and the engine ran the half apart (`rollout_return_uncond_velocity`); the compact form carries it, the
    # sglang JSON form does not.
    uncond_velocities: torch.Tensor | None = None
