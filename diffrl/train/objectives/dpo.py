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

from diffrl.algorithms.losses import dgpo_clip_mask, dgpo_loss, dpo_loss, flow_matching_error, v_kl
from diffrl.algorithms.pairs import GroupPairs, PreferencePairs, group_pairs, preference_pairs
from diffrl.train.ema import ParameterEMA
from diffrl.train.objectives.base import ForwardProcessObjective, detached


class _AgainstBase(ForwardProcessObjective):
    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        # The base model's velocity; a KL term (--diffusion-kl-beta) against the base reuses it.
        a = cfg.algorithm
        base = 2.0 if a.kl_cfg > 1 else 1.0  # guided at --kl-cfg: both halves
        return base + float(a.diffusion_kl_beta > 0 and a.kl_reference == "ema")

    def base_and_kl_reference(self, velocity, base_velocity=None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base model's velocity (`base_velocity`, else `velocity`: DGPO's is guided at --kl-cfg) and the KL term's
        reference velocity (None without --diffusion-kl-beta), with no graph: the one forward when the KL reference is
        the base. Run first: swapping parameters after v_θ's graph is built would corrupt it."""
        a = self.cfg.algorithm
        with torch.no_grad():
            with self.policy.base_model():
                v_base = (base_velocity or velocity)()
            if a.diffusion_kl_beta <= 0:
                return v_base, None
            if a.kl_reference == "base":
                return v_base, v_base
            with self.policy.reference():
                return v_base, velocity()

    def kl_term(self, v: torch.Tensor, v_ref: torch.Tensor | None, frozen: torch.Tensor | None = None) -> torch.Tensor:
        """`mean(v_kl)` per sample (zeros without a reference); `frozen` samples pass no gradient through it."""
        if v_ref is None:
            return v.new_zeros(v.shape[0], dtype=torch.float32)
        kl = v_kl(v, v_ref)
        return kl if frozen is None else torch.where(frozen, kl.detach(), kl)


class DiffusionDpo(_AgainstBase):
    name = "dpo"

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> PreferencePairs:
        return self.re_noised_pairs(preference_pairs, samples, advantages, env,
                                    group_size=self.cfg.rollout.n_samples_per_prompt)

    def loss(self, batch: PreferencePairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev, n, kl_beta = self.device, len(batch), self.cfg.algorithm.diffusion_kl_beta
        x0 = torch.cat([batch.chosen.to(dev), batch.rejected.to(dev)])  # one forward for both
        noise, t = batch.noise.to(dev).repeat(2, *([1] * (x0.ndim - 1))), batch.t.to(dev).repeat(2)
        cond = env["cond_rows"][batch.cond.to(dev)].repeat(2, *([1] * (env["cond_rows"].ndim - 1)))

        def velocity():
            return self.conditional_velocity(x0, noise, t, cond, env)

        v_base, v_ref = self.base_and_kl_reference(velocity)
        v = velocity()
        ref, err = flow_matching_error(v_base, x0, noise), flow_matching_error(v, x0, noise)
        terms = dpo_loss(err[:n], err[n:], ref[:n], ref[n:], beta=self.cfg.dpo.dpo_beta)
        kl = self.kl_term(v, v_ref).mean()
        loss = terms.loss + kl_beta * kl
        stats = {"train/loss": loss, "train/implicit_accuracy": terms.implicit_accuracy,
                 "train/preference_margin": terms.margin, "train/chosen_error": err[:n].mean(),
                 "train/rejected_error": err[n:].mean(), "train/kl_loss": kl}
        return loss, detached(stats)


def group_rows(batch: GroupPairs, cond_rows: torch.Tensor, device) -> tuple[torch.Tensor, ...]:
    """A micro-batch of group pairs as one batch of samples: x0, ε, t and conditioning per sample (`[P·n, …]`)."""
    x0 = batch.x0.to(device)
    groups, size = x0.shape[:2]
    flat = x0.flatten(0, 1)
    noise = batch.noise.to(device).repeat_interleave(size, dim=0)
    t = batch.t.to(device).repeat_interleave(size)
    return flat, noise, t, group_conditioning(batch, cond_rows, device)


def group_conditioning(batch: GroupPairs, rows: torch.Tensor | None, device) -> torch.Tensor | None:
    """Per sample of a micro-batch of group pairs, its row of `rows` (the conditioning, or the negative one)."""
    if rows is None:
        return None
    return rows[batch.cond.to(device)].repeat_interleave(batch.x0.shape[1], dim=0)


class GroupPreference(_AgainstBase):
    """DGPO. With the reference code's options (`DgpoConfig`) it keeps an old policy, a fast EMA of the weights
    stepped once per optimizer step (decay min(max, ramp·steps)), which can clip each sample's error PPO-style
    (--dgpo-clip-dsm, and the KL term with --dgpo-clip-kl), stand in for the base model as the preference's
    reference (--dgpo-use-ema-ref), and sample the rollouts after --dgpo-switch-ema-ref optimizer steps."""

    name = "dgpo"

    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        g = cfg.dgpo
        base = not g.dgpo_use_ema_ref or cfg.algorithm.diffusion_kl_beta > 0
        return float(base) * super().forwards_without_grad(cfg) + float(g.keeps_old_policy())

    def __init__(self, cfg, policy):
        super().__init__(cfg, policy)
        self.old = ParameterEMA(policy.params) if cfg.dgpo.keeps_old_policy() else None
        if self.old is not None:
            policy.extra_emas["dgpo_old"] = self.old  # saved with the checkpoint: a resumed run goes on from it

    @property
    def rollout_ema(self):
        switch = self.cfg.dgpo.dgpo_switch_ema_ref
        if self.old is not None and switch is not None and self.policy.weight_version > switch:
            return self.old
        return None

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> GroupPairs:
        return self.re_noised_pairs(group_pairs, samples, advantages, env, group_size=self.samples_per_pair)

    def loss(self, batch: GroupPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, g = self.cfg.algorithm, self.cfg.dgpo
        x0, noise, t, cond = group_rows(batch, env["cond_rows"], self.device)
        uncond = group_conditioning(batch, env.get("uncond_rows"), self.device)
        shape, adv = batch.advantages.shape, batch.advantages.to(self.device)

        def velocity():
            return self.conditional_velocity(x0, noise, t, cond, env)

        def reference():  # the base model's, guided at --kl-cfg above 1 (the reference code's ref_v)
            return self.reference_velocity(x0, noise, t, cond, uncond, env)

        # Every other weights' velocity first, with no graph (see base_and_kl_reference).
        v_old = None
        if self.old is not None:
            with torch.no_grad(), self.old.swapped_in():
                v_old = velocity()
        v_base, v_ref = (None, None)
        if not g.dgpo_use_ema_ref or a.diffusion_kl_beta > 0:
            v_base, v_ref = self.base_and_kl_reference(velocity, reference)
        v = velocity()
        err = flow_matching_error(v, x0, noise).view(shape)
        ref_err = flow_matching_error(v_old if g.dgpo_use_ema_ref else v_base, x0, noise).view(shape)
        clipped = None
        if g.dgpo_clip_dsm or g.dgpo_clip_kl:
            clipped = dgpo_clip_mask(err, flow_matching_error(v_old, x0, noise).view(shape), adv,
                                     clip_range=a.diffusion_clip_range, adv_clip_max=a.diffusion_adv_clip_max)
        terms = dgpo_loss(err, ref_err, adv, beta=g.dgpo_beta, adv_clip_max=a.diffusion_adv_clip_max,
                          frozen=clipped if g.dgpo_clip_dsm else None)
        kl = self.kl_term(v, v_ref, frozen=clipped.flatten() if g.dgpo_clip_kl else None).mean()
        loss = terms.loss + a.diffusion_kl_beta * kl
        stats = {"train/loss": loss, "train/implicit_accuracy": terms.implicit_accuracy,
                 "train/preference_margin": terms.margin, "train/kl_loss": kl}
        if clipped is not None:
            stats["train/clipfrac"] = clipped.float().mean()
        return loss, detached(stats)

    def after_optimizer_step(self, steps: int) -> None:
        if self.old is not None:
            g = self.cfg.dgpo
            self.old.update(min(g.dgpo_ema_ref_max_decay, g.dgpo_ema_ref_ramp_rate * steps))
