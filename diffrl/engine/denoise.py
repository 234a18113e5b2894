"""The denoising loop: the family's velocity, then the shared transition, step after step.

Steps listed in `sde_step_indices` run the stochastic transition (`sde` or `cps`) and record a
log-prob; every other step runs ODE. The latents entering the requested steps (and the final
latent) are kept, which is what training pairs are made of, and on request CFG's unconditional velocity at
chosen steps (a trainer replaying those steps under the same weights takes it instead of computing it again). Rows can leave the batch between two
steps (`keep_rows`): the engine drops the outputs of a request that was abandoned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from diffrl.models.base import FamilyAdapter, Latents, PromptEmbeds
from diffrl.sampling import SDE_TYPES, transition


class DenoiseStopped(Exception):
    """`keep_rows` dropped every row between two steps (the requests being denoised were abandoned)."""


@dataclass
class DenoiseResult:
    latents: torch.Tensor  # final clean latents [B, S, C], fp32 (B: the rows `keep_rows` kept)
    sigmas: torch.Tensor  # the schedule used, [N + 1]
    log_probs: torch.Tensor  # [B, len(sde_step_indices)], ascending step order
    # step index i → latents x_{σ_i} entering step i (index N is the final latent)
    trajectory: dict[int, torch.Tensor] = field(default_factory=dict)
    rows: list[int] = field(default_factory=list)  # the rows of the batch as it came in that `latents` holds
    # step index i → CFG's unconditional velocity at step i (`uncond_step_indices`), fp32 like the latents
    uncond_velocities: dict[int, torch.Tensor] = field(default_factory=dict)


@torch.no_grad()
def denoise(
    family: FamilyAdapter,
    latents: Latents,
    sigmas: torch.Tensor,
    cond: PromptEmbeds,
    uncond: PromptEmbeds | None,
    guidance_scale: float,
    *,
    generators: Sequence[torch.Generator],
    sde_type: str = "ode",
    noise_level: float = 0.0,
    sde_step_indices: Iterable[int] = (),
    return_step_indices: Iterable[int] = (),
    log_prob_no_const: bool = False,
    transformer: torch.nn.Module | None = None,
    guidance_scale_2: float | None = None,
    keep_rows: Callable[[], Sequence[int] | None] | None = None,
    training_graph: bool = False,
    training_graph_rows: int | None = None,
    uncond_step_indices: Iterable[int] = (),
) -> DenoiseResult:
    """`guidance_scale_2` (families with a second expert only) is passed on to `family.velocity` when set.
    `training_graph`: each velocity is computed with gradients enabled (for the parameters that require them) and
    detached at once, so compiled blocks run the graph a trainer's replay of the step runs, not the no-gradient
    one, which the compiler fuses and rounds differently (`EngineConfig.forward_graph`). `training_graph_rows`: that
    velocity is computed for at most this many rows at a time (the trainer's micro-batch), so each forward has the
    replay's shape and holds one micro-batch's activations, not the whole batch's. `uncond_step_indices`: steps
    whose CFG unconditional velocity is kept (`family.reuses_uncond_velocity`; with CFG on).
    `keep_rows` is asked before every step: None goes on with every row; otherwise the positions (in the
    current batch) of the rows to go on with. The others leave everything the loop carries and are not
    computed again, so the result holds only the kept rows, in order; keeping none raises `DenoiseStopped`."""
    if sde_type not in SDE_TYPES:
        raise ValueError(f"unknown sde type {sde_type!r}; expected one of {SDE_TYPES}")
    transformer = transformer if transformer is not None else family.transformer
    num_steps = len(sigmas) - 1
    sde_steps = sorted(set(sde_step_indices))
    keep = set(return_step_indices)
    keep_uncond = set(uncond_step_indices)
    if keep_uncond and not (guidance_scale > 1.0 and family.reuses_uncond_velocity):
        raise ValueError("uncond_step_indices needs CFG (guidance_scale > 1) with the unconditional half run apart "
                         "(the family's detach_uncond)")
    for name, indices, limit in (("sde_step_indices", sde_steps, num_steps - 1), ("return_step_indices", keep, num_steps)):
        bad = [i for i in indices if not 0 <= i <= limit]
        if bad:
            raise ValueError(f"{name} {bad} out of range 0..{limit} for {num_steps} steps")
    # Stands in for σ = 1 in the SDE's std (see sampling.steps.sde_step); a view, not read back to the host.
    sigma_max = sigmas[1]
    x = latents.tokens.float()
    batch = x.shape[0]
    kept = list(range(batch))
    log_probs = []
    trajectory: dict[int, torch.Tensor] = {}
    uncond_velocities: dict[int, torch.Tensor] = {}
    second = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
    for i in range(num_steps):
        if keep_rows is not None and (rows := keep_rows()) is not None:
            if not rows:
                raise DenoiseStopped(f"stopped before step {i} of {num_steps}")
            # Each row has its own conditioning and generator, so the kept rows go on exactly as before.
            idx = torch.as_tensor(rows, dtype=torch.long, device=x.device)
            x, batch = x[idx], len(rows)
            kept = [kept[r] for r in rows]
            cond = cond.rows(idx)
            uncond = None if uncond is None else uncond.rows(idx)
            generators = [generators[r] for r in rows]
            log_probs = [lp[idx] for lp in log_probs]
            trajectory = {s: t[idx] for s, t in trajectory.items()}
            uncond_velocities = {s: t[idx] for s, t in uncond_velocities.items()}
        if i in keep:
            trajectory[i] = x.clone()
        sigma = sigmas[i].expand(batch)
        if training_graph:
            v, v_uncond = _velocity_with_gradients(family, transformer, Latents(x, latents.ids), sigma, cond, uncond,
                                                   guidance_scale, second, training_graph_rows)
        else:
            v, v_uncond = family.velocity_and_uncond(transformer, Latents(x, latents.ids), sigma, cond, uncond,
                                                     guidance_scale, **second)
        if i in keep_uncond:
            uncond_velocities[i] = v_uncond.float()
        stochastic = i in sde_steps and sde_type != "ode"
        out = transition(
            sde_type if stochastic else "ode", x, v, sigmas[i], sigmas[i + 1],
            noise_level if stochastic else 0.0, sigma_max=sigma_max, generators=generators,
            log_prob_no_const=log_prob_no_const,
        )
        if i in sde_steps:
            log_probs.append(out.log_prob if out.log_prob is not None else torch.zeros(batch, device=x.device))
        x = out.next_latents
    if num_steps in keep:
        trajectory[num_steps] = x.clone()
    stacked = torch.stack(log_probs, dim=1) if log_probs else x.new_zeros(batch, 0)
    return DenoiseResult(latents=x, sigmas=sigmas, log_probs=stacked, trajectory=trajectory, rows=kept,
                         uncond_velocities=uncond_velocities)


def _velocity_with_gradients(family: FamilyAdapter, transformer: torch.nn.Module, latents: Latents,
                             sigma: torch.Tensor, cond: PromptEmbeds, uncond: PromptEmbeds | None,
                             guidance_scale: float, second: dict,
                             rows: int | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The velocity (and CFG's unconditional one, None without CFG) in the training graph, detached piece by piece:
    `rows` at a time when set (each piece's autograd graph, holding its activations, is freed before the next runs).
    A conditioning that packs both CFG halves in one tensor (a `PromptEmbeds` subclass) cannot be cut by rows and
    runs whole."""
    batch = latents.tokens.shape[0]
    if rows is None or rows >= batch or type(cond) is not PromptEmbeds:
        with torch.enable_grad():
            v, v_uncond = family.velocity_and_uncond(transformer, latents, sigma, cond, uncond, guidance_scale,
                                                     **second)
        return v.detach(), None if v_uncond is None else v_uncond.detach()
    pieces, uncond_pieces = [], []
    for start in range(0, batch, rows):
        part = slice(start, start + rows)
        with torch.enable_grad():
            v, v_uncond = family.velocity_and_uncond(
                transformer, Latents(latents.tokens[part], latents.ids), sigma[part], cond.rows(part),
                None if uncond is None else uncond.rows(part), guidance_scale, **second)
        pieces.append(v.detach())
        uncond_pieces.append(None if v_uncond is None else v_uncond.detach())
    return torch.cat(pieces), None if uncond_pieces[0] is None else torch.cat(uncond_pieces)
