"""The engine: one request per microgroup, the prompt encoded once, the outputs denoised as one batch.

`Engine.generate(request)` validates the request (a `RequestError` naming the field, the engine
untouched), encodes the prompt (and the negative prompt when CFG is on) once, repeats the
conditioning to `num_outputs_per_prompt`, gives output i its own generator seeded `seed + i`
(initial noise and every SDE draw), and runs the shared denoising loop. It is usable in-process
as is; `diffrl.engine.server` puts the same object behind HTTP.
"""

from __future__ import annotations

import asyncio
import resource
import threading
import time
from dataclasses import dataclass

import torch

from diffrl.engine.denoise import denoise
from diffrl.engine.protocol import IMAGE_CONDITIONING_FIELDS, DitTrajectory, RolloutOutput, RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.base import FamilyAdapter
from diffrl.sampling import make_generators


@dataclass
class EngineConfig:
    max_outputs_per_request: int = 64
    """Upper bound on num_outputs_per_prompt (memory guard)."""


@dataclass(frozen=True)
class _Plan:
    """A validated request, with every default resolved."""

    height: int
    width: int
    guidance_scale: float
    sde_type: str
    sde_steps: tuple[int, ...]
    return_steps: tuple[int, ...]


class Engine:
    def __init__(self, family: FamilyAdapter, config: EngineConfig | None = None):
        self.family = family
        self.config = config or EngineConfig()
        self.weight_version = 0
        self._model_lock = threading.Lock()  # one denoise at a time on this model
        self._count_lock = threading.Lock()
        self._in_flight = 0

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished (waiting or running): the routing load figure."""
        return self._in_flight

    # ------------------------------------------------------------------ validation
    def plan(self, req: RolloutRequest) -> _Plan:
        """Resolve defaults and refuse what this engine cannot serve, naming the field."""
        family = self.family
        limit = self.config.max_outputs_per_request
        if not 1 <= req.num_outputs_per_prompt <= limit:
            raise RequestError("num_outputs_per_prompt", f"must be between 1 and {limit}, got {req.num_outputs_per_prompt}")
        if not family.accepts_image_conditioning:
            for name in IMAGE_CONDITIONING_FIELDS:
                if getattr(req, name) is not None:
                    raise RequestError(name, f"the {family.name} family is text-to-image only; image conditioning is refused")
        if req.num_frames not in (None, 1):
            raise RequestError("num_frames", f"the {family.name} family generates images, not video (got {req.num_frames})")
        if req.true_cfg_scale is not None:
            raise RequestError("true_cfg_scale", f"not supported by the {family.name} family; use guidance_scale")
        default_h, default_w = family.default_size()
        height, width = req.height or default_h, req.width or default_w
        family.check_size(height, width)
        n = req.num_inference_steps
        sde_type = req.rollout_sde_type if req.rollout else "ode"
        sde_steps = tuple(range(n)) if req.rollout_sde_step_indices is None else tuple(req.rollout_sde_step_indices)
        if not req.rollout:
            sde_steps = ()
        _check_indices("rollout_sde_step_indices", sde_steps, n - 1)
        if len(set(sde_steps)) != len(sde_steps):
            raise RequestError("rollout_sde_step_indices", f"repeated step index in {list(sde_steps)}")
        if req.rollout_return_step_indices is None:
            return_steps = tuple(sorted({j for i in sde_steps for j in (i, i + 1)}))
        else:
            return_steps = tuple(sorted(set(req.rollout_return_step_indices)))
        _check_indices("rollout_return_step_indices", return_steps, n)
        guidance = family.default_guidance_scale if req.guidance_scale is None else req.guidance_scale
        return _Plan(height, width, guidance, sde_type, tuple(sorted(sde_steps)), return_steps)

    # ------------------------------------------------------------------ generation
    def generate(self, req: RolloutRequest) -> list[RolloutOutput]:
        plan = self.plan(req)  # refuse before counting: a bad request never occupies the engine
        with self._count_lock:
            self._in_flight += 1
        try:
            with self._model_lock:
                return self._generate(req, plan)
        finally:
            with self._count_lock:
                self._in_flight -= 1

    async def agenerate(self, req: RolloutRequest) -> list[RolloutOutput]:
        """`generate` on a worker thread, so an event loop keeps serving while the model runs."""
        return await asyncio.to_thread(self.generate, req)

    @torch.no_grad()
    def _generate(self, req: RolloutRequest, plan: _Plan) -> list[RolloutOutput]:
        family = self.family
        device = family.device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        n = req.num_outputs_per_prompt
        cond_one = family.encode_prompts([req.prompt])  # encoded once, repeated below
        uncond_one = family.encode_prompts([req.negative_prompt]) if plan.guidance_scale > 1.0 else None
        seeds = [req.seed + i for i in range(n)]
        generators = make_generators(seeds, device=device)
        latents = family.prepare_latents(generators, plan.height, plan.width)
        sigmas = family.sigmas(req.num_inference_steps, plan.height, plan.width)
        result = denoise(
            family, latents, sigmas, cond_one.repeat(n), uncond_one.repeat(n) if uncond_one is not None else None,
            plan.guidance_scale, generators=generators, sde_type=plan.sde_type, noise_level=req.rollout_noise_level,
            sde_step_indices=plan.sde_steps,
            return_step_indices=plan.return_steps if req.rollout_return_dit_trajectory else (),
            log_prob_no_const=req.rollout_log_prob_no_const,
        )
        if not torch.isfinite(result.latents).all():
            raise FloatingPointError(f"non-finite latents for prompt {req.prompt!r} seed {req.seed}")
        images = family.decode(result.latents, plan.height, plan.width).cpu()
        elapsed = time.perf_counter() - start
        peak_mb = _peak_memory_mb(device)
        env = _denoising_env(cond_one, uncond_one, latents.ids, sigmas, plan) if req.rollout_return_denoising_env else None
        steps = torch.tensor(plan.return_steps, dtype=torch.int64)
        outputs = []
        for i, seed in enumerate(seeds):
            trajectory = None
            if req.rollout_return_dit_trajectory:
                trajectory = DitTrajectory(
                    latents=torch.stack([result.trajectory[s][i] for s in plan.return_steps]).cpu()
                    if plan.return_steps else torch.empty(0),
                    timesteps=(sigmas.cpu()[steps] * family.timestep_scale),
                    sigmas=sigmas.cpu(),
                    latent_step_indices=steps,
                )
            outputs.append(RolloutOutput(
                seed=seed, generated_output=images[i],
                rollout_log_probs=result.log_probs[i].cpu() if req.rollout else None,
                dit_trajectory=trajectory, denoising_env=env if i == 0 else None,
                weight_version=self.weight_version, inference_time_s=elapsed, peak_memory_mb=peak_mb,
            ))
        return outputs


def _check_indices(field: str, indices, limit: int) -> None:
    bad = [i for i in indices if not 0 <= i <= limit]
    if bad:
        raise RequestError(field, f"{bad} out of range 0..{limit}")


def _denoising_env(cond, uncond, image_ids, sigmas, plan: _Plan) -> dict[str, torch.Tensor]:
    """What a trainer needs to replay any step of this request (once per request, unexpanded)."""
    env = {"prompt_embeds": cond.embeds.cpu(), "text_ids": cond.ids.cpu(), "image_ids": image_ids.cpu(),
           "sigmas": sigmas.cpu(), "guidance_scale": torch.tensor(plan.guidance_scale)}
    if uncond is not None:
        env["negative_prompt_embeds"] = uncond.embeds.cpu()
    return env


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)
