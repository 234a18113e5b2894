"""A whole rollout through the in-process engine with and without cross-request batching.

A rollout of G prompt groups × n samples in microgroups of M is G·n/M requests; with
`--max-batch-outputs 1` the engine denoises each request alone (one forward per request per step),
otherwise waiting requests with the same settings share a batch. Prints images/s for each setting
and checks that every sample is the same either way (exact on CPU).

    .venv/bin/python benchmarks/engine_batching.py --device cpu --groups 8 --n 8 --m 8
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import time

import torch
from report import emit

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.models import resolve_family
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rollout import InProcessEngineClient, RolloutManager, RolloutSettings


def rollout_once(engine: Engine, prompts: list[str], n: int, m: int, request: dict) -> tuple[float, torch.Tensor, int]:
    settings = RolloutSettings(n_samples_per_prompt=n, rollout_microgroup_size=m)
    manager = RolloutManager([InProcessEngineClient(engine)], settings, engine_concurrency=len(prompts) * n)
    batches = engine.denoise_batches
    start = time.perf_counter()
    groups = asyncio.run(manager.rollout(prompts, request))
    seconds = time.perf_counter() - start
    images = torch.stack([s.output.generated_output for g in groups for s in g])
    return seconds, images, engine.denoise_batches - batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--batch-limits", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    family = resolve_family(None, SHIPPED_DEMO_MODEL).load(SHIPPED_DEMO_MODEL, device=device)
    prompts = [f"{k} circles" for k in ("two", "three", "four")] * args.groups
    prompts = prompts[: args.groups]
    request = dict(num_inference_steps=args.steps, guidance_scale=args.guidance_scale, rollout=True,
                   rollout_sde_type="sde", rollout_noise_level=0.7, rollout_sde_step_indices=[1, 2],
                   rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    results = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
               "threads": torch.get_num_threads(), "groups": args.groups, "n": args.n, "m": args.m,
               "steps": args.steps, "guidance_scale": args.guidance_scale, "runs": {}}
    reference = None
    for limit in args.batch_limits:
        engine = Engine(family, EngineConfig(max_outputs_per_request=args.n, max_batch_outputs=limit))
        rollout_once(engine, prompts, args.n, args.m, request)  # warm-up
        timings = [rollout_once(engine, prompts, args.n, args.m, request) for _ in range(args.repeats)]
        seconds = sorted(t[0] for t in timings)[len(timings) // 2]
        images, batches = timings[-1][1], timings[-1][2]
        reference = images if reference is None else reference
        results["runs"][limit] = {"images_per_s": len(images) / seconds, "rollout_s": seconds,
                                  "denoise_batches": batches, "max_abs_diff_vs_first": float((images - reference).abs().max())}
        print(f"max_batch_outputs={limit:<4} {len(images) / seconds:8.2f} images/s  ({seconds:.2f} s, "
              f"{batches} batches for {args.groups * -(-args.n // args.m)} requests)", flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
