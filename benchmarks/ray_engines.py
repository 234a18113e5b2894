"""Rollout throughput with K engines placed by Ray (one GPU each on a multi-GPU machine).

The driver runs the rollout manager; each engine is an `EngineActor` (diffrl.launch.ray_placement)
reached through `RayEngineClient`, with least-loaded routing. Prints images/s for each K and the
ratio to K = 1 (issue 6 asks for >= 1.8x with two engines).

    python benchmarks/ray_engines.py --engines 1 2 --gpus-per-engine 1 --groups 32 --n 16 --m 16 --kind grpo
"""

from __future__ import annotations

import argparse

import ray
from report import emit
from rollout_timing import REQUESTS, add_scaling_args, record_engines, rollout_seconds

from diffrl.launch.ray_placement import EngineActor, RayEngineClient
from diffrl.models.demo import SHIPPED_DEMO_MODEL


def main() -> None:
    parser = argparse.ArgumentParser()
    add_scaling_args(parser, kind="grpo", groups=32)
    parser.add_argument("--gpus-per-engine", type=float, default=0.0)
    args = parser.parse_args()
    ray.init(include_dashboard=False, log_to_driver=False)
    results = {"resources": ray.cluster_resources(), "kind": args.kind, "groups": args.groups, "n": args.n,
               "m": args.m, "images_per_s": {}}
    for k in args.engines:
        actor_cls = ray.remote(EngineActor).options(num_cpus=1, num_gpus=args.gpus_per_engine, max_concurrency=64)
        actors = [actor_cls.remote(str(SHIPPED_DEMO_MODEL), None, args.n, 512) for _ in range(k)]
        clients = [RayEngineClient(a, f"engine-{i}") for i, a in enumerate(actors)]
        seconds = rollout_seconds(clients, REQUESTS[args.kind], args.groups, args.n, args.m, args.concurrency,
                                  args.repeats)
        record_engines(results, k, seconds, args.groups * args.n)
        for a in actors:
            ray.kill(a)
    emit(results, args.out)


if __name__ == "__main__":
    main()
