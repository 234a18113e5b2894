"""What every objective shares: the conditioning of a rollout's samples, the family's velocity, the request's size,
and (`ForwardProcessObjective`) what the methods on ODE samples share: the request for clean samples and the
conditional velocity at a re-noised x_t."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from diffrl.algorithms.methods import METHODS
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.sampling import noised
from diffrl.train.ema import ParameterEMA


def rollout_conditioning(samples, pad_text: bool = False, image_conditioned: bool = False) -> dict:
    """Per-sample prompt embeddings from each request's denoising env (sent once per request). With
    `pad_text` (the family's `pads_text`), prompts of different lengths are zero-padded to the longest.
    `image_conditioned` (the family's `accepts_image_conditioning`): the conditioning holds the condition images'
    tokens too, which is what a refusal then names."""
    cond, uncond, env, first = [], [], None, None
    for s in samples:
        env = s.output.denoising_env or env  # the first output of each microgroup carries it
        first = first or env
        for key in ("text_ids", "negative_text_ids"):
            if not pad_text and key in env and not torch.equal(env[key], first[key]):
                raise ValueError(_mixed_conditioning(len(first[key]), len(env[key]), s.prompt, image_conditioned))
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


def _mixed_conditioning(first: int, other: int, prompt: str, image_conditioned: bool) -> str:
    """Why the samples of one rollout cannot be trained as one batch: their conditioning differs in length."""
    if image_conditioned:
        return (f"the samples of one rollout have conditioning of {first} and {other} tokens ({prompt!r}): it holds "
                "the condition images' tokens, so sources of different sizes give different lengths, and training "
                "batches one length; give every condition image of the prompt set the same width and height "
                "(resize them to one size)")
    return (f"the prompts of one rollout have text windows of {first} and {other} tokens ({prompt!r}); training "
            "batches one window, so keep every prompt (and the negative prompt) within one window of the family")


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


def detached(stats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {key: value.detach() for key, value in stats.items()}


class Objective:
    """The policy it trains, the family's velocity, and the hooks the loop calls.

    `loss(batch, env, step)` gives the micro-batch's loss and its statistics as 0-dim tensors, left on the
    device: reading them there would make the host wait for the device at every micro-batch.
    `samples_per_pair`: samples one train pair holds (`pair_size`); the loop divides --micro-batch-size (counted
    in samples) by it."""

    name = ""  # the --loss-type, a key of algorithms.methods.METHODS
    rollout_ema = None  # the EMA the engines sample with (None: the current weights)

    def __init__(self, cfg, policy):
        self.cfg, self.policy = cfg, policy
        self.device = policy.device
        self.samples_per_pair = self.pair_size(cfg)
        # The weights the rollout sampled with, for the loss of optimizer steps after the first (whose weights
        # have moved): a copy taken before each rollout's updates, kept only when a rollout has several steps.
        needs_snapshot = self.uses_rollout_weights and cfg.optim.num_steps_per_rollout > 1
        self.rollout_weights = ParameterEMA(policy.params) if needs_snapshot else None

    uses_rollout_weights = False  # whether the loss compares with the weights that sampled (see rollout_weights)
    # Whether the loss replays rollout steps against the engine's log-probs (a ratio whose first pass must be 1): its
    # in-process engine then samples in the trainer's compiled graph (`EnginePoolConfig.engine_forward_graph`).
    replays_rollout_steps = False

    @classmethod
    def needs_ema(cls, cfg) -> bool:
        """Whether the method keeps an EMA of the trained weights (`Policy.ema`): its old policy, which samples."""
        return METHODS[cls.name].sampler == "old"

    @classmethod
    def needs_base_model(cls, cfg) -> bool:
        """Whether the loss reads the frozen starting weights (`Policy.base_model`), a KL term aside."""
        return METHODS[cls.name].reference

    @classmethod
    def pair_size(cls, cfg) -> int:
        """Samples one train pair holds: 1, a preference pair's 2, or a group row's whole group."""
        rows = METHODS[cls.name].rows
        return {"sample": 1, "preference": 2, "group": cfg.rollout.n_samples_per_prompt}[rows]

    @classmethod
    def hands_over_uncond(cls, cfg) -> bool:
        """Whether the run's configuration lets the rollout hand CFG's unconditional velocity to the first optimizer
        step (--reuse-rollout-uncond); the methods that replay no rollout step have none to take."""
        return False

    @classmethod
    def forwards_without_grad(cls, cfg) -> float:
        """Forwards without gradients the loss runs per sample of a train pair, beside the trained one: the KL
        reference here, and each method's own other weights (its old policy, its base model). The benchmarks'
        FLOP counts read it."""
        a = cfg.algorithm
        return float(a.diffusion_kl_beta > 0) * (2.0 if a.kl_cfg > 1 else 1.0)  # a guided reference: both halves

    @contextlib.contextmanager
    def rollout_weights_in(self, step: int):
        """The weights that sampled this rollout, inside the block (no-grad use only). At optimizer step 0 they
        are the live weights already."""
        if step == 0 or self.rollout_weights is None:
            yield
            return
        with self.rollout_weights.swapped_in():
            yield

    def _ids_to_device(self, env: dict) -> None:
        """The position ids on the device once per rollout, in place. Copied per micro-batch, each copy would be a
        new tensor, and the family's CFG check compares them on the device again (`FamilyAdapter._same_ids`
        remembers the last pair by identity): a wait for the device at every micro-batch."""
        for key in ("text_ids", "negative_text_ids", "image_ids"):
            env[key] = env[key].to(self.device)

    def _velocity(self, x, sigma, cond, uncond, guidance_scale, env, uncond_velocity=None):
        """The family's velocity for these rows; `uncond_velocity`: CFG's unconditional half as the rollout computed
        it under the live weights (`FamilyAdapter.velocity_and_uncond`), in place of its forward."""
        family = self.policy.family
        text_ids, negative_ids = env["text_ids"].to(self.device), env["negative_text_ids"].to(self.device)
        return family.velocity_and_uncond(
            family.transformer, Latents(x, env["image_ids"].to(self.device)), sigma,
            PromptEmbeds(cond, text_ids), PromptEmbeds(uncond, negative_ids) if uncond is not None else None,
            guidance_scale, uncond_velocity=uncond_velocity, **(self._second_expert() if uncond is not None else {}),
        )[0]

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

    def pairs_per_sample(self, pairs) -> int:
        """How many consecutive pairs one sample made, kept together in one optimizer step (the trainer splits a
        rollout's optimizer steps by samples then); 1: any pair may go to any step."""
        return 1

    def micro_batch_key(self, pairs) -> torch.Tensor | None:
        """Per pair, a host value the trainer keeps constant within a micro-batch (it orders each optimizer step's
        pairs by it and cuts where it changes: `micro_batch_bounds`), so `loss` may treat it as one value; None: any
        mix of pairs."""
        return None

    def start_update(self) -> None:
        """Before a rollout's optimizer steps (subclasses call it: it keeps the rollout's weights when needed)."""
        if self.rollout_weights is not None:
            self.rollout_weights.update(0.0)  # a copy of the weights that just sampled

    def update_stats(self) -> dict[str, float | torch.Tensor]:
        """After them: statistics gathered across the micro-batches (0-dim float64 tensors are read back by the
        trainer, with the others)."""
        return {}

    def after_update(self, k: int) -> None:
        """After rollout k's optimizer steps."""

    def after_optimizer_step(self, steps: int) -> None:
        """After each optimizer step that was taken; `steps`: the run's count of them so far (resumes with the run)."""


class ForwardProcessObjective(Objective):
    """The methods trained on re-noised clean samples: ODE rollouts, only the final latent kept, and the
    conditional velocity at x_t = (1 − t)·x0 + t·ε (CFG-free in training whatever the rollout's CFG)."""

    def rollout_guidance_scale(self) -> float:
        return self.cfg.rollout.diffusion_guidance_scale

    def request(self, k: int) -> dict:
        n_steps, scale = self.cfg.rollout.diffusion_num_steps, self.rollout_guidance_scale()
        guided_reference = {"rollout_return_negative_env": True} if self.cfg.algorithm.kl_cfg > 1 else {}
        return self._sized(dict(num_inference_steps=n_steps, guidance_scale=scale,
                                **(self._second_expert() if scale > 1 else {}),
                                rollout=False, rollout_return_dit_trajectory=True,
                                rollout_return_step_indices=[n_steps], rollout_return_denoising_env=True,
                                **guided_reference))

    def re_noised_pairs(self, build, samples: Sequence, advantages: torch.Tensor, env: dict, **options):
        """`build(x0, seeds, sigmas, advantages, conds, …)` (algorithms/pairs.py) over the samples' clean latents,
        with the schedule's timesteps and the pairs' `cond` as rows of `env["cond_rows"]` (on the device).
        `env["cond"]` holds one conditioning per sample."""
        env["cond_rows"], cond = conditioning_rows(env["cond"], self.device)
        if self.cfg.algorithm.kl_cfg > 1:  # the guided reference's negative conditioning, row for row with cond_rows
            if any(s.output.denoising_env is not None and "negative_prompt_embeds" not in s.output.denoising_env
                   for s in samples):
                raise RuntimeError("--kl-cfg: the engine returned no negative conditioning for an unguided rollout "
                                   "(an sglang server drops diffrl's rollout_return_negative_env); use diffrl engines")
            first = {}
            for sample, row in enumerate(cond):
                first.setdefault(int(row), sample)
            env["uncond_rows"] = torch.stack([env["uncond"][first[r]] for r in range(len(first))]).to(self.device)
        self._ids_to_device(env)
        x0 = torch.stack([s.output.dit_trajectory.latents[0] for s in samples])
        return build(x0, [s.seed for s in samples], samples[0].output.dit_trajectory.sigmas, advantages, cond,
                     timesteps=self.cfg.algorithm.timestep_choice(), **options)

    def conditional_velocity(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
                             env: dict) -> torch.Tensor:
        """v(x_t, t | prompt) at x_t = (1 − t)·x0 + t·ε, for the policy's current weights (the caller picks others
        by swapping them in)."""
        return self._velocity(noised(x0, noise, t), t, cond, None, 1.0, env)

    def reference_velocity(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, cond: torch.Tensor,
                           uncond: torch.Tensor | None, env: dict) -> torch.Tensor:
        """The velocity a guided KL reference compares with (--kl-cfg), for the weights swapped in by the caller: with
        CFG at that scale above 1 (`uncond`: the negative conditioning's rows, as `cond`'s), else conditional."""
        scale = self.cfg.algorithm.kl_cfg
        if scale <= 1:
            return self.conditional_velocity(x0, noise, t, cond, env)
        return self._velocity(noised(x0, noise, t), t, cond, uncond, scale, env)
