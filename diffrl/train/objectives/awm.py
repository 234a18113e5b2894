"""Advantage Weighted Matching (arXiv 2509.25050): ODE rollouts under the current weights; each clean sample is
re-noised at the schedule's timesteps (as DiffusionNFT's pairs) and its flow-matching loss is weighted by its
advantage. The loss is PPO's clipped surrogate on ρ = exp(log p_θ − log p_old) with log p = −w(ℓ, t)
(`losses.awm_log_prob`); log p_old is the sampling weights' (the live ones at the first optimizer step, the
rollout's copy after it). Optional KL terms: to the base (--diffusion-kl-beta, v-based) and to an EMA of the
trained weights (--awm-ema-kl-beta), the stabilizer Flow-Factory recommends."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.algorithms.losses import awm_log_prob, awm_loss, flow_matching_error, v_kl
from diffrl.algorithms.pairs import NftPairs, nft_pairs
from diffrl.train.ema import warmed_up_decay
from diffrl.train.objectives.base import ForwardProcessObjective, detached


class AdvantageWeightedMatching(ForwardProcessObjective):
    name = "awm"
    uses_rollout_weights = True  # log p_old of optimizer steps after the first

    @classmethod
    def needs_ema(cls, cfg) -> bool:
        return cfg.awm.awm_ema_kl_beta > 0

    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        steps = cfg.optim.num_steps_per_rollout  # every optimizer step after the first replays the sampling weights
        return super().forwards_without_grad(cfg) + float(cfg.awm.awm_ema_kl_beta > 0) + (steps - 1) / steps

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> NftPairs:
        return self.re_noised_pairs(nft_pairs, samples, advantages, env)

    def _log_prob(self, v: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        w = self.cfg.awm
        return awm_log_prob(flow_matching_error(v, x0, noise), t, w.awm_weighting, w.awm_ghuber_power)

    def loss(self, batch: NftPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, w, dev = self.cfg.algorithm, self.cfg.awm, self.device
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        cond = env["cond_rows"][batch.cond.to(dev)]

        def velocity():
            return self.conditional_velocity(x0, noise, t, cond, env)

        # Other weights first, with no graph: swapping parameters after building v_θ's graph would corrupt it.
        old_log_prob = v_ref = v_ema = None
        if step > 0:
            with torch.no_grad(), self.rollout_weights_in(step):
                old_log_prob = self._log_prob(velocity(), x0, noise, t)
        if a.diffusion_kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                v_ref = velocity()
        if w.awm_ema_kl_beta > 0:
            with torch.no_grad(), self.policy.ema.swapped_in():
                v_ema = velocity()
        v = velocity()
        log_prob = self._log_prob(v, x0, noise, t)
        if old_log_prob is None:  # the live weights sampled this rollout
            old_log_prob = log_prob.detach()
        kl = v_kl(v, v_ref).mean() if v_ref is not None else torch.zeros((), device=dev)
        ema_kl = v_kl(v, v_ema).mean() if v_ema is not None else torch.zeros((), device=dev)
        terms = awm_loss(log_prob, old_log_prob, batch.advantages.to(dev), clip_range=a.diffusion_clip_range,
                         adv_clip_max=a.diffusion_adv_clip_max,
                         penalty=a.diffusion_kl_beta * kl + w.awm_ema_kl_beta * ema_kl)
        stats = {"train/loss": terms.loss, "train/policy_loss": terms.policy_loss, "train/kl_loss": kl,
                 "train/ema_kl_loss": ema_kl, "train/clipfrac": terms.clipfrac, "train/ratio_mean": terms.ratio.mean()}
        return terms.loss, detached(stats)

    def after_update(self, k: int) -> None:
        if self.cfg.awm.awm_ema_kl_beta > 0:
            self.policy.ema.update(awm_ema_decay(self.cfg.awm, k))


def awm_ema_decay(w, k: int) -> float:
    """The KL anchor's decay after rollout k (from 0) under --awm-ema-schedule (`AwmConfig`)."""
    if w.awm_ema_schedule == "linear":
        return w.awm_ema_decay * min(k / w.awm_ema_warmup, 1.0)
    if w.awm_ema_schedule == "power":
        return warmed_up_decay(w.awm_ema_decay, k + 1, w.awm_ema_warmup)  # min(d, (1 + k) / (W + k))
    return w.awm_ema_decay
