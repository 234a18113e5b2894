"""Rollout throughput with K engines placed by Ray (one GPU each on a multi-GPU machine).

The driver runs the rollout manager; each engine is an `EngineActor` (diffrl.launch.ray_placement)
reached through `RayEngineClient`, with least-loaded routing. Prints images/s for each K and the
ratio to K = 1 (issue 6 asks for >= 1.8x with two engines).

    python benchmarks/ray_engines.py --engines 1 2 --gpus-per-engine 1 --groups 32 --n 16 --m 16
"""

from __future__ import annotations

import argparse
import asyncio
import time

import ray
from report import emit

from diffrl.launch.ray_placement import EngineActor, RayEngineClient
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rollout import RolloutConfig, RolloutManager


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--gpus-per-engine", type=float, default=0.0)
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    request = dict(num_inference_steps=args.steps, guidance_scale=args.guidance_scale, rollout=True,
                   rollout_sde_type="sde", rollout_noise_level=0.7, rollout_sde_step_indices=[1, 2],
                   rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    prompts = [f"{k} circles" for k in ("two", "three", "four")] * args.groups
    results = {"resources": ray.cluster_resources(), "groups": args.groups, "n": args.n, "m": args.m,
               "steps": args.steps, "guidance_scale": args.guidance_scale, "images_per_s": {}}
    for k in args.engines:
        actor_cls = ray.remote(EngineActor).options(num_cpus=1, num_gpus=args.gpus_per_engine, max_concurrency=64)
        actors = [actor_cls.remote(str(SHIPPED_DEMO_MODEL), None, args.n, 512) for _ in range(k)]
        clients = [RayEngineClient(a, f"engine-{i}") for i, a in enumerate(actors)]
        config = RolloutConfig(n_samples_per_prompt=args.n, rollout_microgroup_size=args.m,
                               engine_concurrency=32, request=request)
        manager = RolloutManager(clients, config)
        asyncio.run(manager.rollout(prompts[: args.groups]))  # warm-up
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            asyncio.run(manager.rollout(prompts[: args.groups]))
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
        results["images_per_s"][k] = args.groups * args.n / seconds
        print(f"{k} engine(s): {args.groups * args.n / seconds:9.1f} images/s ({seconds:.2f} s per rollout)", flush=True)
        for a in actors:
            ray.kill(a)
    one = results["images_per_s"].get(1)
    if one:
        results["speedup_over_one_engine"] = {k: v / one for k, v in results["images_per_s"].items()}
    emit(results, args.out)


if __name__ == "__main__":
    main()
