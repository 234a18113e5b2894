"""`diffrl train`: the RL loop, readable top to bottom.

    for each rollout:
        prompts → RolloutManager (engine in-process, shares the trained module) → scored samples
        rewards → advantages → train pairs
        num_steps_per_rollout optimizer steps (micro-batches, gradient accumulation, grad-norm clip)
        weight version bump (the in-process engine already sees the new weights)
        eval on held-out prompts every --eval-interval; checkpoint every --checkpoint-interval

Flow-GRPO trains the SDE window's steps with the clipped ratio; DiffusionNFT samples ODE without
CFG under its EMA old policy and trains on the final latents. Both call the family's `velocity`
and the shared transition kernels, exactly as the engine does, so the first pass of an on-policy
Flow-GRPO step reproduces the rollout's log-probs (ratio 1).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from diffrl.algorithms.advantages import compute_advantages
from diffrl.algorithms.losses import ema_decay, flow_grpo_loss, nft_loss
from diffrl.algorithms.pairs import GrpoPairs, NftPairs, grpo_pairs, nft_pairs
from diffrl.data.shapes import prompts_by_category, test_prompts
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.errors import RequestError
from diffrl.evaluation.shapes import (
    TEST_SEED,
    VALIDATION_SEED,
    balanced_eval_set,
    evaluate_prompts,
    save_records_grid,
    summarize,
    validation_prompts,
)
from diffrl.models import resolve_family
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.compile import compile_blocks
from diffrl.models.lora import LoraSpec, add_lora
from diffrl.rewards import get_reward
from diffrl.rewards.workers import ProcessRewardPool
from diffrl.rollout import (
    HttpEngineClient,
    InProcessEngineClient,
    RolloutConfig,
    RolloutManager,
    check_batch_invariant,
)
from diffrl.sampling import noised, transition
from diffrl.train.config import TrainConfig, uses_ray
from diffrl.train.ema import ParameterEMA
from diffrl.train.metrics import MetricsLogger, best_by_validation
from diffrl.train.parallel import (
    Parallel,
    all_gather_rows,
    any_rank,
    full_tensor,
    finish_parallel,
    init_parallel,
    mean_over_ranks,
    rank_device,
    shard_transformer,
)
from diffrl.train.prompt_sampler import CategorySampler
from diffrl.train.train_state import load_train_state, save_train_state
from diffrl.utils.device import resolve_device


def validate_config(cfg: TrainConfig) -> None:
    """Refuse contradictory settings up front, naming the flags."""
    check_batch_invariant(cfg.rollout_batch_size, cfg.n_samples_per_prompt, cfg.global_batch_size,
                          cfg.num_steps_per_rollout)
    lo, hi = cfg.sde_window_range()
    if cfg.loss_type != "flow_grpo":
        lo, hi = 0, cfg.diffusion_num_steps  # NFT samples ODE: the SDE window does not apply
    if not 0 <= lo < hi <= cfg.diffusion_num_steps:
        raise ValueError(f"--diffusion-sde-window-range {lo},{hi} must satisfy 0 <= lo < hi <= "
                         f"--diffusion-num-steps ({cfg.diffusion_num_steps})")
    if not 1 <= cfg.diffusion_num_sde_steps <= hi - lo:
        raise ValueError(f"--diffusion-num-sde-steps {cfg.diffusion_num_sde_steps} does not fit in "
                         f"--diffusion-sde-window-range {lo},{hi}")
    if cfg.loss_type == "nft" and int(cfg.diffusion_num_steps * cfg.nft_timestep_fraction) < 1:
        raise ValueError(f"--nft-timestep-fraction {cfg.nft_timestep_fraction} keeps no timestep of "
                         f"--diffusion-num-steps {cfg.diffusion_num_steps}")
    if cfg.reward_workers < 0:
        raise ValueError(f"--reward-workers must be >= 0, got {cfg.reward_workers}")
    if cfg.ray_trainer_ranks < 1:
        raise ValueError(f"--ray-trainer-ranks must be >= 1, got {cfg.ray_trainer_ranks}")
    if cfg.ray_trainer_ranks > 1 and cfg.ray_engines:
        raise ValueError("--ray-trainer-ranks > 1 rolls out on each rank's in-process engine; with --ray-engines "
                         "every rank would push its weights to them (use one or the other)")
    if cfg.ray_reward_workers < 0 or (cfg.ray_reward_workers and not uses_ray(cfg)):
        raise ValueError("--ray-reward-workers places reward actors beside --ray-engines N (N >= 1) or "
                         f"--ray-trainer-ranks T (T >= 2); got {cfg.ray_reward_workers} reward workers, "
                         f"{cfg.ray_engines} engines and {cfg.ray_trainer_ranks} trainer ranks")
    if cfg.diffusion_kl_beta > 0 and cfg.kl_reference == "ema" and not (cfg.use_ema or cfg.loss_type == "nft"):
        raise ValueError("--kl-reference ema needs an EMA: pass --use-ema (or --kl-reference base)")
    if cfg.eval_images_per_category < 0:
        raise ValueError(f"--eval-images-per-category must be >= 0 (0: no held-out evaluation), got "
                         f"{cfg.eval_images_per_category}")
    if cfg.val_images_per_category < 0 or cfg.val_prompts_per_category < 1:
        raise ValueError(f"--val-images-per-category must be >= 0 (got {cfg.val_images_per_category}) and "
                         f"--val-prompts-per-category >= 1 (got {cfg.val_prompts_per_category})")
    if cfg.nft_rollout_guidance_scale < 1 or (cfg.nft_rollout_guidance_scale != 1 and cfg.loss_type != "nft"):
        raise ValueError(f"--nft-rollout-guidance-scale must be >= 1 and applies to --loss-type nft only "
                         f"(got {cfg.nft_rollout_guidance_scale} with --loss-type {cfg.loss_type})")
    if cfg.eval_num_steps is not None and cfg.eval_num_steps < 1:
        raise ValueError(f"--eval-num-steps must be >= 1, got {cfg.eval_num_steps}")
    for name in ("micro_batch_size", "num_rollout", "eval_interval", "checkpoint_interval"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def check_video_flags(cfg: TrainConfig, family) -> None:
    """--num-frames only for a video family; a video family without the shapes evaluation (it scores images)."""
    if not family.generates_video:
        if cfg.num_frames not in (None, 1):
            raise ValueError(f"--num-frames {cfg.num_frames}: the {family.name} family generates images, not video")
        return
    if cfg.eval_images_per_category or cfg.val_images_per_category:
        raise ValueError(f"the {family.name} family generates video and the held-out shapes evaluation scores images: "
                         "pass --eval-images-per-category 0 (and --val-images-per-category 0)")
    if cfg.num_frames is not None:
        height, width = (cfg.resolution, cfg.resolution) if cfg.resolution else family.default_size()
        try:
            family.check_size(height, width, num_frames=cfg.num_frames)
        except RequestError as err:
            raise ValueError(f"--num-frames {cfg.num_frames}: {err.message}") from None


def validate_parallel(cfg: TrainConfig, parallel: Parallel) -> None:
    """What a torchrun run needs beyond `validate_config`: equal shares, a shared run folder."""
    parallel.shard_of(cfg.rollout_batch_size, "--rollout-batch-size")
    parallel.shard_of(cfg.global_batch_size, "--global-batch-size")
    if cfg.output_dir is None:
        raise ValueError("several ranks need an explicit --output-dir (each would stamp its own)")
    if cfg.drop_zero_std_groups:
        raise ValueError("--drop-zero-std-groups would give ranks unequal shares; use it single-process")
    if cfg.engine_urls:
        raise ValueError("--engine-urls is single-process for now (every rank would push its weights)")


class Trainer:
    def __init__(self, cfg: TrainConfig, extra_engines: Sequence = (), reward_fn: Callable | None = None):
        """`extra_engines`: engine clients placed elsewhere (e.g. Ray actors); like `--engine-urls`
        they join the rollout pool and get the weights pushed before every rollout. `reward_fn`: a
        scorer placed elsewhere (e.g. Ray reward workers) in place of `--reward` in this process."""
        validate_config(cfg)
        self.device = rank_device(resolve_device(cfg.device))
        self.parallel = init_parallel(self.device)
        if self.parallel.enabled:
            validate_parallel(cfg, self.parallel)
        if cfg.output_dir is None:
            if cfg.resume:
                raise ValueError("--resume needs the --output-dir of the run to continue")
            stamp = time.strftime("%Y%m%d-%H%M%S")
            cfg = dataclasses.replace(cfg, output_dir=Path("runs") / f"{cfg.recipe or cfg.loss_type}-{stamp}")
        self.cfg = cfg
        if cfg.deterministic_mode:
            torch.use_deterministic_algorithms(True)
        torch.set_float32_matmul_precision(cfg.float32_matmul_precision)
        out = cfg.output_dir
        if self.parallel.is_main:
            if out.exists() and any(out.iterdir()) and not cfg.resume:
                raise FileExistsError(f"{out} is not empty; pass --resume to continue it or choose another --output-dir")
            out.mkdir(parents=True, exist_ok=True)

        torch.manual_seed(cfg.seed)
        self.family = resolve_family(cfg.diffusion_model_family, cfg.model_path).load(cfg.model_path, device=self.device)
        if cfg.resolution is not None:
            try:
                self.family.check_size(cfg.resolution, cfg.resolution)
            except RequestError as err:
                raise ValueError(f"--resolution {cfg.resolution}: {err.message}") from None
        check_video_flags(cfg, self.family)
        transformer = self.family.transformer
        bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and self.device.type == "cuda")
        self.family.autocast_dtype = torch.bfloat16 if bf16 else None  # the engine shares the family
        if cfg.gradient_checkpointing:
            transformer.enable_gradient_checkpointing()  # active only when gradients are (training)
        self.lora = LoraSpec(rank=cfg.lora_rank, alpha=cfg.lora_alpha,
                             target_modules=list(self.family.lora_target_modules)) if cfg.use_lora else None
        if self.lora is not None:
            add_lora(transformer, self.lora)
        if self.parallel.enabled:
            # The engine samples from a full copy whose weights are synced from the shards before each
            # rollout and evaluation; the trainer's copy is sharded with FSDP2 over the family's blocks (below).
            engine_family = copy.deepcopy(self.family)
        else:
            engine_family = self.family  # shares the trained module: every update is live for the engine
        if cfg.compile:  # after LoRA (it replaces layers inside the blocks), before FSDP2 shards them
            for family in {id(f): f for f in (self.family, engine_family)}.values():
                compile_blocks(family.transformer, family.block_lists, eager_numerics=cfg.compile_eager_numerics)
        if self.parallel.enabled:
            shard_transformer(transformer, self.family.block_lists, self.parallel.mesh)
        # Trained, and what other engines receive after each update (LoRA: only the adapter's tensors).
        trainable = {n: p for n, p in transformer.named_parameters() if not cfg.use_lora or "lora_" in n}
        self.trainable_names, self.params = list(trainable), list(trainable.values())
        for p in self.params:
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        # self.ema: DiffusionNFT's old policy θ_old, or GRPO's --use-ema. self.eval_ema: what evaluation,
        # checkpoints/best and the saved model use with --use-ema (for NFT a second EMA, updated per
        # optimizer step with --ema-decay: the old policy follows its own schedule for sampling).
        self.ema = ParameterEMA(self.params) if (cfg.use_ema or cfg.loss_type == "nft") else None
        self.eval_ema = None
        if cfg.use_ema:
            self.eval_ema = ParameterEMA(self.params) if cfg.loss_type == "nft" else self.ema
        # The KL anchor of a full finetune: the starting weights, taken before any resume loads
        # later ones (an EMA that is never updated). LoRA gets it by disabling the adapter.
        self.base_weights = (ParameterEMA(self.params) if cfg.diffusion_kl_beta > 0 and cfg.kl_reference == "base"
                             and not cfg.use_lora else None)

        self.engine = Engine(engine_family, EngineConfig(max_outputs_per_request=max(64, cfg.rollout_microgroup_size),
                                                       max_batch_outputs=cfg.engine_max_batch_outputs))
        self.remote_engines = ([HttpEngineClient(url, max_in_flight=cfg.engine_concurrency) for url in cfg.engine_urls]
                               + list(extra_engines))
        if not cfg.local_engine and not self.remote_engines:
            raise ValueError("--no-local-engine needs engines to roll out on: --engine-urls or --ray-engines")
        self.engine_token = cfg.engine_token or os.environ.get("DIFFRL_ENGINE_TOKEN")
        if self.lora is not None:  # engines elsewhere host the adapter unmerged, then get only its tensors
            for client in self.remote_engines:
                client.add_lora_adapter(self.lora, self.engine_token)
        self.manager = RolloutManager(
            ([InProcessEngineClient(self.engine)] if cfg.local_engine else []) + self.remote_engines,
            RolloutConfig(n_samples_per_prompt=cfg.n_samples_per_prompt, rollout_microgroup_size=cfg.rollout_microgroup_size,
                          engine_concurrency=cfg.engine_concurrency, rollout_seed=cfg.rollout_seed),
            reward_fn=reward_fn or (ProcessRewardPool(cfg.reward, cfg.reward_workers) if cfg.reward_workers
                                    else get_reward(cfg.reward)),
        )
        by_category = prompts_by_category("train")
        unknown = sorted(set(cfg.train_categories) - set(by_category))
        if unknown:
            raise ValueError(f"--train-categories: unknown {unknown}; known: {', '.join(by_category)}")
        self.sampler = CategorySampler({c: by_category[c] for c in (cfg.train_categories or by_category)},
                                       mode=cfg.category_sampling, floor=cfg.category_sampling_floor,
                                       smoothing=cfg.category_reward_smoothing, seed=cfg.seed,
                                       difficulty=cfg.category_difficulty, solved_reward=cfg.category_solved_reward)
        self.rollout_index = 0
        self.elapsed_s = 0.0  # rollout + train wall clock of the run so far
        self.best_val = -1.0  # the best validation strict accuracy so far (--val-images-per-category)
        if cfg.resume:
            self._load_checkpoint()
        self.metrics = None
        if self.parallel.is_main:
            (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), default=str, indent=2) + "\n")
            self.metrics = MetricsLogger(out)

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        cfg = self.cfg
        main = self.parallel.is_main
        bar = tqdm(total=cfg.num_rollout, initial=self.rollout_index, desc=f"train {cfg.loss_type}", dynamic_ncols=True,
                   disable=not main)
        last = {}
        if self.rollout_index == 0:
            record = self.evaluate(0)
            if main:
                self.metrics.log(0, record)
            self._keep_if_best(record)  # the starting weights are a candidate too
        started = time.perf_counter() - self.elapsed_s  # wall clock carries over a resume
        while self.rollout_index < cfg.num_rollout:
            k = self.rollout_index
            record = self.rollout_and_update(k)
            self.rollout_index = k + 1
            self.elapsed_s = time.perf_counter() - started
            last_one = any_rank(self.rollout_index == cfg.num_rollout or (
                cfg.time_budget_minutes is not None and self.elapsed_s >= 60 * cfg.time_budget_minutes), self.parallel)
            record["time/elapsed_s"] = self.elapsed_s  # rollouts + training; evals and checkpoints excluded
            paused = time.perf_counter()
            if self.rollout_index % cfg.eval_interval == 0 or last_one:
                record.update(self.evaluate(self.rollout_index))
                self._keep_if_best(record)
            if main:
                self.metrics.log(self.rollout_index, record)
            if self.rollout_index % cfg.checkpoint_interval == 0 or last_one:
                self.save_checkpoint()
            started += time.perf_counter() - paused
            bar.update(1)
            bar.set_postfix(reward=f"{record['rollout/reward/raw_mean']:.3f}", loss=f"{record.get('train/loss', float('nan')):.4f}")
            last = record
            if last_one:
                break
        bar.close()
        if hasattr(self.manager.reward_fn, "close"):  # a worker pool: its processes end with the run
            self.manager.reward_fn.close()
        if main:
            curve = self.metrics.plot_curves()
            print(run_summary(self.metrics.records()))
            print(f"run folder: {cfg.output_dir}  (metrics.jsonl, tensorboard/, eval/, checkpoints/, {curve.name})")
            self.metrics.close()
        return last

    def _sde_window(self, k: int) -> list[int]:
        lo, hi = self.cfg.sde_window_range()
        width = self.cfg.diffusion_num_sde_steps
        start = int(np.random.default_rng([self.cfg.seed, k, 1]).integers(lo, hi - width + 1))
        return list(range(start, start + width))

    def rollout_and_update(self, k: int) -> dict:
        cfg = self.cfg
        nft = cfg.loss_type == "nft"
        window = [] if nft else self._sde_window(k)
        n_steps = cfg.diffusion_num_steps
        if nft:  # deterministic ODE (CFG-free by default) under the old policy; only the final latent is kept
            request = dict(num_inference_steps=n_steps, guidance_scale=cfg.nft_rollout_guidance_scale, rollout=False,
                           rollout_return_dit_trajectory=True, rollout_return_step_indices=[n_steps],
                           rollout_return_denoising_env=True)
        else:
            request = dict(num_inference_steps=n_steps, guidance_scale=cfg.diffusion_guidance_scale, rollout=True,
                           rollout_sde_type=cfg.diffusion_sde_type, rollout_noise_level=cfg.diffusion_noise_level,
                           rollout_sde_step_indices=window, rollout_return_dit_trajectory=True,
                           rollout_return_denoising_env=True)
        if cfg.resolution:
            request.update(height=cfg.resolution, width=cfg.resolution)
        if cfg.num_frames is not None:
            request.update(num_frames=cfg.num_frames)
        self.manager.config.request = request
        shares = self.sampler.weights()  # before this rollout's rewards update them
        prompts, categories = self.sampler.draw(k, cfg.rollout_batch_size)
        # Each rank rolls out its share of the groups, with the group indices (hence seeds) that the
        # groups have in a single-process run; the group counter stays global.
        mine = self.parallel.shard_of(len(prompts), "--rollout-batch-size")  # all of them in one process
        first_group = self.manager.next_group_index
        self.manager.next_group_index = first_group + mine.start
        start = time.perf_counter()
        with self._engine_weights(self.ema if nft else None):
            groups = asyncio.run(self.manager.rollout(prompts[mine]))
        self.manager.next_group_index = first_group + len(prompts)
        rollout_s = time.perf_counter() - start
        samples = [s for g in groups for s in g]
        local_rewards = torch.tensor([s.reward for s in samples], dtype=torch.float64)
        # Advantages from every rank's rewards (batch-wide statistics see the whole rollout), then our rows.
        rewards = all_gather_rows(local_rewards, self.parallel)
        n = cfg.n_samples_per_prompt
        adv = compute_advantages(rewards, [p for p in prompts for _ in range(n)],
                                 globalize_reward_mean=cfg.globalize_reward_mean,
                                 globalize_reward_std=cfg.globalize_reward_std,
                                 drop_zero_std_groups=cfg.drop_zero_std_groups)
        rows = slice(mine.start * n, mine.stop * n)
        category_means = self.sampler.observe(categories, rewards.view(len(prompts), n).tolist())
        adv = dataclasses.replace(adv, values=adv.values[rows], keep=adv.keep[rows])
        record = {"rollout/reward/raw_mean": rewards.mean().item(), "rollout/reward/std": rewards.std().item(),
                  "rollout/zero_std_ratio": adv.zero_std_ratio, "rollout/seconds": rollout_s,
                  "rollout/images_per_s": len(samples) / rollout_s, "rollout/sde_window_start": window[0] if window else -1}
        record.update({f"rollout/reward/{c}": m for c, m in category_means.items()})
        if cfg.category_sampling == "adaptive":
            record.update({f"rollout/category_share/{c}": w for c, w in shares.items()})
            record.update({f"rollout/unsolved/{c}": u for c, u in self.sampler.unsolved.items()})
        kept = [i for i in range(len(samples)) if adv.keep[i]]
        if not kept:
            record["train/skipped"] = 1.0
            return record
        env = self._conditioning(samples, pad_text=self.family.pads_text)
        sigmas = samples[0].output.dit_trajectory.sigmas
        start = time.perf_counter()
        if nft:
            x0 = torch.stack([samples[i].output.dit_trajectory.latents[0] for i in kept])
            pairs = nft_pairs(x0, [samples[i].seed for i in kept], sigmas, adv.values[kept].float(),
                              [env["cond"][i] for i in kept], timestep_fraction=cfg.nft_timestep_fraction)
            stats = self._optimize(pairs, env, sigmas)
            with torch.no_grad():
                self.ema.update(ema_decay(k, ramp=cfg.nft_ema_ramp, max_decay=cfg.nft_ema_max, flat=cfg.nft_ema_flat))
        else:
            trajectories = [samples[i].output.dit_trajectory for i in kept]
            pairs = grpo_pairs(
                [t.latents for t in trajectories], trajectories[0].latent_step_indices.tolist(),
                [samples[i].output.rollout_log_probs for i in kept], sigmas, adv.values[kept].float(),
                [env["cond"][i] for i in kept], [env["uncond"][i] for i in kept], window,
            )
            stats = self._optimize(pairs, env, sigmas)
        train_s = time.perf_counter() - start
        record.update(stats)
        record.update({"train/seconds": train_s, "train/pairs_per_s": len(pairs) / train_s, "train/pairs": len(pairs)})
        if self.device.type == "cuda":  # since the engine's last batch: that batch, training, weights, optimizer
            record["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        return record

    @contextlib.contextmanager
    def _engine_weights(self, ema: ParameterEMA | None):
        """The engines sample with an EMA (NFT's old policy; evaluation with --use-ema) or, given None,
        the current weights. The in-process engine of a one-process run shares the trained module, so the EMA is
        swapped into it for the block; every other engine (the full copy of each rank, remote engines)
        gets the weights copied or pushed before the block. Every rank calls this."""
        swap = ema.swapped_in() if ema is not None else contextlib.nullcontext()
        with swap:
            self._send_weights_to_engines()
            if self.engine.family is self.family:
                yield
                return
        yield

    @torch.no_grad()
    def _send_weights_to_engines(self) -> None:
        if self.parallel.enabled:  # the rank's engine copy: full tensors gathered from the shards
            engine_params = dict(self.engine.family.transformer.named_parameters())
            for name, p in self.family.transformer.named_parameters():
                engine_params[name].copy_(full_tensor(p.detach()))
        if self.remote_engines:
            tensors = {name: p.detach() for name, p in zip(self.trainable_names, self.params, strict=True)}
            for client in self.remote_engines:
                client.push_weights(tensors, self.engine.weight_version, self.engine_token)

    @staticmethod
    def _conditioning(samples, pad_text: bool = False) -> dict:
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

    # ------------------------------------------------------------------ optimization
    def _optimize(self, pairs: GrpoPairs | NftPairs, env: dict, sigmas: torch.Tensor) -> dict:
        cfg = self.cfg
        lr = learning_rate(cfg, self.rollout_index)  # a function of the rollout: a resumed run agrees
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.rollout_index)
        order = torch.randperm(len(pairs), generator=gen)
        chunks = [c for c in order.chunk(cfg.num_steps_per_rollout) if len(c)]
        totals: dict[str, float] = {}
        first_pass_diff, first_pass_n = 0.0, 0
        for step, chunk in enumerate(chunks):
            self.optimizer.zero_grad(set_to_none=True)
            step_stats: dict[str, float] = {}
            for mb in chunk.split(cfg.micro_batch_size):
                batch = pairs.select(mb)
                weight = len(mb) / len(chunk)
                if isinstance(batch, GrpoPairs):
                    loss, stats, abs_diff = self._grpo_micro_batch(batch, env, float(sigmas[1]))
                    if step == 0:  # weights untouched yet: the rollout-vs-trainer log-prob agreement
                        first_pass_diff += abs_diff * len(mb)
                        first_pass_n += len(mb)
                else:
                    loss, stats = self._nft_micro_batch(batch, env)
                if not torch.isfinite(loss):
                    step_stats["train/nonfinite_loss"] = 1.0
                    if not self.parallel.enabled:
                        continue
                    # Every rank must run the same backward passes (FSDP's collectives); the global
                    # gradient norm is then non-finite on all of them and the step is skipped below.
                (loss * weight).backward()
                for key, value in stats.items():
                    step_stats[key] = step_stats.get(key, 0.0) + value * weight
            if step_stats.get("train/nonfinite_loss"):
                self.optimizer.zero_grad(set_to_none=True)
                totals["train/skipped_steps"] = totals.get("train/skipped_steps", 0.0) + 1
                continue
            grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, cfg.grad_clip))
            if not torch.isfinite(grad_norm):
                totals["train/skipped_steps"] = totals.get("train/skipped_steps", 0.0) + 1
                continue
            self.optimizer.step()
            self.engine.weight_version += 1
            if self.eval_ema is not None:
                self.eval_ema.update(cfg.ema_decay)
            step_stats["train/grad_norm"] = float(grad_norm)
            for key, value in step_stats.items():
                totals[key] = totals.get(key, 0.0) + value / len(chunks)
        if first_pass_n:
            totals["train/log_prob_mean_abs_diff"] = first_pass_diff / first_pass_n
        totals["train/lr"] = lr
        return mean_over_ranks(totals, self.parallel)

    def _velocity(self, x, sigma, cond, uncond, guidance_scale, env):
        text_ids, negative_ids = env["text_ids"].to(self.device), env["negative_text_ids"].to(self.device)
        return self.family.velocity(
            self.family.transformer, Latents(x, env["image_ids"].to(self.device)), sigma,
            PromptEmbeds(cond, text_ids), PromptEmbeds(uncond, negative_ids) if uncond is not None else None,
            guidance_scale,
        )

    def _grpo_micro_batch(self, batch: GrpoPairs, env: dict, sigma_max: float):
        cfg, dev = self.cfg, self.device
        guidance = cfg.diffusion_guidance_scale
        x, x_next = batch.x.to(dev), batch.x_next.to(dev)
        sigma, sigma_next = batch.sigma.to(dev), batch.sigma_next.to(dev)
        cond = batch.cond.to(dev)
        uncond = batch.uncond.to(dev) if guidance > 1.0 else None

        def step(v):  # the engine's transition, scoring the rollout's x_next instead of drawing one
            return transition(cfg.diffusion_sde_type, x, v, sigma, sigma_next, cfg.diffusion_noise_level,
                              sigma_max=sigma_max, next_latents=x_next)

        ref_mean = None
        if cfg.diffusion_kl_beta > 0:
            with torch.no_grad(), self._reference():
                ref_mean = step(self._velocity(x, sigma, cond, uncond, guidance, env)).mean
        # The family's forward precision is the engine's too, so the first pass reproduces its log-probs
        # (exactly in fp32; bf16 kernels may round differently at the trainer's batch size).
        v = self._velocity(x, sigma, cond, uncond, guidance, env)
        out = step(v)
        terms = flow_grpo_loss(out.log_prob, batch.old_log_prob.to(dev), batch.advantages.to(dev),
                               clip_range=cfg.diffusion_clip_range, adv_clip_max=cfg.diffusion_adv_clip_max,
                               kl_beta=cfg.diffusion_kl_beta, mean=out.mean, ref_mean=ref_mean, std=out.std)
        abs_diff = (out.log_prob.detach() - batch.old_log_prob.to(dev)).abs().mean().item()
        stats = {"train/loss": terms.loss.item(), "train/policy_loss": terms.policy_loss.item(),
                 "train/kl_loss": terms.kl_loss.item(), "train/approx_kl": terms.approx_kl.item(),
                 "train/clipfrac": terms.clipfrac.item(), "train/ratio_mean": terms.ratio.mean().item()}
        return terms.loss, stats, abs_diff

    def _nft_micro_batch(self, batch: NftPairs, env: dict):
        cfg, dev = self.cfg, self.device
        x0, noise, t = batch.x0.to(dev), batch.noise.to(dev), batch.t.to(dev)
        cond = batch.cond.to(dev)
        x_t = noised(x0, noise, t)
        # The old policy first, with no graph: swapping parameters after building v_θ's graph would corrupt it.
        with torch.no_grad(), self.ema.swapped_in():
            v_old = self._velocity(x_t, t, cond, None, 1.0, env)
        v_ref = None
        if cfg.diffusion_kl_beta > 0:
            with torch.no_grad(), self._reference():
                v_ref = self._velocity(x_t, t, cond, None, 1.0, env)
        v_theta = self._velocity(x_t, t, cond, None, 1.0, env)
        terms = nft_loss(v_theta.float(), v_old, x_t, x0, t, batch.advantages.to(dev), beta=cfg.diffusion_nft_beta,
                         adv_clip_max=cfg.diffusion_adv_clip_max, adaptive_weighting=cfg.nft_adaptive_weighting,
                         kl_beta=cfg.diffusion_kl_beta, v_ref=v_ref)
        stats = {"train/loss": terms.loss.item(), "train/nft_positive_loss": terms.positive_loss.item(),
                 "train/nft_negative_loss": terms.negative_loss.item(), "train/kl_loss": terms.kl_loss.item()}
        return terms.loss, stats

    @contextlib.contextmanager
    def _reference(self):
        """The KL reference (--kl-reference): the base model (LoRA disabled, or the starting
        weights swapped in) or the EMA."""
        if self.cfg.kl_reference == "ema":
            with self.ema.swapped_in():
                yield
        elif self.cfg.use_lora:
            self.family.transformer.disable_adapters()
            try:
                yield
            finally:
                self.family.transformer.enable_adapters()
        else:
            with self.base_weights.swapped_in():
                yield

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, k: int) -> dict:
        """Held-out strict accuracy on the test prompts (`eval/…`) and, with --val-images-per-category,
        on the validation subset of the train prompts (`val/…`)."""
        cfg = self.cfg
        guidance = cfg.eval_guidance_scale if cfg.eval_guidance_scale is not None else cfg.diffusion_guidance_scale
        sets = [("eval", test_prompts(), cfg.eval_images_per_category, TEST_SEED)] if cfg.eval_images_per_category else []
        if cfg.val_images_per_category > 0:
            sets.append(("val", validation_prompts(cfg.val_prompts_per_category), cfg.val_images_per_category,
                         VALIDATION_SEED))
        if not sets:  # both evaluations off: no weights to swap in for the engine
            return {}
        out = {}
        with self._engine_weights(self.eval_ema):
            if not self.parallel.is_main:
                return {}
            for prefix, prompts, per_category, seed in sets:
                prompts, seeds_per_prompt = balanced_eval_set(prompts, per_category)
                records, images = evaluate_prompts(self.engine.family, prompts, num_seeds=seeds_per_prompt, seed=seed,
                                                   num_steps=cfg.eval_num_steps or cfg.diffusion_num_steps,
                                                   guidance_scale=guidance, resolution=cfg.resolution)
                summary = summarize(records)
                out[f"{prefix}/strict"], out[f"{prefix}/score"] = summary["overall_strict"], summary["overall_score"]
                for cat, c in summary["categories"].items():
                    out[f"{prefix}/strict/{cat}"] = c["strict"]
                if prefix == "eval":
                    save_records_grid(records, images, cfg.output_dir / "eval" / f"rollout-{k:05d}.png", limit=32)
        return out

    def _keep_if_best(self, record: dict) -> None:
        """Save `checkpoints/best` when this evaluation's validation accuracy beats every earlier one.
        The main rank decides (it evaluates); every rank takes part in saving (FSDP gathers)."""
        improved = "val/strict" in record and record["val/strict"] > self.best_val
        if not any_rank(improved, self.parallel):
            return
        path = self.cfg.output_dir / "checkpoints" / "best"
        path.mkdir(parents=True, exist_ok=True)
        self._save_weights(path)
        if self.parallel.is_main:
            self.best_val = record["val/strict"]
            chosen = {"rollout": self.rollout_index, **{k: v for k, v in record.items() if k.startswith(("val/", "eval/"))}}
            (path / "best.json").write_text(json.dumps(chosen, indent=2) + "\n")

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        path = self.cfg.output_dir / "checkpoints" / f"rollout-{self.rollout_index:05d}"
        path.mkdir(parents=True, exist_ok=True)
        self._save_weights(path)
        meta = {"rollout_index": self.rollout_index, "next_group_index": self.manager.next_group_index,
                "weight_version": self.engine.weight_version, "elapsed_s": self.elapsed_s,
                "category_sampler": self.sampler.state_dict(), "best_val": self.best_val}
        save_train_state(path, transformer=self.family.transformer, params=self.params, names=self.trainable_names,
                         optimizer=self.optimizer, emas=self._emas(), meta=meta, parallel=self.parallel)
        return path

    def _save_weights(self, path: Path) -> None:
        """The model a user loads, the weights evaluation scores (the --use-ema EMA, else the current
        ones): LoRA in PEFT format or the full model in diffusers format (rank 0; under torchrun from
        the engine's copy, which holds the full weights after the sync)."""
        if self.parallel.enabled:
            with self._engine_weights(self.eval_ema):
                pass  # the sync leaves the full weights to save (the EMA's, with one) in the engine's copy
            if self.parallel.is_main:
                self._write_model(self.engine.family, path)
            return
        with self.eval_ema.swapped_in() if self.eval_ema is not None else contextlib.nullcontext():
            self._write_model(self.family, path)

    def _write_model(self, family, path: Path) -> None:
        transformer = family.transformer
        if self.cfg.use_lora:
            from peft import get_peft_model_state_dict

            lora_dir = path / "lora"
            lora_dir.mkdir(exist_ok=True)
            save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(transformer).items()},
                      str(lora_dir / "adapter_model.safetensors"))
            transformer.peft_config["default"].save_pretrained(str(lora_dir))
        else:
            family.save(path / "model")

    def _emas(self) -> dict[str, ParameterEMA]:
        """The EMAs a resume restores, by the name they are saved under."""
        emas = {"ema": self.ema, "eval_ema": self.eval_ema if self.eval_ema is not self.ema else None}
        return {name: ema for name, ema in emas.items() if ema is not None}

    def _load_checkpoint(self) -> None:
        checkpoints = sorted((self.cfg.output_dir / "checkpoints").glob("rollout-*"))
        if not checkpoints:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.cfg.output_dir / 'checkpoints'}")
        meta = load_train_state(checkpoints[-1], transformer=self.family.transformer, params=self.params,
                                names=self.trainable_names, optimizer=self.optimizer, emas=self._emas(),
                                device=self.device, parallel=self.parallel)
        self.rollout_index = meta["rollout_index"]
        self.manager.next_group_index = meta["next_group_index"]
        self.engine.weight_version = meta["weight_version"]
        self.elapsed_s = meta.get("elapsed_s", 0.0)
        self.best_val = meta.get("best_val", -1.0)
        self.sampler.load_state_dict(meta.get("category_sampler", {}))
        if self.parallel.is_main:
            print(f"resumed from {checkpoints[-1]} at rollout {self.rollout_index}")


def run_summary(records: list[dict], window: int = 4) -> str:
    """First vs last rollouts' mean reward (± standard error) and held-out accuracy before/after."""
    rewards = [r["rollout/reward/raw_mean"] for r in records if "rollout/reward/raw_mean" in r]
    evals = [(r["rollout"], r["eval/strict"]) for r in records if "eval/strict" in r]
    lines = []
    if len(rewards) >= 2:
        w = max(1, min(window, len(rewards) // 2))

        def mean_se(xs):
            m = sum(xs) / len(xs)
            var = sum((x - m) ** 2 for x in xs) / max(1, len(xs) - 1)
            return m, (var / len(xs)) ** 0.5

        (m0, s0), (m1, s1) = mean_se(rewards[:w]), mean_se(rewards[-w:])
        lines.append(f"reward: first {w} rollouts {m0:.3f} ± {s0:.3f} → last {w} rollouts {m1:.3f} ± {s1:.3f}")
    if len(rewards) >= 3:
        slope, se = reward_trend(rewards)
        lines.append(f"reward trend: {slope:+.4f} ± {se:.4f} per rollout (least squares over {len(rewards)} rollouts)")
    if len(evals) >= 2:
        lines.append(f"held-out strict accuracy: rollout {evals[0][0]} {evals[0][1]:.3f} → rollout {evals[-1][0]} {evals[-1][1]:.3f}")
    best = best_by_validation(records)
    if best is not None:
        lines.append(f"checkpoints/best (highest validation accuracy on train prompts): rollout {best['rollout']}, "
                     f"validation {best['val/strict']:.3f}, held-out {best.get('eval/strict', float('nan')):.3f}")
    return "\n".join(lines)


def learning_rate(cfg: TrainConfig, rollout: int) -> float:
    """--lr, or its cosine decay to --lr × --lr-min-ratio over --num-rollout rollouts."""
    if cfg.lr_schedule == "constant" or cfg.num_rollout <= 1:
        return cfg.lr
    progress = min(rollout / (cfg.num_rollout - 1), 1.0)
    return cfg.lr * (cfg.lr_min_ratio + (1 - cfg.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def reward_trend(rewards: list[float]) -> tuple[float, float]:
    """Least-squares slope of reward against rollout index and its standard error: a rise is
    "beyond noise" when the slope is several standard errors above 0."""
    x = np.arange(len(rewards), dtype=np.float64)
    y = np.asarray(rewards, dtype=np.float64)
    xc = x - x.mean()
    slope = float(xc @ (y - y.mean()) / (xc @ xc))
    residuals = y - y.mean() - slope * xc
    se = float(np.sqrt(residuals @ residuals / (len(y) - 2) / (xc @ xc)))
    return slope, se


def train(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    result = trainer.train()
    finish_parallel(trainer.parallel)  # a torchrun rank exits here (see finish_parallel)
    return result


__all__ = ["Trainer", "train", "validate_config"]
