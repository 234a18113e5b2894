"""Reward-filtered fine-tuning (RAFT, arXiv 2304.06767; rejection sampling): ODE rollouts under the current
weights at the rollout's CFG; the samples that beat their prompt's mean reward (advantage > 0) become
flow-matching data, (x0, t, ε) at the schedule's timesteps; the loss is the plain flow-matching MSE of the
conditional velocity."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.algorithms.losses import sft_loss
from diffrl.algorithms.pairs import NftPairs, nft_pairs
from diffrl.train.objectives.base import ForwardProcessObjective


class RewardFilteredSft(ForwardProcessObjective):
    name = "sft"

    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        return 0.0  # plain flow matching: no KL term, no other weights

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> NftPairs:
        """Only the samples above their prompt's mean are data (none of a group whose rewards are equal); their
        `cond` are rows of `env["cond_rows"]`."""
        better = [i for i in range(len(samples)) if advantages[i] > 0]
        if not better:
            return NftPairs(*(torch.empty(0) for _ in range(5)))
        env["cond"] = [env["cond"][i] for i in better]
        return self.re_noised_pairs(nft_pairs, [samples[i] for i in better], advantages[better], env)

    def loss(self, batch: NftPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = self.device
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        loss = sft_loss(self.conditional_velocity(x0, noise, t, env["cond_rows"][batch.cond.to(dev)], env), x0, noise)
        return loss, {"train/loss": loss.detach()}
