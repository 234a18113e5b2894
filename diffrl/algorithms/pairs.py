"""Train pairs: what one optimizer step consumes, built from scored rollout samples.

- Flow-GRPO: one pair per (sample, trained SDE step i): (x_i, x_{i+1}, σ_i, σ_{i+1}, logp_old, A).
- The forward-process methods (DiffusionNFT, AWM, SFT): one pair per (sample, timestep t): (x0, t, ε, A) with
  x_t = (1 − t)·x0 + t·ε; the timesteps are the rollout schedule's σ's without the terminal 0 (those inside the
  training range, `candidate_steps`: all by default), the first int(0.99·K) (or a set count) of a per-sample
  shuffle; ε comes from a generator seeded by the sample's seed, so pairs are reproducible.
- Diffusion-DPO: one pair per (prompt group, timestep): its best and worst sample (by advantage), one t and one ε
  for both.
- DGPO and CRD: one pair per (prompt group, timestep): every sample of the group, one t and one ε for all.
  Groups' timesteps and noise come from a generator seeded by the group's first sample's seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Literal

import torch


@dataclass
class PairBatch:
    """Pairs as stacked tensors; `select(idx)` takes a micro-batch."""

    def select(self, idx: torch.Tensor):
        return type(self)(**{f.name: getattr(self, f.name)[idx] for f in fields(self)})

    def rows(self, start: int, stop: int):
        """Pairs `start` to `stop` (views)."""
        return type(self)(**{f.name: getattr(self, f.name)[start:stop] for f in fields(self)})

    def pin_memory(self):
        """A copy in page-locked host memory, from which copies to a GPU need not wait for it."""
        return type(self)(**{f.name: getattr(self, f.name).pin_memory() for f in fields(self)})

    def to(self, device: torch.device, *, non_blocking: bool = False):
        return type(self)(**{f.name: getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def __len__(self) -> int:
        return len(getattr(self, fields(self)[0].name))


def micro_batch_bounds(keys: torch.Tensor | None, size: int, n: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) of each micro-batch over `n` pairs (len(keys)) in order: at most `size` pairs, and cut where
    `keys` (sorted, so equal keys sit together) changes value; keys None: every `size` pairs."""
    n = len(keys) if n is None else n
    cuts = [0, n]
    if keys is not None and n > 1:
        cuts = [0, *(torch.nonzero(keys[1:] != keys[:-1]).flatten() + 1).tolist(), n]
    return [(start, min(start + size, stop)) for begin, stop in zip(cuts, cuts[1:]) for start in range(begin, stop, size)]


@dataclass
class GrpoPairs(PairBatch):
    x: torch.Tensor
    x_next: torch.Tensor
    sigma: torch.Tensor
    sigma_next: torch.Tensor
    old_log_prob: torch.Tensor
    advantages: torch.Tensor
    cond: torch.Tensor  # [P, L, D] prompt embeddings
    uncond: torch.Tensor  # [P, L, D] negative-prompt embeddings (zeros when CFG is off)
    # [P, *latent] CFG's unconditional velocity at x as the rollout computed it; [P] zeros when it did not return one
    uncond_velocity: torch.Tensor

    @property
    def has_uncond_velocity(self) -> bool:
        return self.uncond_velocity.dim() > 1


@dataclass
class NftPairs(PairBatch):
    x0: torch.Tensor
    t: torch.Tensor
    noise: torch.Tensor
    advantages: torch.Tensor
    cond: torch.Tensor


@dataclass
class PreferencePairs(PairBatch):
    chosen: torch.Tensor  # [P, …] the group's best sample's clean latent
    rejected: torch.Tensor  # [P, …] its worst
    t: torch.Tensor
    noise: torch.Tensor  # one ε for both
    cond: torch.Tensor


@dataclass
class GroupPairs(PairBatch):
    x0: torch.Tensor  # [P, n, …] every sample of one prompt group
    advantages: torch.Tensor  # [P, n]
    t: torch.Tensor  # [P]
    noise: torch.Tensor  # [P, …] one ε for the whole group
    cond: torch.Tensor


def grpo_pairs(
    trajectories: Sequence[torch.Tensor],
    step_indices: Sequence[int],
    log_probs: Sequence[torch.Tensor],
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    conds: Sequence[torch.Tensor],
    unconds: Sequence[torch.Tensor],
    trained_steps: Sequence[int],
    uncond_velocities: Sequence[torch.Tensor] | None = None,
) -> GrpoPairs:
    """`trajectories[s]` holds sample s's latents at `step_indices`; `log_probs[s]` its log-probs at
    `trained_steps` (the SDE steps, ascending) or, as sglang-diffusion reports them, one per denoising
    step of the schedule (`len(sigmas) - 1` values, 0 on ODE steps): either is read the same way.
    `uncond_velocities[s]`: sample s's unconditional velocity at each of `trained_steps` (the engine's
    `uncond_velocities`, one per SDE step), or None."""
    position = {step: k for k, step in enumerate(step_indices)}
    num_steps = len(sigmas) - 1
    rows = {name: [] for name in ("x", "x_next", "sigma", "sigma_next", "old_log_prob", "advantages", "cond", "uncond",
                                  "uncond_velocity")}
    for s, trajectory in enumerate(trajectories):
        for j, i in enumerate(trained_steps):
            rows["x"].append(trajectory[position[i]])
            rows["x_next"].append(trajectory[position[i + 1]])
            rows["sigma"].append(sigmas[i])
            rows["sigma_next"].append(sigmas[i + 1])
            per_step = len(log_probs[s]) == num_steps and len(log_probs[s]) != len(trained_steps)
            rows["old_log_prob"].append(log_probs[s][i] if per_step else log_probs[s][j])
            rows["advantages"].append(advantages[s])
            rows["cond"].append(conds[s])
            rows["uncond"].append(unconds[s])
            rows["uncond_velocity"].append(torch.tensor(0.0) if uncond_velocities is None else uncond_velocities[s][j])
    return GrpoPairs(**{k: torch.stack([torch.as_tensor(v) for v in vs]) for k, vs in rows.items()})


def nft_pairs(
    x0: torch.Tensor,
    seeds: Sequence[int],
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    conds: Sequence[torch.Tensor],
    timesteps: TimestepChoice | None = None,
) -> NftPairs:
    choice = timesteps or TimestepChoice()
    schedule = sigmas[:-1]  # without the terminal 0
    rows = {name: [] for name in ("x0", "t", "noise", "advantages", "cond")}
    for s, seed in enumerate(seeds):
        g, ts = choice.draw(seed, schedule)
        for t in ts:
            rows["x0"].append(x0[s])
            rows["t"].append(t)
            rows["noise"].append(torch.randn(x0[s].shape, generator=g))
            rows["advantages"].append(advantages[s])
            rows["cond"].append(conds[s])
    return NftPairs(**{k: torch.stack([torch.as_tensor(v) for v in vs]) for k, vs in rows.items()})


def candidate_steps(schedule: torch.Tensor, timestep_range: tuple[float, float]) -> list[int]:
    """The steps k of a schedule (its σ's, terminal excluded) that the re-noising methods may train: those whose σ
    lies in [1 − end, 1 − start], the range read as a fraction of the way from pure noise (σ = 1, the scheduler's
    time 1000) to the clean image (σ = 0), as Flow-Factory's `timestep_range` is."""
    start, end = timestep_range
    steps = [k for k, sigma in enumerate(schedule.tolist()) if 1 - end - 1e-6 <= sigma <= 1 - start + 1e-6]
    if not steps:
        raise ValueError(f"--train-timestep-range {start:g} {end:g} (σ from {1 - end:g} to {1 - start:g}) holds no "
                         f"step of the schedule (σ {', '.join(f'{x:.3f}' for x in schedule.tolist())})")
    return steps


@dataclass(frozen=True)
class TimestepChoice:
    """Which timesteps a re-noising method trains each sample (or group) at. `sampling`: "schedule" = `count` (else
    int(len · fraction)) of a shuffle of the schedule's steps inside `range` (`candidate_steps`), with
    "schedule_with_first" the noisiest of them always among them, with "schedule_without_first" never; "uniform" and
    "logit_normal" = as many values drawn continuously (stratified, then shuffled): u in (0, 1) uniform, or the
    sigmoid of a standard normal, warped by `shift` (u ← s·u / (1 + (s − 1)·u): s > 1 moves them toward the image), mapped to the
    range's fraction start + u·(end − start) of the way from noise to image, σ = 1 − that (clamped to [0.01, 1] of
    the way as Flow-Factory's samplers do)."""

    fraction: float = 0.99
    range: tuple[float, float] = (0.0, 1.0)
    count: int | None = None
    sampling: Literal["schedule", "schedule_with_first", "schedule_without_first", "uniform",
                      "logit_normal"] = "schedule"
    shift: float = 1.0

    def per_sample(self, schedule: torch.Tensor) -> int:
        """How many timesteps a sample (or group) trains on this schedule (its σ's, terminal excluded); a ValueError
        naming the flags when none."""
        available = len(self._steps(schedule)) if self.sampling.startswith("schedule") else len(schedule)
        return self._kept(available)

    def _steps(self, schedule: torch.Tensor) -> list[int]:
        """The schedule's candidate steps; "schedule_without_first" leaves out the noisiest of them (Flow-Factory's
        discrete_wo_init), where the velocity's target is nearly all noise."""
        steps = candidate_steps(schedule, self.range)
        if self.sampling != "schedule_without_first":
            return steps
        if len(steps) < 2:
            raise ValueError(f"--train-timestep-sampling schedule_without_first leaves no step of --train-timestep-range "
                             f"{self.range[0]:g} {self.range[1]:g} (it holds {len(steps)})")
        return steps[1:]

    def _kept(self, available: int) -> int:
        """Of `available` (the candidate steps, or with continuous sampling the schedule's steps): `count` (for the
        schedule's steps at most all of them), else int(available · fraction)."""
        if self.count is not None:
            return min(self.count, available) if self.sampling.startswith("schedule") else self.count
        kept = int(available * self.fraction)
        if kept < 1:
            raise ValueError(f"--nft-timestep-fraction {self.fraction} keeps none of the {available} steps in "
                             f"--train-timestep-range {self.range[0]:g} {self.range[1]:g}")
        return kept

    def draw(self, seed: int, schedule: torch.Tensor) -> tuple[torch.Generator, list[torch.Tensor]]:
        """The timesteps of the sample (or group) seeded `seed`, from a generator seeded by it, which then draws the
        pairs' noise (so its pairs are reproducible from its seed alone)."""
        g = torch.Generator().manual_seed(int(seed))
        if self.sampling.startswith("schedule"):
            steps = self._steps(schedule)
            n = self._kept(len(steps))
            if self.sampling == "schedule_with_first":  # the noisiest candidate always, the others drawn
                rest = steps[1:]
                picked = [steps[0], *(rest[i] for i in torch.randperm(len(rest), generator=g)[:n - 1].tolist())]
                return g, [schedule[k] for k in picked]
            return g, [schedule[steps[i]] for i in torch.randperm(len(steps), generator=g)[:n].tolist()]
        n = self._kept(len(schedule))
        base = ((torch.arange(n) + torch.rand(n, generator=g)) / n).clamp(1e-7, 1 - 1e-7)
        u = base if self.sampling == "uniform" else torch.sigmoid(torch.distributions.Normal(0.0, 1.0).icdf(base))
        u = u[torch.randperm(n, generator=g)]
        u = self.shift * u / (1 + (self.shift - 1) * u)
        start, end = self.range
        sigma = 1 - (start + u * (end - start)).clamp(0.01, 1.0)
        return g, [x.to(schedule.dtype) for x in sigma]


def preference_pairs(
    x0: torch.Tensor,
    seeds: Sequence[int],
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    conds: Sequence[torch.Tensor],
    group_size: int,
    timesteps: TimestepChoice | None = None,
) -> PreferencePairs:
    """Samples come in groups of `group_size` (one prompt each, in order). A group whose advantages are all equal
    has no preference and makes no pair."""
    choice = timesteps or TimestepChoice()
    schedule = sigmas[:-1]
    rows = {name: [] for name in ("chosen", "rejected", "t", "noise", "cond")}
    for start in range(0, len(seeds), group_size):
        adv = advantages[start:start + group_size]
        best, worst = start + int(adv.argmax()), start + int(adv.argmin())
        if adv[best - start] == adv[worst - start]:
            continue
        g, ts = choice.draw(seeds[start], schedule)
        for t in ts:
            rows["chosen"].append(x0[best])
            rows["rejected"].append(x0[worst])
            rows["t"].append(t)
            rows["noise"].append(torch.randn(x0[best].shape, generator=g))
            rows["cond"].append(conds[best])
    if not rows["t"]:
        return PreferencePairs(*(torch.empty(0) for _ in rows))
    return PreferencePairs(**{k: torch.stack([torch.as_tensor(v) for v in vs]) for k, vs in rows.items()})


def group_pairs(
    x0: torch.Tensor,
    seeds: Sequence[int],
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    conds: Sequence[torch.Tensor],
    group_size: int,
    timesteps: TimestepChoice | None = None,
) -> GroupPairs:
    """Samples come in groups of `group_size` (one prompt each, in order); each group makes int(K·fraction) pairs."""
    if len(seeds) % group_size:
        raise ValueError(f"{len(seeds)} samples do not make whole groups of {group_size}")
    choice = timesteps or TimestepChoice()
    schedule = sigmas[:-1]
    rows = {name: [] for name in ("x0", "advantages", "t", "noise", "cond")}
    for start in range(0, len(seeds), group_size):
        g, ts = choice.draw(seeds[start], schedule)
        for t in ts:
            rows["x0"].append(x0[start:start + group_size])
            rows["advantages"].append(advantages[start:start + group_size])
            rows["t"].append(t)
            rows["noise"].append(torch.randn(x0[start].shape, generator=g))
            rows["cond"].append(conds[start])
    return GroupPairs(**{k: torch.stack([torch.as_tensor(v) for v in vs]) for k, vs in rows.items()})
