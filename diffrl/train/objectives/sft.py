"""Reward-filtered fine-tuning (RAFT, arXiv 2304.06767; rejection sampling): ODE rollouts under the current
weights at the rollout's CFG; the samples that beat their prompt's mean reward (advantage > 0) become
flow-matching data, (x0, t, ε) at the schedule's timesteps; the loss is the plain flow-matching MSE of the
conditional velocity (plus the v-based KL to the reference with --diffusion-kl-beta)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.algorithms.losses import sft_loss, v_kl
from diffrl.algorithms.pairs import NftPairs, nft_pairs
from diffrl.train.objectives.base import ForwardProcessObjective, detached


class RewardFilteredSft(ForwardProcessObjective):
    name = "sft"


    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> NftPairs:
        """Only the samples above their prompt's mean are data (none of a group whose rewards are equal); their
        `cond` are rows of `env["cond_rows"]`."""
        better = [i for i in range(len(samples)) if advantages[i] > 0]
        if not better:
            return NftPairs(*(torch.empty(0) for _ in range(5)))
        env["cond"] = [env["cond"][i] for i in better]
        return self.re_noised_pairs(nft_pairs, [samples[i] for i in better], advantages[better], env)

    def loss(self, batch: NftPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev, kl_beta = self.device, self.cfg.algorithm.diffusion_kl_beta
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        cond = env["cond_rows"][batch.cond.to(dev)]
        v_ref = None
        if kl_beta > 0:  # the reference first, with no graph: swapping after v_θ's graph is built would corrupt it
            with torch.no_grad(), self.policy.reference():
                v_ref = self.conditional_velocity(x0, noise, t, cond, env)
        v = self.conditional_velocity(x0, noise, t, cond, env)
        loss = sft_loss(v, x0, noise)
        stats = {"train/loss": loss}
        if v_ref is not None:
            kl = v_kl(v, v_ref).mean()
            loss = loss + kl_beta * kl
            stats = {"train/loss": loss, "train/kl_loss": kl}
        return loss, detached(stats)
