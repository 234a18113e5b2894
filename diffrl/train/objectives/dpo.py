"""Preference methods against the frozen base model, on ODE rollouts under the current weights:

- `dpo`, online Diffusion-DPO (arXiv 2311.12908): each prompt group's best and worst sample (by advantage) are a
  chosen / rejected pair, re-noised with one t and one ε; Bradley–Terry on their flow-matching errors relative
  to the base model's (`losses.dpo_loss`).
- `dgpo`, Direct Group Preference Optimization (arXiv 2510.08425): every sample of a group at one t and ε; the
  group's positive-advantage samples are preferred to its negative ones, each weighted by |A|
  (`losses.dgpo_loss`). A train pair is a whole group, so one optimizer step always sees complete groups.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.algorithms.losses import dgpo_loss, dpo_loss, flow_matching_error
from diffrl.algorithms.pairs import GroupPairs, PreferencePairs, group_pairs, preference_pairs
from diffrl.train.objectives.base import ForwardProcessObjective, detached


class _AgainstBase(ForwardProcessObjective):
    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        return 1.0  # the base model's error; the loss itself is relative to the base, with no separate KL term

    def errors(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
               env: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Flow-matching errors of the base model (no graph) and of the current weights, per sample."""
        with torch.no_grad(), self.policy.base_model():  # first: swapping after v_θ's graph is built would corrupt it
            ref = flow_matching_error(self.conditional_velocity(x0, noise, t, cond, env), x0, noise)
        return ref, flow_matching_error(self.conditional_velocity(x0, noise, t, cond, env), x0, noise)


class DiffusionDpo(_AgainstBase):
    name = "dpo"

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> PreferencePairs:
        return self.re_noised_pairs(preference_pairs, samples, advantages, env,
                                    group_size=self.cfg.rollout.n_samples_per_prompt)

    def loss(self, batch: PreferencePairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev, n = self.device, len(batch)
        x0 = torch.cat([batch.chosen.to(dev), batch.rejected.to(dev)])  # one forward for both
        noise, t = batch.noise.to(dev).repeat(2, *([1] * (x0.ndim - 1))), batch.t.to(dev).repeat(2)
        cond = env["cond_rows"][batch.cond.to(dev)].repeat(2, *([1] * (env["cond_rows"].ndim - 1)))
        ref, err = self.errors(x0, noise, t, cond, env)
        terms = dpo_loss(err[:n], err[n:], ref[:n], ref[n:], beta=self.cfg.dpo.dpo_beta)
        stats = {"train/loss": terms.loss, "train/implicit_accuracy": terms.implicit_accuracy,
                 "train/preference_margin": terms.margin, "train/chosen_error": err[:n].mean(),
                 "train/rejected_error": err[n:].mean()}
        return terms.loss, detached(stats)


def group_rows(batch: GroupPairs, cond_rows: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
    """A micro-batch of group pairs as one batch of samples: x0, ε, t and conditioning per sample (`[P·n, …]`)."""
    x0 = batch.x0.to(device)
    groups, size = x0.shape[:2]
    flat = x0.flatten(0, 1)
    noise = batch.noise.to(device).repeat_interleave(size, dim=0)
    t = batch.t.to(device).repeat_interleave(size)
    cond = cond_rows[batch.cond.to(device)].repeat_interleave(size, dim=0)
    return flat, noise, t, cond


class GroupPreference(_AgainstBase):
    name = "dgpo"

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> GroupPairs:
        return self.re_noised_pairs(group_pairs, samples, advantages, env, group_size=self.samples_per_pair)

    def loss(self, batch: GroupPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x0, noise, t, cond = group_rows(batch, env["cond_rows"], self.device)
        ref, err = self.errors(x0, noise, t, cond, env)
        shape = batch.advantages.shape
        terms = dgpo_loss(err.view(shape), ref.view(shape), batch.advantages.to(self.device),
                          beta=self.cfg.dgpo.dgpo_beta, adv_clip_max=self.cfg.algorithm.diffusion_adv_clip_max)
        stats = {"train/loss": terms.loss, "train/implicit_accuracy": terms.implicit_accuracy,
                 "train/preference_margin": terms.margin}
        return terms.loss, detached(stats)
