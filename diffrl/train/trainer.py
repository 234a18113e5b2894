"""`diffrl train`: the RL loop, readable top to bottom.

    for each rollout k:
        prompts      ← task.draw(k)                       (shapes world, or a prompt dataset)
        samples      ← RolloutManager over the engines     (objective's request; rewards streamed),
                       or rollout k's record (--load-rollout-data; --save-rollout-data writes them)
        advantages   ← rewards per prompt group            (task.observe logs its view of them)
        pairs        ← objective.pairs(samples)            (Flow-GRPO transitions or NFT's x0)
        update       ← objective.loss per micro-batch, policy.step per optimizer step
        eval every --eval-interval (task.evaluate on the engine's weights), checkpoint every
        --checkpoint-interval

The parts: `Policy` (parameters, optimizer, EMAs, KL reference, engine sync), `objectives/` (one
per loss type), `Checkpointer`, and the task (`diffrl/tasks/`). This file only orders them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from diffrl.utils.progress import tqdm

from diffrl.algorithms.advantages import compute_advantages
from diffrl.algorithms.methods import SDE_LOSS_TYPES
from diffrl.algorithms.pairs import micro_batch_bounds
from diffrl.serving.colocated import ColocatedEngineClient
from diffrl.engine.engine import Engine
from diffrl.engine.spec import EngineSpec, build_engine
from diffrl.errors import RequestError
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rewards import multi_weights
from diffrl.rewards.colocate import InProcessRewards
from diffrl.rewards.frames import on_frames
from diffrl.rewards.schedule import parse_schedule, weights_at
from diffrl.rewards.build import build_reward
from diffrl.rollout import HttpEngineClient, InProcessEngineClient, RolloutManager
from diffrl.tasks import build_task
from diffrl.train.checkpointer import Checkpointer
from diffrl.train.config import TrainConfig
from diffrl.train.engines import engine_spec
from diffrl.train.metrics import MetricsLogger
from diffrl.train.next_steps import next_commands
from diffrl.train.objectives import build_objective, rollout_conditioning
from diffrl.train.parallel import (
    Parallel,
    all_gather_rows,
    any_rank,
    finish_parallel,
    init_parallel,
    mean_over_ranks,
    rank_device,
    rank_reward_device,
)
from diffrl.train.policy import Policy, bf16_forward, in_process_training_graph_rows
from diffrl.train.replay import (
    RolloutRecord,
    check_load_dir,
    check_records,
    fingerprint,
    load_rollout,
    prepare_save_dir,
    save_rollout,
)
from diffrl.train.report import run_summary, write_report
from diffrl.train.trackers import TrackedRun, asked_trackers, require_tracker
from diffrl.train.warm_start import warm_start
from diffrl.utils import determinism
from diffrl.utils.compile_settings import compile_setting
from diffrl.utils.device import resolve_device
from diffrl.utils.folders import check_output_dir
from diffrl.utils.size import sample_size, size_flags


def validate_config(cfg: TrainConfig) -> None:
    """Refuse contradictory settings up front, naming the flags (each section checks its own)."""
    cfg.check()
    for tracker in asked_trackers(cfg.checkpoint):
        require_tracker(tracker)  # before any model loads


def check_family_flags(cfg: TrainConfig, family, evaluates: bool = True) -> None:
    """What the loaded family decides: the size it can make (--resolution or --height/--width; the held-out size too
    when the run evaluates), --num-frames and --reward-frames only for video, --diffusion-guidance-scale-2 only with a
    second expert."""
    m, size = cfg.model, cfg.model.size()
    scale_2 = cfg.rollout.diffusion_guidance_scale_2
    if scale_2 is not None and not family.uses_guidance_scale_2:
        raise ValueError(f"--diffusion-guidance-scale-2 {scale_2}: the {family.name} family has no second expert "
                         "(this checkpoint); use --diffusion-guidance-scale")
    if size is not None:
        try:
            family.check_size(*size)
        except RequestError as err:
            raise ValueError(f"{m.size_flags()}: {err.message}") from None
    if not family.generates_video:
        if m.num_frames not in (None, 1):
            raise ValueError(f"--num-frames {m.num_frames}: the {family.name} family generates images, not video")
        if cfg.task.reward_frames is not None:
            raise ValueError(f"--reward-frames {cfg.task.reward_frames}: the {family.name} family generates images, "
                             "not video")
    elif m.num_frames is not None:
        height, width = size or family.default_size()
        try:
            family.check_size(height, width, num_frames=m.num_frames)
        except RequestError as err:
            raise ValueError(f"--num-frames {m.num_frames}: {err.message}") from None
    if evaluates:
        check_eval_size(cfg, family, size)
    check_training_steps(cfg, family, size)


def check_training_steps(cfg: TrainConfig, family, size: tuple[int, int] | None) -> None:
    """A re-noising method's --train-timestep-range and --nft-timestep-fraction / --train-timesteps against the
    family's own schedule at the run's size (shifts differ by family and size): they must keep a step."""
    a, r = cfg.algorithm, cfg.rollout
    if a.loss_type in SDE_LOSS_TYPES:
        return
    height, width = size or family.default_size()
    frames = {"num_frames": cfg.model.num_frames or family.default_num_frames} if family.generates_video else {}
    schedule = family.sigmas(r.diffusion_num_steps, height, width, **frames)[:-1]
    a.timestep_choice().per_sample(schedule)  # a ValueError naming the flags when they keep no step


def check_eval_size(cfg: TrainConfig, family, size: tuple[int, int] | None) -> None:
    """--eval-resolution / --eval-height --eval-width and --eval-num-frames against what the family can make."""
    e = cfg.eval
    eval_size = sample_size(e.eval_resolution, e.eval_height, e.eval_width, flags="--eval-")
    eval_flags = size_flags(e.eval_resolution, e.eval_height, e.eval_width).replace("--", "--eval-")
    if eval_size is not None:
        try:
            family.check_size(*eval_size)
        except RequestError as err:
            raise ValueError(f"{eval_flags}: {err.message}") from None
    if e.eval_num_frames is not None:
        if not family.generates_video:
            raise ValueError(f"--eval-num-frames {e.eval_num_frames}: the {family.name} family generates images, not "
                             "video")
        try:
            family.check_size(*(eval_size or size or family.default_size()), num_frames=e.eval_num_frames)
        except RequestError as err:
            raise ValueError(f"--eval-num-frames {e.eval_num_frames}: {err.message}") from None


def validate_parallel(cfg: TrainConfig, parallel: Parallel) -> None:
    """What a torchrun run needs beyond `validate_config`: equal shares, a shared run folder."""
    parallel.shard_of(cfg.rollout.rollout_batch_size, "--rollout-batch-size")
    parallel.shard_of(cfg.optim.global_batch_size, "--global-batch-size")
    if cfg.checkpoint.output_dir is None:
        raise ValueError("several ranks need an explicit --output-dir (each would stamp its own)")
    if cfg.algorithm.drop_zero_std_groups:
        raise ValueError("--drop-zero-std-groups would give ranks unequal shares; use it single-process")
    if cfg.engine.engine_urls or cfg.engine.colocate:
        raise ValueError("--engine-urls and --colocate are single-process for now (every rank would push its weights)")
    if cfg.replay.save_rollout_data is not None or cfg.replay.load_rollout_data is not None:
        raise ValueError("--save-rollout-data and --load-rollout-data are single-process for now")


class Trainer:
    def __init__(self, cfg: TrainConfig, extra_engines: Sequence = (), reward_fn: Callable | None = None):
        """`extra_engines`: engine clients placed elsewhere (e.g. Ray actors); like `--engine-urls`
        they join the rollout pool and get the weights pushed before every rollout. `reward_fn`: a
        scorer placed elsewhere (e.g. Ray reward workers) in place of `--reward` in this process."""
        validate_config(cfg)
        self.device = rank_device(resolve_device(cfg.placement.device))
        # Before anything touches CUDA: cuBLAS reads its workspace setting once (utils/determinism.py).
        self.determinism = determinism.enable(self.device) if cfg.deterministic_mode else None
        self.parallel = init_parallel(self.device)
        if self.parallel.enabled:
            validate_parallel(cfg, self.parallel)
        elif cfg.engine.engine_copy_dtype != "auto":
            raise ValueError(f"--engine-copy-dtype {cfg.engine.engine_copy_dtype} sets each torchrun rank's engine copy; "
                             "one process's engine shares the trained module (drop the flag)")
        if cfg.checkpoint.output_dir is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            cfg = cfg.replace(output_dir=Path("runs") / f"{cfg.recipe or cfg.algorithm.loss_type}-{stamp}")
        self.cfg = cfg
        self.out = out = cfg.checkpoint.output_dir
        torch.set_float32_matmul_precision(cfg.model.float32_matmul_precision)
        check_output_dir(out)
        if self.parallel.is_main and out.exists() and any(out.iterdir()) and not cfg.checkpoint.resume:
            raise FileExistsError(f"{out} is not empty; pass --resume to continue it or choose another --output-dir")

        family_name = cfg.model.diffusion_model_family
        if family_name not in (None, "demo") and cfg.model.model_path == SHIPPED_DEMO_MODEL:
            by = f"--recipe {cfg.recipe}" if cfg.recipe else f"--diffusion-model-family {family_name}"
            raise ValueError(f"--model-path: {by} trains a checkpoint of the {family_name} family; pass its directory "
                             "as --model-path DIR (without it the run would load the shipped demo model)")
        # Before the model: a bad prompt file or reward spec fails in a second, not after a load.
        self.task = build_task(cfg)
        self.reward_pool = None  # --reward-workers: the worker processes
        # --load-rollout-data: rollouts (rewards included) come from records; nothing samples or scores.
        self.replaying = cfg.replay.load_rollout_data is not None
        if self.replaying:
            check_load_dir(cfg.replay.load_rollout_data)
        else:  # published video recipes score a few evenly spaced frames of each video (--reward-frames)
            self.reward_name = "the reward" if reward_fn else f"--reward {cfg.task.reward}"  # as errors name it
            if reward_fn is None:
                gpus = torch.cuda.device_count() if self.device.type == "cuda" else None
                device = rank_reward_device(cfg.task.reward_device, self.device, gpus)  # a rank's own GPU by default
                reward_fn, self.reward_pool = build_reward(cfg.task, device, cfg.deterministic_mode)
            else:
                reward_fn = on_frames(reward_fn, cfg.task.reward_frames)
        torch.manual_seed(cfg.seed)
        # bf16 forwards: load every component in bf16 (Policy upcasts what is trained to fp32 masters).
        dtype = torch.bfloat16 if bf16_forward(cfg.model, self.device) else torch.float32
        family, init_lora = warm_start(cfg.model, self.device, dtype)
        check_family_flags(cfg, family, evaluates=self.task.evaluates)
        if cfg.model.offload_text_encoder:
            family.offload_text_encoders_to_cpu()
        self.task.check_family(family)
        self.policy = Policy(cfg, family, self.parallel, self.device, init_lora=init_lora)
        if cfg.model.offload_idle_expert:  # after the adapters are in: they stay on the device
            if not cfg.model.use_lora or self.parallel.enabled:
                raise ValueError("--offload-idle-expert keeps frozen weights on the host: it needs --use-lora (a full "
                                 "finetune trains every weight) and one process (not torchrun)")
            family.offload_idle_expert(self.device)
        self.objective = build_objective(cfg, self.policy)
        self.checkpointer = Checkpointer(out, self.policy, keep_last=cfg.checkpoint.keep_last_checkpoints)
        self.fingerprint = fingerprint(cfg, family.name)  # what a rollout record must share with this run
        self.engine = self.manager = self.colocated = None
        if not self.replaying:
            self.engine, self.manager = self._rollout_engines(family, extra_engines, reward_fn)
        if cfg.task.reward_colocate:  # this process's reward models (inline, evaluation) and the workers'
            self.policy.colocated_rewards = [InProcessRewards(), *([self.reward_pool] if self.reward_pool else [])]

        self.rollout_index = 0
        self.next_group_index = 0  # monotonic across the run: a group's index fixes its seeds
        self._compile_checked = False  # --compile: whether the blocks were checked for graphs after their first run
        self._recompile_limit_named: set[str] = set()  # --compile: block kinds already warned of a full dynamo cache
        self.elapsed_s = 0.0  # rollout + train wall clock of the run so far
        self.best_selection = -math.inf  # the best task selection metric so far (checkpoints/best)
        # --resume of a run stopped before its first checkpoint: it starts again from rollout 0 in its folder.
        self.resumed_from = None
        self._no_signal_warned: int | None = None  # the last rollout that warned of equal rewards everywhere
        if cfg.checkpoint.resume:
            self._resume()
        self.metrics = None
        # Resumed at or past --num-rollout: train() says so and returns, and the folder stays as its run left
        # it (config.json rewritten with this --num-rollout would make the report read "4 of 3 rollouts").
        self.finished = self.rollout_index >= cfg.rollout.num_rollout
        if self.finished:
            return
        if self.replaying:  # every record this run will read is there and of this configuration
            check_records(cfg.replay.load_rollout_data, range(self.rollout_index, cfg.rollout.num_rollout),
                          self.fingerprint)
        if self.parallel.is_main:  # only now: a run refused above leaves no folder behind
            if cfg.replay.save_rollout_data is not None:
                prepare_save_dir(cfg.replay.save_rollout_data, cfg.checkpoint.resume, self.fingerprint)
            out.mkdir(parents=True, exist_ok=True)
        if self.parallel.is_main:
            config = {"tree": dataclasses.asdict(cfg), "flags": cfg.as_flat_dict(), "determinism": self.determinism}
            (out / "config.json").write_text(json.dumps(config, default=str, indent=2) + "\n")
            # A resumed run drops the records of the rollouts after its checkpoint: it does them again.
            flat = json.loads(json.dumps(cfg.as_flat_dict(), default=str))
            trackers = [TrackedRun(name, out, cfg.checkpoint, flat) for name in asked_trackers(cfg.checkpoint)]
            # A resumed run drops the records after its checkpoint; one that found none drops every record.
            resume_rollout = None
            if cfg.checkpoint.resume:
                resume_rollout = self.rollout_index if self.resumed_from is not None else -1
            self.metrics = MetricsLogger(out, resume_rollout=resume_rollout, trackers=trackers)

    def _rollout_engines(self, family, extra_engines: Sequence, reward_fn) -> tuple[Engine, RolloutManager]:
        """The in-process engine (sharing the policy's family) and the manager over it and any remote ones;
        with --colocate an engine process on this device takes the in-process engine's place in the pool
        (the in-process one still evaluates)."""
        e, r = self.cfg.engine, self.cfg.rollout
        spec = self._engine_spec(family)
        graph = self.policy.engine_forward_graph
        spec = dataclasses.replace(spec, limits={**spec.limits, "forward_graph": graph,
                                                 "training_graph_rows": in_process_training_graph_rows(self.cfg, graph)})
        engine = build_engine(spec, family=self.policy.engine_family)
        self.policy.local_engine = engine
        # The family decodes conditioning sent in sglang's format by a server that is not diffrl's.
        remote = [HttpEngineClient(url, max_in_flight=e.engine_concurrency, family=family.name)
                  for url in e.engine_urls] + list(extra_engines)
        if e.colocate:
            self.colocated = ColocatedEngineClient(self._engine_spec(family),
                                                   buffer_bytes=e.update_weight_buffer_size)
            remote.append(self.colocated)
        if not e.local_engine and not remote:
            raise ValueError("--no-local-engine needs engines to roll out on: --engine-urls or --ray-engines")
        self.policy.attach_remote_engines(remote)
        manager = RolloutManager(
            ([InProcessEngineClient(engine)] if e.local_engine and not e.colocate else []) + remote,
            r, reward_fn=reward_fn, engine_concurrency=e.engine_concurrency, reward_name=self.reward_name,
        )
        return engine, manager

    def _engine_spec(self, family) -> EngineSpec:
        """What every engine of this run is built from: the in-process one (which samples with the policy's own
        model), and an engine process, which computes what the in-process engine would (the same checkpoint,
        dtypes, forward precision, compilation, batching and CPU threads)."""
        device = self.device
        if device.type == "cuda" and device.index is None:  # this process's GPU, named for the other one
            device = torch.device("cuda", torch.cuda.current_device())
        return dataclasses.replace(engine_spec(self.cfg, device, family.name), num_threads=torch.get_num_threads())

    # ------------------------------------------------------------------ the loop
    def train(self) -> dict:
        cfg = self.cfg
        main = self.parallel.is_main
        if self.finished:
            if main:
                print(f"--resume: {self.out} is at rollout {self.rollout_index} already, --num-rollout is "
                      f"{cfg.rollout.num_rollout}: nothing to train (pass a larger --num-rollout to continue it)")
            self._close_workers()
            return {}
        if main and self.engine is not None and getattr(self.task, "no_eval_note", None):
            print(self.task.no_eval_note)
        bar = tqdm(total=cfg.rollout.num_rollout, initial=self.rollout_index, desc=f"train {cfg.algorithm.loss_type}",
                   dynamic_ncols=True, disable=not main)
        try:  # closed on an error too: the error line then starts a line of its own, not the bar's
            last = {}
            if self.rollout_index == 0:
                record = self.evaluate(0) if cfg.eval.eval_before_train else {}
                if main:
                    self.metrics.log(0, record)
                self._keep_if_best(record)  # the starting weights are a candidate too
            started = time.perf_counter() - self.elapsed_s  # wall clock carries over a resume
            budget = cfg.checkpoint.time_budget_minutes
            while self.rollout_index < cfg.rollout.num_rollout:
                k = self.rollout_index
                record = self.rollout_and_update(k)
                self.rollout_index = k + 1
                self.elapsed_s = time.perf_counter() - started
                last_one = any_rank(self.rollout_index == cfg.rollout.num_rollout or (
                    budget is not None and self.elapsed_s >= 60 * budget), self.parallel)
                record["time/elapsed_s"] = self.elapsed_s  # rollouts + training; evals and checkpoints excluded
                paused = time.perf_counter()
                if self.rollout_index % cfg.eval.eval_interval == 0 or last_one:
                    record.update(self.evaluate(self.rollout_index))
                    self._keep_if_best(record)
                if main:
                    self.metrics.log(self.rollout_index, record)
                if self.rollout_index % cfg.checkpoint.checkpoint_interval == 0 or last_one:
                    self.save_checkpoint()
                    if main:  # a killed run keeps the report of its last checkpoint (the curve is drawn at the end)
                        write_report(self.out)
                started += time.perf_counter() - paused
                bar.update(1)
                bar.set_postfix(reward=f"{record['rollout/reward/raw_mean']:.3f}", loss=f"{record.get('train/loss', float('nan')):.4f}")
                last = record
                if last_one:
                    break
        finally:
            bar.close()
        self._close_workers()
        if main:
            curve = self.metrics.plot_curves()
            report = write_report(self.out)
            print(run_summary(self.metrics.records()))
            parts = [report.name, "metrics.jsonl", "tensorboard/", "eval/", "checkpoints/", curve.name]
            print(f"run folder: {self.out}  ({', '.join(p for p in parts if (self.out / p.rstrip('/')).exists())})")
            print(next_commands(self.out, prompt_data=cfg.task.prompt_data, reward=cfg.task.reward))
            self.metrics.close()
        return last

    def _close_workers(self) -> None:
        """End the processes the run started: a reward worker pool, a --colocate engine."""
        reward_fn = self.manager.reward_fn if self.manager is not None else None
        if hasattr(reward_fn, "close"):  # a worker pool: its processes end with the run
            reward_fn.close()
        if self.colocated is not None:
            self.colocated.close()

    def rollout_and_update(self, k: int) -> dict:
        cfg, objective, policy = self.cfg, self.objective, self.policy
        prompts = self.task.draw(k, cfg.rollout.rollout_batch_size)
        request = objective.request(k)
        # Each rank rolls out its share of the groups, with the group indices (hence seeds) that the
        # groups have in a single-process run; the group counter stays global.
        mine = self.parallel.shard_of(len(prompts), "--rollout-batch-size")  # all of them in one process
        start = time.perf_counter()
        replay = cfg.replay
        if self.replaying:
            samples = load_rollout(replay.load_rollout_data, k, fingerprint=self.fingerprint, request=request,
                                   prompts=prompts, first_group_index=self.next_group_index).samples
        else:
            with policy.engine_weights(objective.rollout_ema):
                groups = asyncio.run(self.manager.rollout([p.prompt for p in prompts[mine]], request,
                                                          self.next_group_index + mine.start,
                                                          [p.metadata for p in prompts[mine]],
                                                          [[i.read() for i in p.images] for p in prompts[mine]]))
            samples = [s for g in groups for s in g]
        rollout_s = time.perf_counter() - start
        released = policy.engine_released_gib  # a --colocate engine's sleep after the rollout: what the device got back
        if replay.save_rollout_data is not None:
            save_rollout(replay.save_rollout_data, RolloutRecord(k, policy.weight_version, self.fingerprint, request,
                                                                 prompts, self.next_group_index, samples))
        self.next_group_index += len(prompts)

        # Advantages from every rank's rewards (batch-wide statistics see the whole rollout), then our rows.
        rewards = all_gather_rows(torch.tensor([s.reward for s in samples], dtype=torch.float64), self.parallel)
        n = cfg.rollout.n_samples_per_prompt
        a = cfg.algorithm
        terms = weights = None
        scheduled = {}
        if cfg.task.reward_schedule:  # this rollout's weights of the multi: terms, summed here
            term_weights = multi_weights(cfg.task.reward)
            term_weights = weights_at(term_weights, parse_schedule(cfg.task.reward_schedule, term_weights), k)
            rewards = all_gather_rows(reward_terms(samples, list(term_weights)), self.parallel) @ torch.tensor(
                list(term_weights.values()), dtype=torch.float64)
            scheduled = {f"rollout/reward_weight/{name}": w for name, w in term_weights.items()}
        if a.advantage_aggregation == "gdpo":  # each term of the multi: reward, normalized on its own
            weights = multi_weights(cfg.task.reward)
            if cfg.task.reward_schedule:
                weights = weights_at(weights, parse_schedule(cfg.task.reward_schedule, weights), k)
            terms = all_gather_rows(reward_terms(samples, list(weights)), self.parallel)
            weights = list(weights.values())
        adv = compute_advantages(rewards, [p.prompt for p in prompts for _ in range(n)],
                                 globalize_reward_mean=a.globalize_reward_mean,
                                 globalize_reward_std=a.globalize_reward_std,
                                 drop_zero_std_groups=a.drop_zero_std_groups, reward_terms=terms, term_weights=weights)
        rows = slice(mine.start * n, mine.stop * n)
        adv = dataclasses.replace(adv, values=adv.values[rows], keep=adv.keep[rows])
        record = {"rollout/reward/raw_mean": rewards.mean().item(), "rollout/reward/std": rewards.std().item(),
                  "rollout/zero_std_ratio": adv.zero_std_ratio, "rollout/seconds": rollout_s,
                  "rollout/images_per_s": len(samples) / rollout_s,
                  "rollout/sde_window_start": request.get("rollout_sde_step_indices", [-1])[0],
                  **({} if released is None else {"memory/engine_released_gib": released}), **scheduled}
        record.update(self.task.observe(prompts, rewards.view(len(prompts), n).tolist()))
        if self.parallel.is_main and k % cfg.eval.eval_interval == 0:  # a few samples, once per eval interval
            self.metrics.log_rollout_samples(samples, k + 1)
        if adv.zero_std_ratio == 1.0 and n > 1 and self.parallel.is_main:
            self._warn_no_signal(k, rewards)
        if replay.debug_rollout_only:
            return record
        kept = [i for i in range(len(samples)) if adv.keep[i]]
        if not kept:
            record["train/skipped"] = 1.0
            return record

        start = time.perf_counter()
        env = rollout_conditioning(samples, pad_text=policy.family.pads_text,
                                   image_conditioned=policy.family.accepts_image_conditioning)
        env.update(cond=[env["cond"][i] for i in kept], uncond=[env["uncond"][i] for i in kept])
        pairs = objective.pairs([samples[i] for i in kept], adv.values[kept].float(), env)
        if not len(pairs):  # e.g. sft when no sample beat its prompt's mean
            record["train/skipped"] = 1.0
            return record
        record.update(self.update(pairs, env))
        objective.after_update(k)
        train_s = time.perf_counter() - start
        record.update({"train/seconds": train_s, "train/pairs_per_s": len(pairs) / train_s, "train/pairs": len(pairs)})
        if cfg.model.compile and not self._compile_checked:  # every block has run forward and backward by now
            self._compile_checked = True
            eager = self.policy.uncompiled_block_kinds()
            record["compile/uncompiled_block_kinds"] = float(len(eager))
            if eager and self.parallel.is_main:
                print(f"warning: --compile: {', '.join(eager)} ran eager through the first rollout and update: "
                      "torch.compile skipped them (first called under a dispatch mode such as a FLOP counter or "
                      "profiler?); the run goes on at eager speed")
        if cfg.model.compile:
            full = self.policy.block_kinds_at_recompile_limit()
            record["compile/block_kinds_at_recompile_limit"] = float(len(full))
            if (new := sorted(set(full) - self._recompile_limit_named)) and self.parallel.is_main:
                limit = compile_setting("dynamo", "recompile_limit")  # the one compiled blocks run under
                print(f"warning: --compile: {', '.join(new)} compiled {limit} graphs, "
                      "dynamo's limit (torch._dynamo.config.recompile_limit): calls that need another graph run eager "
                      "from now on; shapes that keep changing are the usual cause")
            self._recompile_limit_named.update(full)
        if self.device.type == "cuda":  # since the engine's last batch: that batch, training, weights, optimizer
            record["memory/peak_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            torch.cuda.reset_peak_memory_stats(self.device)
        return record

    NO_SIGNAL_EVERY = 10  # rollouts between two warnings of a run that stays without signal

    def _warn_no_signal(self, k: int, rewards: torch.Tensor) -> None:
        """Every prompt group's rewards are equal: every advantage is 0 and nothing trains. Said at the first such
        rollout and every NO_SIGNAL_EVERY after, with the likely cause."""
        last = self._no_signal_warned
        if last is not None and k - last < self.NO_SIGNAL_EVERY:
            return
        self._no_signal_warned = k
        values = sorted({round(float(r), 4) for r in rewards})
        shown = ", ".join(f"{v:g}" for v in values[:4]) + (", …" if len(values) > 4 else "")
        print(f"warning: rollout {k}: every prompt group's samples got the same reward ({shown}), so every advantage "
              f"is 0 and nothing trains. The reward does not tell this model's samples apart: check it on a few "
              f"samples (diffrl evaluate … --reward {self.cfg.task.reward}), e.g. OCR reading no text at this "
              "resolution or model size, or a reward that saturates; more samples per prompt "
              "(--n-samples-per-prompt) or a graded reward give it spread")

    def update(self, pairs, env: dict) -> dict:
        """--num-steps-per-rollout optimizer steps over a random split of the pairs (of the samples, with all their
        pairs, where the objective keeps a sample's pairs together: `Objective.pairs_per_sample`), each accumulated
        over micro-batches of --micro-batch-size; a non-finite loss or gradient skips its step.

        Nothing here waits for the device per micro-batch: the pairs go to it without waiting (page-locked),
        the losses' statistics (float64 on the device, summed in the order a float sum would take) and whether
        a loss was finite stay there, the optimizer step reads its gradient norm and that flag together
        (`Policy.step`: one wait per step), and the statistics come back to the host once, at the end."""
        cfg, policy = self.cfg, self.policy
        lr = learning_rate(cfg, self.rollout_index)  # a function of the rollout: a resumed run agrees
        policy.set_lr(lr)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + self.rollout_index)
        per_sample = self.objective.pairs_per_sample(pairs)  # consecutive pairs of one sample, kept in one step
        if len(pairs) % per_sample:
            raise RuntimeError(f"{len(pairs)} train pairs do not split into samples of {per_sample} pairs each")
        samples = torch.randperm(len(pairs) // per_sample, generator=gen)
        chunks = [(c[:, None] * per_sample + torch.arange(per_sample)).flatten()
                  for c in samples.chunk(cfg.optim.num_steps_per_rollout) if len(c)]
        if policy.family.one_sample_per_forward:
            # Such a family batches only the rows of one prompt (models/cosmos3.py): a step's pairs in rollout order,
            # where each prompt's samples sit together, fill a micro-batch with one prompt's rows instead of a mix
            # that runs one forward per row. The step's gradient is the same sum in any order.
            chunks = [c.sort().values for c in chunks]
        # --micro-batch-size counts samples; a pair of a preference or group method holds several.
        size = max(1, cfg.optim.micro_batch_size // self.objective.samples_per_pair)
        shared = self.objective.micro_batch_key(pairs)  # what each micro-batch's pairs must share, if anything
        if shared is None:
            bounds = [micro_batch_bounds(None, size, len(c)) for c in chunks]
        else:  # stable: within one value, the order above
            by_key = [torch.sort(shared[c], stable=True) for c in chunks]
            chunks = [c[s.indices] for c, s in zip(chunks, by_key, strict=True)]
            bounds = [micro_batch_bounds(s.values, size) for s in by_key]
        totals: dict[str, float | torch.Tensor] = {}
        self.objective.start_update()
        for step, (chunk, micro_batches) in enumerate(zip(chunks, bounds, strict=True)):
            policy.optimizer.zero_grad(set_to_none=True)
            step_stats: dict[str, float | torch.Tensor] = {}
            nonfinite_loss = None  # on the device: whether a micro-batch's loss was not finite
            # The step's pairs in its order, page-locked on a GPU run: a micro-batch's copy to the device then does
            # not wait for the device (a copy from pageable memory waits for every kernel queued before it).
            part = pairs.select(chunk)
            if self.device.type == "cuda":
                part = part.pin_memory()
            for start, stop in micro_batches:
                batch = part.rows(start, stop).to(self.device, non_blocking=True)
                weight = len(batch) / len(chunk)
                loss, stats = self.objective.loss(batch, env, step)
                bad = ~torch.isfinite(loss.detach())
                nonfinite_loss = bad if nonfinite_loss is None else nonfinite_loss | bad
                # A non-finite loss's gradients are dropped with its step (every rank runs the same backward
                # passes, as FSDP's collectives need). A loss that reaches no trained parameter has no backward:
                # its pairs all went to a part without the adapter (--lora-components).
                if loss.requires_grad:
                    (loss * weight).backward()
                else:
                    step_stats["train/untrained_part_pairs"] = step_stats.get("train/untrained_part_pairs", 0.0) + len(batch)
                for key, value in stats.items():
                    step_stats[key] = step_stats.get(key, 0.0) + value.double() * weight
            grad_norm = policy.step(cfg.optim.grad_clip, cfg.algorithm.ema_decay, nonfinite_loss=nonfinite_loss)
            if grad_norm is None:
                policy.optimizer.zero_grad(set_to_none=True)
                totals["train/skipped_steps"] = totals.get("train/skipped_steps", 0.0) + 1
                continue
            step_stats["train/grad_norm"] = grad_norm
            self.objective.after_optimizer_step(policy.weight_version)
            for key, value in step_stats.items():
                totals[key] = totals.get(key, 0.0) + value / len(chunks)
        totals.update(self.objective.update_stats())
        totals["train/lr"] = lr
        return mean_over_ranks(to_host(totals), self.parallel)

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, k: int) -> dict:
        """The task's evaluation of the weights evaluation uses (the --use-ema EMA, else the current ones)."""
        if self.engine is None or not self.task.evaluates:  # replaying records samples nothing; or no task eval
            return {}
        size = self.cfg.eval.eval_condition_image_size
        with self.policy.engine_weights(self.policy.eval_ema):
            if not self.parallel.is_main:
                return {}
            family = self.engine.family
            with family.condition_images_sized(None if size is None else size * size):
                outcome = self.task.evaluate(family, k, self.out / "eval")
        if outcome.images is not None and len(outcome.images):
            self.metrics.log_images("eval/images", outcome.images, k, outcome.captions)
        return outcome.metrics

    def _keep_if_best(self, record: dict) -> None:
        """Save `checkpoints/best` when this evaluation's selection metric (the task's; never the
        held-out prompts) beats every earlier one. The main rank decides (it evaluates); every rank
        takes part in saving (FSDP gathers)."""
        key = self.task.selection_metric
        improved = key is not None and key in record and record[key] > self.best_selection
        if not any_rank(improved, self.parallel):
            return
        if self.parallel.is_main:
            self.best_selection = record[key]
        chosen = {"rollout": self.rollout_index, **{k: v for k, v in record.items() if k.startswith(("val/", "eval/"))}}
        self.checkpointer.save_best(chosen)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        meta = {"rollout_index": self.rollout_index, "next_group_index": self.next_group_index,
                "weight_version": self.policy.weight_version, "elapsed_s": self.elapsed_s,
                "task": self.task.state_dict(), "best_selection": self.best_selection,
                "loss_type": self.cfg.algorithm.loss_type}
        if self.metrics is not None:  # the records up to this rollout are on disk before its checkpoint is
            self.metrics.sync()
        return self.checkpointer.save(self.rollout_index, meta)

    def _resume(self) -> None:
        try:
            path, meta = self.checkpointer.load_latest()
        except FileNotFoundError:  # stopped before its first checkpoint: nothing to continue, nothing to lose
            if self.parallel.is_main:
                print(f"--resume: {self.out} holds no checkpoint yet; the run starts from rollout 0 in it")
            return
        self.resumed_from = path
        # Another objective would continue the weights under other losses and optimizer moments, in one metrics series
        # (checkpoints written before the loss type was kept have nothing to compare).
        saved, now = meta.get("loss_type"), self.cfg.algorithm.loss_type
        if saved is not None and saved != now:
            raise ValueError(f"--resume: the checkpoint was trained with --loss-type {saved}, this run asks for {now}; "
                             "resume with the same --loss-type, or start a new run from its weights in another "
                             "--output-dir")
        self.rollout_index = meta["rollout_index"]
        self.next_group_index = meta["next_group_index"]
        self.policy.weight_version = meta["weight_version"]
        if self.engine is not None:
            self.engine.weight_version = self.policy.weight_version
        self.elapsed_s = meta.get("elapsed_s", 0.0)
        self.best_selection = meta.get("best_selection", meta.get("best_val", -math.inf))
        self.task.load_state_dict(meta.get("task", meta))  # older checkpoints kept the sampler at the top
        if self.parallel.is_main:
            print(f"resumed from {path} at rollout {self.rollout_index}")


def reward_terms(samples: Sequence, names: list[str]) -> torch.Tensor:
    """Each sample's values of a multi: reward's terms, `[samples, terms]` in `names`' order (float64)."""
    missing = next((s for s in samples if not s.reward_terms or set(s.reward_terms) != set(names)), None)
    if missing is not None:
        raise ValueError(f"--advantage-aggregation gdpo and --reward-schedule read each term of the multi: reward, but "
                         f"the reward of {missing.prompt!r} came back without its terms {', '.join(names)} (a reward "
                         "scored elsewhere returns only the sum)")
    return torch.tensor([[s.reward_terms[name] for name in names] for s in samples], dtype=torch.float64)


def to_host(stats: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """The statistics with their tensors (0-dim, one dtype) read back to the host in one transfer, in place."""
    keys = [k for k, v in stats.items() if isinstance(v, torch.Tensor)]
    if keys:
        stats.update(zip(keys, torch.stack([stats[k] for k in keys]).tolist(), strict=True))
    return stats


def learning_rate(cfg: TrainConfig, rollout: int) -> float:
    """--lr, or its cosine decay to --lr × --lr-min-ratio over --num-rollout rollouts."""
    o, total = cfg.optim, cfg.rollout.num_rollout
    if o.lr_schedule == "constant" or total <= 1:
        return o.lr
    progress = min(rollout / (total - 1), 1.0)
    return o.lr * (o.lr_min_ratio + (1 - o.lr_min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    result = trainer.train()
    finish_parallel(trainer.parallel)  # a torchrun rank exits here (see finish_parallel)
    return result


__all__ = ["Trainer", "train", "validate_config"]
