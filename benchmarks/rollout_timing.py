"""Shared measure of the engine-scaling benchmarks: images/s of whole rollouts through the rollout
manager over a list of engine clients (least-loaded routing, the trainer's own path)."""

from __future__ import annotations

import asyncio
import time

from diffrl.rollout import RolloutManager, RolloutSettings

# What an NFT training rollout asks for (docs/architecture.md, "Data flow"): CFG-free ODE, only the final image kept.
NFT_ROLLOUT = dict(num_inference_steps=10, guidance_scale=1.0, rollout=True, rollout_sde_type="ode")
# What a Flow-GRPO rollout asks for: SDE on two steps with log-probs, trajectories and conditioning back.
GRPO_ROLLOUT = dict(num_inference_steps=10, guidance_scale=1.0, rollout=True, rollout_sde_type="sde",
                    rollout_noise_level=0.7, rollout_sde_step_indices=[1, 2], rollout_return_dit_trajectory=True,
                    rollout_return_denoising_env=True)
REQUESTS = {"nft": NFT_ROLLOUT, "grpo": GRPO_ROLLOUT}


def rollout_seconds(clients: list, request: dict, groups: int, n: int, m: int, concurrency: int,
                    repeats: int) -> float:
    """Median wall seconds of a rollout of `groups` prompt groups × `n` samples, after one warm-up."""
    prompts = [p for p in ("two circles", "three red squares", "a blue triangle to the left of a green circle")
               for _ in range(groups)][:groups]
    settings = RolloutSettings(n_samples_per_prompt=n, rollout_microgroup_size=m)
    manager = RolloutManager(clients, settings, engine_concurrency=concurrency)
    asyncio.run(manager.rollout(prompts, request))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        asyncio.run(manager.rollout(prompts, request))
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def add_scaling_args(parser, *, kind: str, groups: int) -> None:
    """The flags both engine-scaling benchmarks take."""
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--kind", choices=sorted(REQUESTS), default=kind)
    parser.add_argument("--groups", type=int, default=groups)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--m", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32, help="in-flight requests per engine")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)


def record_engines(results: dict, k: int, seconds: float, images: int) -> None:
    """Store and print K engines' throughput, and every K's speed-up over one engine."""
    results["images_per_s"][k] = images / seconds
    print(f"{k} engine(s): {images / seconds:9.1f} images/s ({seconds:.2f} s per rollout)", flush=True)
    one = results["images_per_s"].get(1)
    if one:
        results["speedup_over_one_engine"] = {n: v / one for n, v in results["images_per_s"].items()}
