"""Flow-GRPO and its SDE relatives: policy gradient on the stochastic steps of a rollout.

- `flow_grpo` (arXiv 2505.05470): SDE on a window of steps (the rest ODE) with CFG; pairs are the windowed
  transitions (x_t, x_t', σ, σ', log p_old, A); the loss is PPO's clipped ratio ρ = exp(log p_θ − log p_old)
  plus an optional KL to the reference. The trainer replays each step through the family's `velocity` and
  the shared transition kernel, exactly as the engine ran it, so an on-policy first pass has ratio 1.
  DanceGRPO (arXiv 2505.07818) is `--diffusion-sde-type dance` (constant noise) with `--kl-type v-based`;
  MixGRPO (arXiv 2507.21802) is `--diffusion-sde-step-strategy sliding` (the SDE window moves over training,
  ODE elsewhere; only window steps are trained); Flow-GRPO-Fast is a window of 1–2 steps at a random start.
- `grpo_guard` (arXiv 2510.22319): the same rollouts, with the log-ratio scaled by the step's std (TempFlow-GRPO's
  noise-aware weighting, arXiv 2508.04324) and its negative bias removed (`losses.guard_log_ratio`). The bias
  term needs the rollout's step mean μ_old: at the first optimizer step it is the current model's (the same
  weights); later steps recompute it with the weights that sampled (`Objective.rollout_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from diffrl.algorithms.losses import flow_grpo_loss, guard_log_ratio, v_kl, x_kl
from diffrl.algorithms.pairs import GrpoPairs, grpo_pairs
from diffrl.sampling import transition
from diffrl.train.objectives.base import Objective, conditioning_rows, detached


def sde_window(cfg, k: int) -> list[int]:
    """Rollout k's SDE steps, ascending, inside --diffusion-sde-window-range [lo, hi): --diffusion-num-sde-steps
    consecutive steps at a start drawn in the range (window), as many distinct steps drawn anywhere in it (random),
    or MixGRPO's sliding window: start lo + stride·(k // interval), at most hi − width (sliding)."""
    r = cfg.rollout
    lo, hi = r.sde_window_range()
    width = r.diffusion_num_sde_steps
    if r.diffusion_sde_step_strategy == "sliding":
        start = min(lo + r.diffusion_sde_window_stride * (k // r.diffusion_sde_window_shift_interval), hi - width)
        return list(range(start, start + width))
    rng = np.random.default_rng([cfg.seed, k, 1])
    if r.diffusion_sde_step_strategy == "random":
        return sorted(int(i) for i in rng.choice(np.arange(lo, hi), size=width, replace=False))
    start = int(rng.integers(lo, hi - width + 1))
    return list(range(start, start + width))


class FlowGrpo(Objective):
    name = "flow_grpo"
    replays_rollout_steps = True

    def sde_window(self, k: int) -> list[int]:
        return sde_window(self.cfg, k)

    def request(self, k: int) -> dict:
        r = self.cfg.rollout
        self.window = self.sde_window(k)
        return self._sized(dict(num_inference_steps=r.diffusion_num_steps, guidance_scale=r.diffusion_guidance_scale,
                                **self._second_expert(), rollout=True, rollout_sde_type=r.diffusion_sde_type,
                                rollout_noise_level=r.diffusion_noise_level, rollout_sde_step_indices=self.window,
                                rollout_return_dit_trajectory=True, rollout_return_denoising_env=True,
                                **({"rollout_return_uncond_velocity": True} if self.reuses_rollout_uncond() else {})))

    @classmethod
    def hands_over_uncond(cls, cfg) -> bool:
        """--reuse-rollout-uncond with the half detached and CFG on, rolled out by the in-process engine alone (no
        engine URLs, no --colocate or Ray engines)."""
        a, e = cfg.algorithm, cfg.engine
        return (a.detach_uncond and a.reuse_rollout_uncond and cfg.rollout.diffusion_guidance_scale > 1.0
                and e.local_engine and not e.engine_urls and not e.colocate and cfg.placement.ray_engines == 0)

    def reuses_rollout_uncond(self) -> bool:
        """Whether the first optimizer step takes CFG's unconditional velocity from the rollout: the configuration
        allows it (`hands_over_uncond`), and the one engine is this process's, sampling with the trained family itself
        in the replay's precision, so its value is what the replay's forward computes (bit for bit where the replay
        runs the rollout's graph at its batch shape)."""
        policy = self.policy
        return (self.hands_over_uncond(self.cfg) and policy.local_engine is not None and not policy.remote_engines
                and policy.engine_family is policy.family)

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> GrpoPairs:
        """Pairs whose `cond` / `uncond` are rows of `env["cond_rows"]` / `env["uncond_rows"]` (on the device)."""
        trajectories = [s.output.dit_trajectory for s in samples]
        self.sigma_max = float(trajectories[0].sigmas[1])  # the SDE's σ̃ where σ = 1
        env["cond_rows"], cond = conditioning_rows(env["cond"], self.device)
        self._ids_to_device(env)
        uncond = [torch.tensor(0)] * len(samples)  # unused without CFG
        if self.cfg.rollout.diffusion_guidance_scale > 1.0:
            env["uncond_rows"], uncond = conditioning_rows(env["uncond"], self.device)
        return grpo_pairs([t.latents for t in trajectories], trajectories[0].latent_step_indices.tolist(),
                          [s.output.rollout_log_probs for s in samples], trajectories[0].sigmas, advantages,
                          cond, uncond, self.window, self._rollout_uncond_velocities(samples))

    def _rollout_uncond_velocities(self, samples: Sequence) -> list[torch.Tensor] | None:
        """Each sample's unconditional velocity at the trained steps, when every sample came back with one (one per
        trained step) from the weights the trainer holds now; else None (the replay computes them)."""
        outputs = [s.output for s in samples]
        if not self.reuses_rollout_uncond() or not outputs or any(
                o.uncond_velocities is None or len(o.uncond_velocities) != len(self.window)
                or o.weight_version != self.policy.weight_version for o in outputs):
            return None
        return [o.uncond_velocities for o in outputs]

    def start_update(self) -> None:
        super().start_update()
        self._first_pass_diff, self._first_pass_clipped, self._first_pass_n = 0.0, 0.0, 0

    def one_step_micro_batches(self) -> bool:
        """One trained step per micro-batch: its σ goes to the family as one value for every row, as the rollout's
        step did, so per-row timestep layers take the rollout's path (`models/batch_invariance.py`, no search for
        distinct rows) and a compiled replay runs the rollout's own graphs instead of a mixed-σ graph of its own.
        A family that batches only one prompt's rows (cosmos3) keeps its prompt-ordered micro-batches instead."""
        return not self.policy.family.one_sample_per_forward

    def pairs_per_sample(self, pairs: GrpoPairs) -> int:
        """The rollout's trained steps (`pairs` made one per sample and step of the window, a sample's together): an
        optimizer step takes whole samples, as flow_grpo's and miles-diffusion's training loops split a rollout, so
        every step holds the same number of pairs at each σ and its one-step micro-batches come out whole."""
        return len(self.window)

    def micro_batch_key(self, pairs: GrpoPairs) -> torch.Tensor | None:
        return pairs.sigma if self.one_step_micro_batches() else None

    def loss(self, batch: GrpoPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r, a, dev = self.cfg.rollout, self.cfg.algorithm, self.device
        guidance = r.diffusion_guidance_scale
        x, x_next = batch.x.to(dev), batch.x_next.to(dev)
        sigma, sigma_next = batch.sigma.to(dev), batch.sigma_next.to(dev)
        if self.one_step_micro_batches():  # the trainer keeps σ constant within a micro-batch (`micro_batch_key`):
            sigma, sigma_next = (v[:1].expand(len(batch)) for v in (sigma, sigma_next))  # one value, no device read
        cond = env["cond_rows"][batch.cond.to(dev)]
        uncond = env["uncond_rows"][batch.uncond.to(dev)] if guidance > 1.0 else None

        def velocity(uncond_velocity=None):
            return self._velocity(x, sigma, cond, uncond, guidance, env, uncond_velocity)

        def step_of(v):  # the engine's transition, scoring the rollout's x_next instead of drawing one
            return transition(r.diffusion_sde_type, x, v, sigma, sigma_next, r.diffusion_noise_level,
                              sigma_max=self.sigma_max, next_latents=x_next)

        # Other weights' forwards first, with no graph: swapping parameters after building v_θ's graph would
        # corrupt it.
        ref_v = None
        if a.diffusion_kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                ref_v = velocity()
        old_mean = self.rollout_step_mean(step, velocity, step_of)
        # The family's forward precision is the engine's too, so the first pass reproduces its log-probs
        # (exactly in fp32; bf16 kernels may round differently at the trainer's batch size).
        # At the first optimizer step the weights are the rollout's: its unconditional half stands for this forward's.
        v = velocity(batch.uncond_velocity.to(dev) if step == 0 and batch.has_uncond_velocity else None)
        out = step_of(v)
        old_log_prob = batch.old_log_prob.to(dev)
        kl = None
        if ref_v is not None:
            kl = x_kl(out.mean, step_of(ref_v).mean, out.std) if a.resolved_kl_type() == "x-based" else v_kl(v, ref_v)
        terms = flow_grpo_loss(out.log_prob, old_log_prob, batch.advantages.to(dev),
                               clip_range=a.diffusion_clip_range, adv_clip_max=a.diffusion_adv_clip_max,
                               kl_beta=a.diffusion_kl_beta, kl=kl,
                               log_ratio=self.log_ratio(out, old_log_prob, old_mean))
        if step == 0:  # weights untouched yet: the rollout-vs-trainer log-prob agreement (float64, on the device)
            self._first_pass_diff += (out.log_prob.detach() - old_log_prob).abs().mean().double() * len(batch)
            self._first_pass_clipped += terms.clipfrac.double() * len(batch)
            self._first_pass_n += len(batch)
        stats = {"train/loss": terms.loss, "train/policy_loss": terms.policy_loss, "train/kl_loss": terms.kl_loss,
                 "train/approx_kl": terms.approx_kl, "train/clipfrac": terms.clipfrac,
                 "train/ratio_mean": terms.ratio.mean()}
        return terms.loss, detached(stats)

    def rollout_step_mean(self, step: int, velocity, step_of) -> torch.Tensor | None:
        """The step mean under the weights that sampled, where the loss needs it and they are not the live ones."""
        return None

    def log_ratio(self, out, old_log_prob: torch.Tensor, old_mean: torch.Tensor | None) -> torch.Tensor | None:
        """The log-ratio the clipped loss uses; None: log p_θ − log p_old."""
        return None

    def update_stats(self) -> dict[str, float | torch.Tensor]:
        if not self._first_pass_n:
            return {}
        # train/clipfrac averages every optimizer step; the first pass alone measures on-policy exactness.
        return {"train/log_prob_mean_abs_diff": self._first_pass_diff / self._first_pass_n,
                "train/first_pass_clipfrac": self._first_pass_clipped / self._first_pass_n}


class GrpoGuard(FlowGrpo):
    name = "grpo_guard"
    uses_rollout_weights = True  # μ_old of optimizer steps after the first

    def rollout_step_mean(self, step: int, velocity, step_of) -> torch.Tensor | None:
        if step == 0:  # the live weights sampled: μ_old is the loss's own forward's mean
            return None
        with torch.no_grad(), self.rollout_weights_in(step):
            return step_of(velocity()).mean

    def log_ratio(self, out, old_log_prob: torch.Tensor, old_mean: torch.Tensor | None) -> torch.Tensor:
        old_mean = out.mean.detach() if old_mean is None else old_mean
        return guard_log_ratio(out.log_prob, old_log_prob, out.std, out.mean, old_mean,
                               ratio_norm=self.cfg.grpo_guard.grpo_guard_ratio_norm)
