"""Rollout cost of a real-size model family: our engine against the transformer alone and, for SD3,
against diffusers' own pipeline on the same weights in the same run.

    python benchmarks/family_rollout.py --family sd3 --checkpoint /tmp/sd35m --resolution 512 --guidance-scale 4.5
    python benchmarks/family_rollout.py --family flux3_image --checkpoint /tmp/flux3 --resolution 1024 --guidance-scale 1

A missing `--checkpoint` folder is first filled with random weights at the real size, built in code
(no download): SD3.5-Medium's transformer and VAE (`SD3Sizes.medium()`, 2.24 B parameters), or
`Flux3Transformer2DModel`'s default configuration (`Flux3Sizes.class_defaults()`, 5.54 B), each with
shallow text encoders of the real widths (a prompt is encoded once per request).

Measured, in `--dtype` weights:
- the transformer alone: ms per sample of one denoising step (both CFG halves when CFG is on) at batch
  1 and batch n, GFLOP counted by torch's FlopCounterMode, MFU against `--peak-tflops`;
- the engine: one group of n samples as a Flow-GRPO rollout request (SDE with log-probs on two steps,
  trajectories and conditioning returned) in microgroups of M, in-process: seconds per image, and
  what fraction of the group's time the transformer's forwards alone would take;
- SD3 only: `StableDiffusion3Pipeline` (ODE, nothing returned but images) at 1 and n images per call.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import torch
from engine_microgroups import time_group
from report import emit
from torch.utils.flop_counter import FlopCounterMode

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.models.compile import compile_blocks
from diffrl.models.registry import get_family
from diffrl.rollout import InProcessEngineClient
from diffrl.sampling import make_generators

PROMPT = "a blue square to the left of a yellow circle"


def make_checkpoint(family: str, path: Path, device: torch.device) -> None:
    start = time.perf_counter()
    if family == "sd3":
        from diffrl.models.sd3 import SD3Sizes, save_random_checkpoint

        save_random_checkpoint(path, SD3Sizes.medium(), with_t5=False, device=device, dtype=torch.bfloat16)
    elif family == "flux3_image":
        from diffrl.models.flux3_image import Flux3Sizes, save_random_checkpoint

        save_random_checkpoint(path, Flux3Sizes.class_defaults(), device=device, dtype=torch.bfloat16)
    else:
        raise SystemExit(f"--family {family}: this benchmark makes random checkpoints for sd3 and flux3_image only")
    print(f"wrote a random {family} checkpoint to {path} in {time.perf_counter() - start:.0f} s", flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms_per_call(run, device: torch.device, reps: int) -> float:
    """ms per call of `run` over `reps` calls, after one warm-up call."""
    run()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        run()
    _sync(device)
    return 1000 * (time.perf_counter() - start) / reps


def _step_inputs(family, batch: int, size: int, guidance: float):
    device = family.device
    latents = family.prepare_latents(make_generators(range(batch), device=device), size, size)
    cond = family.encode_prompts([PROMPT]).repeat(batch)
    uncond = family.encode_prompts([""]).repeat(batch) if guidance > 1 else None
    return latents, torch.full((batch,), 0.5, device=device), cond, uncond


@torch.no_grad()
def transformer_gflop(family, batch: int, size: int, guidance: float) -> float:
    """GFLOP per sample of one denoising step's transformer work (cond + uncond when CFG is on), counted
    eagerly (before any compilation: the counter does not see inside compiled graphs)."""
    latents, sigma, cond, uncond = _step_inputs(family, batch, size, guidance)
    with FlopCounterMode(display=False) as counter:
        family.velocity(family.transformer, latents, sigma, cond, uncond, guidance)
    return counter.get_total_flops() / batch / 1e9


@torch.no_grad()
def transformer_step_ms(family, batch: int, size: int, guidance: float, reps: int) -> float:
    """ms per sample of one denoising step's transformer work, after two warm-up calls."""
    latents, sigma, cond, uncond = _step_inputs(family, batch, size, guidance)

    def run():
        return family.velocity(family.transformer, latents, sigma, cond, uncond, guidance)

    run()  # two warm-up calls: the first may compile
    return _ms_per_call(run, family.device, reps) / batch


@torch.no_grad()
def decode_ms_per_image(family, batch: int, size: int, reps: int) -> dict[str, float]:
    """ms per image of the family's VAE decode: one image per call (what the engine did until
    2026-12-01, and still does on CPU) and the family's own `decode` (chunks on a GPU)."""
    latents = family.prepare_latents(make_generators(range(batch), device=family.device), size, size).tokens
    ways = {"one_per_call": lambda: torch.cat([family.decode(row[None], size, size) for row in latents]),
            "family_decode": lambda: family.decode(latents, size, size)}
    return {name: _ms_per_call(run, family.device, reps) / batch for name, run in ways.items()}


@torch.no_grad()
def sd3_pipeline_s_per_image(family, batch: int, size: int, steps: int, guidance: float, repeats: int) -> float:
    pipe = family.reference_pipeline()
    generator = torch.Generator(family.device).manual_seed(0)

    def run():
        pipe(prompt=PROMPT, num_inference_steps=steps, guidance_scale=guidance, height=size, width=size,
             num_images_per_prompt=batch, generator=generator, output_type="pt")

    run()
    times = []
    for _ in range(repeats):
        _sync(family.device)
        start = time.perf_counter()
        run()
        _sync(family.device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / batch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=["sd3", "flux3_image"], required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--resolution", type=int, default=None, help="default: the family's")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200: 790)")
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of the family's blocks")
    parser.add_argument("--eager-numerics", action="store_true",
                        help="with --compile: inductor's emulate_precision_casts (the trainer's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if not args.checkpoint.exists():
        make_checkpoint(args.family, args.checkpoint, device)
    family = get_family(args.family).load(args.checkpoint, device=device, dtype=dtype)
    size = args.resolution or family.default_size()[0]
    family.check_size(size, size)
    on_gpu = device.type == "cuda"
    results = {"family": args.family, "checkpoint": str(args.checkpoint),
               "device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "dtype": args.dtype,
               "transformer_params": sum(p.numel() for p in family.transformer.parameters()), "resolution": size,
               "n": args.n, "steps": args.steps, "guidance_scale": args.guidance_scale, "compile": args.compile,
               "eager_numerics": args.compile and args.eager_numerics, "transformer": {},
               "engine": {}}
    reps = 5 if on_gpu else 1
    batches = sorted({1, args.n})
    gflops = {batch: transformer_gflop(family, batch, size, args.guidance_scale) for batch in batches}
    if args.compile:
        start = time.perf_counter()
        compile_blocks(family.transformer, family.block_lists, eager_numerics=args.eager_numerics)
        transformer_step_ms(family, args.n, size, args.guidance_scale, 1)
        results["compile_s"] = time.perf_counter() - start
        print(f"compiled the blocks and ran batch {args.n}: {results['compile_s']:.0f} s", flush=True)
    for batch in batches:
        ms, gflop = transformer_step_ms(family, batch, size, args.guidance_scale, reps), gflops[batch]
        results["transformer"][batch] = {"ms_per_sample_step": ms, "gflop_per_sample_step": gflop,
                                         "mfu": gflop / ms / args.peak_tflops if on_gpu else None}
        print(f"transformer batch {batch:>2}: {ms:8.2f} ms per sample-step, {gflop:,.0f} GFLOP", flush=True)
    results["decode_ms_per_image"] = decode_ms_per_image(family, args.n, size, 2 if on_gpu else 1)
    print("VAE decode, ms per image: " + ", ".join(f"{k} {v:.1f}" for k, v in results["decode_ms_per_image"].items()),
          flush=True)
    floor_ms = results["transformer"][args.n]["ms_per_sample_step"] * args.steps
    engine = Engine(family, EngineConfig(max_outputs_per_request=args.n, max_batch_outputs=args.n))
    request = dict(num_inference_steps=args.steps, guidance_scale=args.guidance_scale, rollout=True,
                   rollout_sde_type="sde", rollout_noise_level=0.7, rollout_sde_step_indices=[1, 2],
                   rollout_return_dit_trajectory=True, rollout_return_denoising_env=True,
                   height=size, width=size)
    client = InProcessEngineClient(engine)
    for m in args.ms:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        seconds, _ = asyncio.run(time_group(client, args.n, m, request, args.repeats))
        per_image = seconds / args.n
        results["engine"][m] = {"s_per_image": per_image, "images_per_s": 1 / per_image,
                                "transformer_share": floor_ms / 1000 / per_image,
                                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None}
        print(f"engine M={m:<2}: {per_image:.3f} s per image ({1 / per_image:.2f} images/s; the batch-{args.n} "
              f"transformer alone: {floor_ms / 1000:.3f} s)", flush=True)
    if args.family == "sd3":
        results["sd3_pipeline"] = {}
        for batch in sorted({1, args.n}):
            per_image = sd3_pipeline_s_per_image(family, batch, size, args.steps, args.guidance_scale, args.repeats)
            results["sd3_pipeline"][batch] = {"s_per_image": per_image}
            print(f"StableDiffusion3Pipeline, {batch:>2} images per call: {per_image:.3f} s per image", flush=True)
        best_engine = min(r["s_per_image"] for r in results["engine"].values())
        results["pipeline_batch1_over_engine"] = results["sd3_pipeline"][1]["s_per_image"] / best_engine
        results[f"pipeline_batch{args.n}_over_engine"] = results["sd3_pipeline"][args.n]["s_per_image"] / best_engine
    emit(results, args.out)


if __name__ == "__main__":
    main()
