"""Where a training rollout's time goes, on the shipped demo model: the GPU recipes' rollout
(32 prompt groups × 16 samples, microgroups of 16, 10 steps) measured whole and then piece by piece,
each the median of `--repeats` after a warm-up:

  rollout + reward   the trainer's path: RolloutManager, in-process engine, shapes reward in a worker pool
  rollout            the same without the reward
  engine, 1 batch    one 512-output request straight to the engine (what cross-request batching aims at)
  DiT forwards       the steps' velocity calls alone at batch 512 (synchronized), as the engine makes them
  DiT, no sync       the same model without the batch-invariance wrapper of its timestep MLP (until
                     2026-12-01 the wrapper called torch.unique, a host sync, twice per forward)
  DiT, compiled      the wrapper-free forwards through torch.compile (with --compile)

    python benchmarks/rollout_breakdown.py --device cuda --out benchmarks/results/rollout_breakdown_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

import torch
from report import emit
from rollout_timing import REQUESTS

from diffrl.data.shapes.grammar import train_prompts
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models.demo import SHIPPED_DEMO_MODEL, DemoFamily
from diffrl.rewards import get_reward
from diffrl.rewards.workers import ProcessRewardPool
from diffrl.rollout import InProcessEngineClient, RolloutManager, RolloutSettings


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn, repeats: int, device: torch.device) -> float:
    fn()  # warm-up (and compilation, where there is any)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--kind", choices=sorted(REQUESTS), default="nft")
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reward-workers", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="also time the forwards through torch.compile")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what the GPU recipes run with (fp32 weights + TF32)
        torch.backends.cudnn.allow_tf32 = True
    family = DemoFamily.load(SHIPPED_DEMO_MODEL, device=device)
    request = dict(REQUESTS[args.kind], num_inference_steps=args.steps)
    every = train_prompts()
    prompts = every[:: max(1, len(every) // args.groups)][: args.groups]
    total = args.groups * args.n
    engine = Engine(family, EngineConfig(max_outputs_per_request=total, max_batch_outputs=total))
    settings = RolloutSettings(n_samples_per_prompt=args.n, rollout_microgroup_size=args.n)
    seconds: dict[str, float] = {}

    pool = ProcessRewardPool("shapes", args.reward_workers) if args.reward_workers else get_reward("shapes")
    with_reward = RolloutManager([InProcessEngineClient(engine)], settings, reward_fn=pool, engine_concurrency=args.groups)
    seconds["rollout + reward"] = median_seconds(lambda: asyncio.run(with_reward.rollout(prompts, request)), args.repeats, device)
    if hasattr(pool, "close"):
        pool.close()
    plain = RolloutManager([InProcessEngineClient(engine)], settings, engine_concurrency=args.groups)
    seconds["rollout"] = median_seconds(lambda: asyncio.run(plain.rollout(prompts, request)), args.repeats, device)
    one_request = RolloutRequest(prompt=prompts[0], seed=0, num_outputs_per_prompt=total, **request)
    seconds["engine, 1 batch"] = median_seconds(lambda: engine.generate(one_request), args.repeats, device)

    cond = family.encode_prompts([prompts[0]]).repeat(total)
    latents = family.prepare_latents([torch.Generator(device=device).manual_seed(k) for k in range(total)], 64, 64)
    sigmas = family.sigmas(args.steps, 64, 64)

    def forwards(transformer) -> None:
        with torch.no_grad():
            for i in range(args.steps):
                family.velocity(transformer, latents, sigmas[i].expand(total), cond, None, 1.0)

    seconds["DiT forwards"] = median_seconds(lambda: forwards(family.transformer), args.repeats, device)
    plain_family = DemoFamily.load(SHIPPED_DEMO_MODEL, device=device, batch_invariant=False)
    seconds["DiT, no sync"] = median_seconds(lambda: forwards(plain_family.transformer), args.repeats, device)
    if args.compile:
        compiled = torch.compile(plain_family.transformer)
        seconds["DiT, compiled"] = median_seconds(lambda: forwards(compiled), args.repeats, device)

    rollout_s = seconds["rollout + reward"]
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "torch": torch.__version__, "host_cpus": os.cpu_count(), "kind": args.kind, "images": total,
               "steps": args.steps, "reward_workers": args.reward_workers,
               "seconds": seconds, "images_per_s": {k: total / v for k, v in seconds.items()},
               "share_of_rollout": {k: v / rollout_s for k, v in seconds.items()}}
    for name, s in seconds.items():
        print(f"{name:<18} {s:7.3f} s  {total / s:8.0f} images/s  {s / rollout_s:6.1%} of the rollout", flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
