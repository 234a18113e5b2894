"""Centered Reward Distillation (arXiv 2603.14128): ODE rollouts under a slow sampling snapshot of the weights
(the policy's EMA, `--crd-sampling-decay`); a train pair is a whole prompt group at one t and ε. The model's
implicit reward, how much less flow-matching error it makes than an old snapshot (`--crd-old-decay`), is
matched to the external reward after both are centered within the group (`losses.crd_loss`); an optional
KL to the base model (--diffusion-kl-beta, v-based), weighted by reward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.algorithms.losses import adaptive_mse, crd_loss, snapshot_decay, v_kl
from diffrl.algorithms.pairs import GroupPairs, group_pairs
from diffrl.train.ema import ParameterEMA
from diffrl.train.objectives.base import ForwardProcessObjective, detached
from diffrl.train.objectives.dpo import group_conditioning, group_rows


class CenteredRewardDistillation(ForwardProcessObjective):
    name = "crd"

    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        return 1 + super().forwards_without_grad(cfg)  # the old snapshot's error, the implicit reward's baseline

    def __init__(self, cfg, policy):
        super().__init__(cfg, policy)
        self.old = ParameterEMA(policy.params)  # the implicit reward's baseline, a checkpointed snapshot
        policy.extra_emas["crd_old"] = self.old

    @property
    def rollout_ema(self):
        return self.policy.ema  # the sampling snapshot

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> GroupPairs:
        return self.re_noised_pairs(group_pairs, samples, advantages, env, group_size=self.samples_per_pair)

    def loss(self, batch: GroupPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, c, dev = self.cfg.algorithm, self.cfg.crd, self.device
        x0, noise, t, cond = group_rows(batch, env["cond_rows"], dev)
        uncond = group_conditioning(batch, env.get("uncond_rows"), dev)
        target = (noise - x0).float()

        def velocity():
            return self.conditional_velocity(x0, noise, t, cond, env)

        # Other weights first, with no graph: swapping parameters after building v_θ's graph would corrupt it.
        with torch.no_grad(), self.old.swapped_in():
            old_err = adaptive_mse(velocity().float() - target)
        v_ref = None
        if a.diffusion_kl_beta > 0:
            with torch.no_grad(), self.policy.base_model():  # guided at --kl-cfg above 1: the teacher
                v_ref = self.reference_velocity(x0, noise, t, cond, uncond, env)
        v = velocity()
        shape = batch.advantages.shape
        err = adaptive_mse(v.float() - target)
        kl = v_kl(v, v_ref).view(shape) if v_ref is not None else None
        terms = crd_loss(err.view(shape), old_err.view(shape), batch.advantages.to(dev), beta=c.crd_beta,
                         adv_clip_max=a.diffusion_adv_clip_max, kind=c.crd_loss, kl=kl, kl_beta=a.diffusion_kl_beta,
                         reward_adaptive_kl=c.crd_reward_adaptive_kl)
        stats = {"train/loss": terms.loss, "train/policy_loss": terms.policy_loss, "train/kl_loss": terms.kl_loss,
                 "train/implicit_reward": terms.implicit_reward}
        return terms.loss, detached(stats)

    def after_update(self, k: int) -> None:
        c = self.cfg.crd
        self.old.update(snapshot_decay(k, c.crd_old_decay))
        self.policy.ema.update(snapshot_decay(k, c.crd_sampling_decay))
