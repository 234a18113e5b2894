"""DiffusionNFT (arXiv 2509.16117): deterministic ODE rollouts (CFG-free by default) under the EMA old policy
θ_old; pairs are (x0, t, ε, A); the loss contrasts the implicit positive and negative policies
v± around v_old (`losses.nft_loss`), and θ_old follows θ with NFT's ramped decay after each rollout."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.algorithms.losses import ema_decay, nft_loss
from diffrl.algorithms.pairs import NftPairs, nft_pairs
from diffrl.sampling import noised
from diffrl.train.objectives.base import ForwardProcessObjective, detached


class DiffusionNft(ForwardProcessObjective):
    name = "nft"

    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        return 1 + super().forwards_without_grad(cfg)  # the old policy's velocity

    @property
    def rollout_ema(self):
        return self.policy.ema  # the old policy θ_old samples

    def rollout_guidance_scale(self) -> float:
        # Above 1 the old policy's guided samples are the data; the loss still trains the conditional velocity.
        return self.cfg.algorithm.nft_rollout_guidance_scale

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> NftPairs:
        """Pairs whose `cond` are rows of `env["cond_rows"]` (on the device)."""
        return self.re_noised_pairs(nft_pairs, samples, advantages, env)

    def loss(self, batch: NftPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, dev = self.cfg.algorithm, self.device
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        cond = env["cond_rows"][batch.cond.to(dev)]
        x_t = noised(x0, noise, t)
        # The old policy first, with no graph: swapping parameters after building v_θ's graph would corrupt it.
        with torch.no_grad(), self.policy.ema.swapped_in():
            v_old = self.conditional_velocity(x0, noise, t, cond, env)
        v_ref = None
        if a.diffusion_kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                v_ref = self.conditional_velocity(x0, noise, t, cond, env)
        v_theta = self.conditional_velocity(x0, noise, t, cond, env)
        terms = nft_loss(v_theta.float(), v_old, x_t, x0, t, batch.advantages.to(dev), beta=a.diffusion_nft_beta,
                         adv_clip_max=a.diffusion_adv_clip_max, adaptive_weighting=a.nft_adaptive_weighting,
                         kl_beta=a.diffusion_kl_beta, v_ref=v_ref)
        stats = {"train/loss": terms.loss, "train/nft_positive_loss": terms.positive_loss,
                 "train/nft_negative_loss": terms.negative_loss, "train/kl_loss": terms.kl_loss}
        return terms.loss, detached(stats)

    def after_update(self, k: int) -> None:
        a = self.cfg.algorithm
        with torch.no_grad():
            self.policy.ema.update(ema_decay(k, ramp=a.nft_ema_ramp, max_decay=a.nft_ema_max, flat=a.nft_ema_flat))
