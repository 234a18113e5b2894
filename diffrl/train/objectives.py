"""One objective per loss type: what a rollout asks the engines for, which train pairs it makes, and
the loss of one micro-batch of them (DESIGN §4). The loop (`trainer.py`) runs any of them alike.

- `flow_grpo`: SDE on a window of steps (the rest ODE) with CFG; pairs are the windowed transitions
  (x_t, x_t', σ, σ', log p_old, A); the loss is the clipped ratio, plus an optional KL to the
  reference. The trainer replays each step through the family's `velocity` and the shared
  transition kernel, exactly as the engine ran it, so an on-policy first pass has ratio 1.
- `nft` (DiffusionNFT): deterministic ODE rollouts (CFG-free by default) under the EMA old policy;
  pairs are (x0, t, ε, r); the loss contrasts the implicit positive and negative policies.
- `sft` (reward-filtered fine-tuning, as RAFT / rejection sampling): ODE rollouts under the current
  weights at the rollout's CFG; the samples that beat their prompt's mean reward (advantage > 0)
  become flow-matching data, (x0, t, ε) at the schedule's timesteps; the loss is the plain
  flow-matching MSE of the conditional velocity.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from diffrl.algorithms.losses import ema_decay, flow_grpo_loss, nft_loss, sft_loss
from diffrl.algorithms.pairs import GrpoPairs, NftPairs, grpo_pairs, nft_pairs
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.sampling import noised, transition


def rollout_conditioning(samples, pad_text: bool = False) -> dict:
    """Per-sample prompt embeddings from each request's denoising env (sent once per request). With
    `pad_text` (the family's `pads_text`), prompts of different lengths are zero-padded to the longest."""
    cond, uncond, env, first = [], [], None, None
    for s in samples:
        env = s.output.denoising_env or env  # the first output of each microgroup carries it
        first = first or env
        for key in ("text_ids", "negative_text_ids"):
            if not pad_text and key in env and not torch.equal(env[key], first[key]):
                raise ValueError(f"the prompts of one rollout have text windows of {len(first[key])} and "
                                 f"{len(env[key])} tokens ({s.prompt!r}); training batches one window, so keep "
                                 "every prompt (and the negative prompt) within one window of the family")
        cond.append(env["prompt_embeds"][0])
        negative = env.get("negative_prompt_embeds")
        uncond.append(negative[0] if negative is not None else torch.zeros_like(env["prompt_embeds"][0]))
    if pad_text:
        longest = max(e.shape[0] for e in cond + uncond)
        cond, uncond = ([torch.nn.functional.pad(e, (0, 0, 0, longest - e.shape[0])) for e in part]
                        for part in (cond, uncond))
        ids = env["text_ids"].new_zeros(longest, env["text_ids"].shape[1])
        return {"cond": cond, "uncond": uncond, "text_ids": ids, "image_ids": env["image_ids"],
                "negative_text_ids": ids}
    return {"cond": cond, "uncond": uncond, "text_ids": env["text_ids"], "image_ids": env["image_ids"],
            "negative_text_ids": env.get("negative_text_ids", env["text_ids"])}


def conditioning_rows(tensors: Sequence[torch.Tensor], device: torch.device | str) -> tuple[torch.Tensor, list]:
    """The distinct conditionings of `tensors` stacked on `device`, and each tensor's row in it. Samples of one
    request hold views of its one conditioning (same memory, shape and strides): they share a row. Train pairs
    then carry a row index instead of a copy of their prompt's embeddings (SD3 at 512²: 5.5 MB per pair and
    CFG half), so the embeddings are neither stacked per pair on the host nor copied to the device per
    micro-batch; a micro-batch gathers its rows on the device (the same values, bit for bit)."""
    rows, index, seen = [], [], {}
    for t in tensors:
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        if key not in seen:
            seen[key] = len(rows)
            rows.append(t)
        index.append(torch.tensor(seen[key]))
    return torch.stack(rows).to(device), index


def _detached(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in stats.items()}


class _Objective:
    """What both objectives share: the policy they train and the family's velocity.

    `loss(batch, env, step)` gives the micro-batch's loss and its statistics as 0-dim tensors, left on the
    device: reading them there would make the host wait for the device at every micro-batch."""

    def __init__(self, cfg, policy):
        self.cfg, self.policy = cfg, policy
        self.device = policy.device

    def _ids_to_device(self, env: dict) -> None:
        """The position ids on the device once per rollout, in place. Copied per micro-batch, each copy would be a
        new tensor, and the family's CFG check compares them on the device again (`FamilyAdapter._same_ids`
        remembers the last pair by identity): a wait for the device at every micro-batch."""
        for key in ("text_ids", "negative_text_ids", "image_ids"):
            env[key] = env[key].to(self.device)

    def _velocity(self, x, sigma, cond, uncond, guidance_scale, env):
        family = self.policy.family
        text_ids, negative_ids = env["text_ids"].to(self.device), env["negative_text_ids"].to(self.device)
        return family.velocity(
            family.transformer, Latents(x, env["image_ids"].to(self.device)), sigma,
            PromptEmbeds(cond, text_ids), PromptEmbeds(uncond, negative_ids) if uncond is not None else None,
            guidance_scale, **(self._second_expert() if uncond is not None else {}),
        )

    def _second_expert(self) -> dict:
        """The second expert's CFG scale, for requests and the replay, when the run sets one."""
        scale = self.cfg.rollout.diffusion_guidance_scale_2
        return {} if scale is None else {"guidance_scale_2": scale}

    def _sized(self, request: dict) -> dict:
        m, r = self.cfg.model, self.cfg.rollout
        size = m.size()
        if size is not None:
            request.update(height=size[0], width=size[1])
        if m.num_frames is not None:
            request.update(num_frames=m.num_frames)
        if r.negative_prompt:
            request.update(negative_prompt=r.negative_prompt)
        return request

    def start_update(self) -> None:
        """Before a rollout's optimizer steps."""

    def update_stats(self) -> dict[str, float | torch.Tensor]:
        """After them: statistics gathered across the micro-batches (0-dim float64 tensors are read back by the
        trainer, with the others)."""
        return {}

    def after_update(self, k: int) -> None:
        """After rollout k's optimizer steps."""


class FlowGrpo(_Objective):
    rollout_ema = None  # rolls out with the current weights (on-policy)

    def sde_window(self, k: int) -> list[int]:
        """Rollout k's SDE steps, ascending: --diffusion-num-sde-steps consecutive steps at a start drawn in the
        window, or (--diffusion-sde-step-strategy random) as many distinct steps drawn anywhere in it."""
        r = self.cfg.rollout
        lo, hi = r.sde_window_range()
        width = r.diffusion_num_sde_steps
        rng = np.random.default_rng([self.cfg.seed, k, 1])
        if r.diffusion_sde_step_strategy == "random":
            return sorted(int(i) for i in rng.choice(np.arange(lo, hi), size=width, replace=False))
        start = int(rng.integers(lo, hi - width + 1))
        return list(range(start, start + width))

    def request(self, k: int) -> dict:
        r = self.cfg.rollout
        self.window = self.sde_window(k)
        return self._sized(dict(num_inference_steps=r.diffusion_num_steps, guidance_scale=r.diffusion_guidance_scale,
                                **self._second_expert(), rollout=True, rollout_sde_type=r.diffusion_sde_type,
                                rollout_noise_level=r.diffusion_noise_level, rollout_sde_step_indices=self.window,
                                rollout_return_dit_trajectory=True, rollout_return_denoising_env=True))

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
                          cond, uncond, self.window)

    def start_update(self) -> None:
        self._first_pass_diff, self._first_pass_clipped, self._first_pass_n = 0.0, 0.0, 0

    def loss(self, batch: GrpoPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        r, a, dev = self.cfg.rollout, self.cfg.algorithm, self.device
        guidance = r.diffusion_guidance_scale
        x, x_next = batch.x.to(dev), batch.x_next.to(dev)
        sigma, sigma_next = batch.sigma.to(dev), batch.sigma_next.to(dev)
        cond = env["cond_rows"][batch.cond.to(dev)]
        uncond = env["uncond_rows"][batch.uncond.to(dev)] if guidance > 1.0 else None

        def step_of(v):  # the engine's transition, scoring the rollout's x_next instead of drawing one
            return transition(r.diffusion_sde_type, x, v, sigma, sigma_next, r.diffusion_noise_level,
                              sigma_max=self.sigma_max, next_latents=x_next)

        ref_mean = None
        if a.diffusion_kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                ref_mean = step_of(self._velocity(x, sigma, cond, uncond, guidance, env)).mean
        # The family's forward precision is the engine's too, so the first pass reproduces its log-probs
        # (exactly in fp32; bf16 kernels may round differently at the trainer's batch size).
        out = step_of(self._velocity(x, sigma, cond, uncond, guidance, env))
        old_log_prob = batch.old_log_prob.to(dev)
        terms = flow_grpo_loss(out.log_prob, old_log_prob, batch.advantages.to(dev),
                               clip_range=a.diffusion_clip_range, adv_clip_max=a.diffusion_adv_clip_max,
                               kl_beta=a.diffusion_kl_beta, mean=out.mean, ref_mean=ref_mean, std=out.std)
        if step == 0:  # weights untouched yet: the rollout-vs-trainer log-prob agreement (float64, on the device)
            self._first_pass_diff += (out.log_prob.detach() - old_log_prob).abs().mean().double() * len(batch)
            self._first_pass_clipped += terms.clipfrac.double() * len(batch)
            self._first_pass_n += len(batch)
        stats = {"train/loss": terms.loss, "train/policy_loss": terms.policy_loss, "train/kl_loss": terms.kl_loss,
                 "train/approx_kl": terms.approx_kl, "train/clipfrac": terms.clipfrac,
                 "train/ratio_mean": terms.ratio.mean()}
        return terms.loss, _detached(stats)

    def update_stats(self) -> dict[str, float | torch.Tensor]:
        if not self._first_pass_n:
            return {}
        # train/clipfrac averages every optimizer step; the first pass alone measures on-policy exactness.
        return {"train/log_prob_mean_abs_diff": self._first_pass_diff / self._first_pass_n,
                "train/first_pass_clipfrac": self._first_pass_clipped / self._first_pass_n}


class DiffusionNft(_Objective):
    @property
    def rollout_ema(self):
        return self.policy.ema  # the old policy θ_old samples

    def request(self, k: int) -> dict:
        n_steps, scale = self.cfg.rollout.diffusion_num_steps, self.cfg.algorithm.nft_rollout_guidance_scale
        # Deterministic ODE (CFG-free by default) under the old policy; only the final latent is kept. With CFG, a
        # second expert runs at its own scale.
        return self._sized(dict(num_inference_steps=n_steps, guidance_scale=scale,
                                **(self._second_expert() if scale > 1 else {}),
                                rollout=False, rollout_return_dit_trajectory=True,
                                rollout_return_step_indices=[n_steps], rollout_return_denoising_env=True))

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> NftPairs:
        """Pairs whose `cond` are rows of `env["cond_rows"]` (on the device)."""
        x0 = torch.stack([s.output.dit_trajectory.latents[0] for s in samples])
        env["cond_rows"], cond = conditioning_rows(env["cond"], self.device)
        self._ids_to_device(env)
        return nft_pairs(x0, [s.seed for s in samples], samples[0].output.dit_trajectory.sigmas, advantages,
                         cond, timestep_fraction=self.cfg.algorithm.nft_timestep_fraction)

    def loss(self, batch: NftPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        a, dev = self.cfg.algorithm, self.device
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        cond = env["cond_rows"][batch.cond.to(dev)]
        x_t = noised(x0, noise, t)
        # The old policy first, with no graph: swapping parameters after building v_θ's graph would corrupt it.
        with torch.no_grad(), self.policy.ema.swapped_in():
            v_old = self._velocity(x_t, t, cond, None, 1.0, env)
        v_ref = None
        if a.diffusion_kl_beta > 0:
            with torch.no_grad(), self.policy.reference():
                v_ref = self._velocity(x_t, t, cond, None, 1.0, env)
        v_theta = self._velocity(x_t, t, cond, None, 1.0, env)
        terms = nft_loss(v_theta.float(), v_old, x_t, x0, t, batch.advantages.to(dev), beta=a.diffusion_nft_beta,
                         adv_clip_max=a.diffusion_adv_clip_max, adaptive_weighting=a.nft_adaptive_weighting,
                         kl_beta=a.diffusion_kl_beta, v_ref=v_ref)
        stats = {"train/loss": terms.loss, "train/nft_positive_loss": terms.positive_loss,
                 "train/nft_negative_loss": terms.negative_loss, "train/kl_loss": terms.kl_loss}
        return terms.loss, _detached(stats)

    def after_update(self, k: int) -> None:
        a = self.cfg.algorithm
        with torch.no_grad():
            self.policy.ema.update(ema_decay(k, ramp=a.nft_ema_ramp, max_decay=a.nft_ema_max, flat=a.nft_ema_flat))


class RewardFilteredSft(_Objective):
    rollout_ema = None  # on-policy: the current weights sample

    def request(self, k: int) -> dict:
        r = self.cfg.rollout
        return self._sized(dict(num_inference_steps=r.diffusion_num_steps, guidance_scale=r.diffusion_guidance_scale,
                                **self._second_expert(), rollout=False, rollout_return_dit_trajectory=True,
                                rollout_return_step_indices=[r.diffusion_num_steps], rollout_return_denoising_env=True))

    def pairs(self, samples: Sequence, advantages: torch.Tensor, env: dict) -> NftPairs:
        """Only the samples above their prompt's mean are data (none of a group whose rewards are equal); their
        `cond` are rows of `env["cond_rows"]`."""
        better = [i for i in range(len(samples)) if advantages[i] > 0]
        x0 = torch.stack([samples[i].output.dit_trajectory.latents[0] for i in better]) if better else None
        if x0 is None:
            return NftPairs(*(torch.empty(0) for _ in range(5)))
        env["cond_rows"], cond = conditioning_rows([env["cond"][i] for i in better], self.device)
        self._ids_to_device(env)
        return nft_pairs(x0, [samples[i].seed for i in better], samples[0].output.dit_trajectory.sigmas,
                         advantages[better], cond, timestep_fraction=self.cfg.algorithm.nft_timestep_fraction)

    def loss(self, batch: NftPairs, env: dict, step: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        dev = self.device
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        x_t = noised(x0, noise, t)
        loss = sft_loss(self._velocity(x_t, t, env["cond_rows"][batch.cond.to(dev)], None, 1.0, env), x0, noise)
        return loss, {"train/loss": loss.detach()}


OBJECTIVES = {"flow_grpo": FlowGrpo, "nft": DiffusionNft, "sft": RewardFilteredSft}


def build_objective(cfg, policy) -> FlowGrpo | DiffusionNft | RewardFilteredSft:
    return OBJECTIVES[cfg.algorithm.loss_type](cfg, policy)
