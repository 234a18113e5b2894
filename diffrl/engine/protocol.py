"""Rollout request and response types (DESIGN §3).

Field names follow sglang-diffusion's `/rollout/generate`, so either engine can serve the other's
client. The request is a pydantic model (validated at the HTTP boundary and in-process alike);
unknown fields are refused rather than ignored, and so are image-conditioning fields on a
text-to-image family (see `Engine.validate`). The response is one `RolloutOutput` per output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from diffrl.errors import RequestError  # noqa: F401  (re-exported: part of the protocol)

# Image-conditioned inputs: accepted by the schema so they can be refused by name, never ignored.
IMAGE_CONDITIONING_FIELDS = ("image", "image_url", "input_reference", "mask_image")


class RolloutRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt: str
    negative_prompt: str = ""
    seed: int = Field(0, ge=0, lt=2**63)
    """Output i of the request uses seed `seed + i` for its own generator."""
    num_outputs_per_prompt: int = 1
    width: int | None = None
    height: int | None = None
    num_frames: int | None = None
    num_inference_steps: int = Field(10, ge=1, le=1000)
    guidance_scale: float | None = Field(None, ge=0)
    """None: the family's default. ≤ 1 runs one conditional forward per step."""
    guidance_scale_2: float | None = Field(None, ge=0)
    """CFG scale of a second (low-noise) expert, for families that have one (Wan2.2); None: guidance_scale."""
    true_cfg_scale: float | None = Field(None, ge=0)
    rollout: bool = False
    """True: the SDE steps inject noise and return log-probs; False: plain ODE sampling."""
    rollout_sde_type: Literal["sde", "cps", "ode"] = "sde"
    rollout_noise_level: float = Field(0.7, ge=0)
    rollout_sde_step_indices: list[int] | None = None
    """Steps that inject noise and return log-probs (default: every step); the rest run ODE."""
    rollout_return_step_indices: list[int] | None = None
    """Steps whose entering latents come back (default: each SDE step and the one after)."""
    rollout_return_denoising_env: bool = False
    rollout_return_dit_trajectory: bool = False
    rollout_log_prob_no_const: bool = False
    image: str | list[str] | None = None
    image_url: str | list[str] | None = None
    input_reference: str | None = None
    mask_image: str | None = None


@dataclass
class DitTrajectory:
    latents: torch.Tensor  # [K, *latent_shape], the latents entering each returned step
    timesteps: torch.Tensor  # [K] the model timesteps of those steps
    sigmas: torch.Tensor  # [N + 1] the whole schedule
    latent_step_indices: torch.Tensor  # [K] int64


@dataclass
class RolloutOutput:
    seed: int
    generated_output: torch.Tensor  # image [C, H, W] in [0, 1] (video [C, F, H, W])
    rollout_log_probs: torch.Tensor | None  # [T], one per SDE step
    dit_trajectory: DitTrajectory | None
    # Conditioning to replay a step; only on the first output of a request (sent once, not per output).
    denoising_env: dict[str, torch.Tensor] | None
    weight_version: int
    inference_time_s: float
    peak_memory_mb: float
