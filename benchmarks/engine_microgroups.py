"""Images per second for one group of n samples at microgroup sizes M, in-process and over HTTP.

    python benchmarks/engine_microgroups.py --model demo --device cpu
    python benchmarks/engine_microgroups.py --model sd35m-compute --device cuda --dtype bfloat16

`--model demo` is the shipped demo model. `--model sd35m-compute` is a random-weight
Flux3Transformer2DModel with SD3.5-Medium's hidden size (24 heads × 64 = 1536) and its
per-sample compute at 512² (1,024 image tokens, 2 per-mode + 36 joint blocks ≈ 2.4 TFLOP per
forward; SD3.5-M's own is 2,442 GFLOP, `benchmarks/flop_split.py`), run through the demo family's code path.
The HTTP server runs in a thread of the same process (uvicorn on loopback): the figure includes
request parsing, msgpack/safetensors encoding and decoding, and the socket round trip.
Also reported: the transformer alone at batch 1 and batch M (the speed-up the engine should keep)
and model FLOP utilisation against `--peak-tflops` (790 for an H200 in bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib

import torch
from report import emit

from diffrl.cli.bench import time_group, transformer_gflop, transformer_step_ms
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.models.demo import SHIPPED_DEMO_MODEL, DemoConfig, DemoFamily
from diffrl.models.random_checkpoints.demo import random_family
from diffrl.rollout import HttpEngineClient, InProcessEngineClient


def build_family(model: str, device: torch.device, dtype: torch.dtype) -> DemoFamily:
    if model == "demo":
        return DemoFamily.load(SHIPPED_DEMO_MODEL, device=device, dtype=dtype)
    config = DemoConfig(image_size=128)  # 128/4 = 32 → 1,024 image tokens, like SD3 at 512²
    config.transformer.update(num_layers=2, num_single_layers=36, attention_head_dim=64, num_attention_heads=24,
                              timestep_channels=256, axes_dims_rope=(16, 16, 16, 16))
    with torch.device(device):
        family = random_family(config, seed=0)
    family.transformer.to(dtype=dtype).eval().requires_grad_(False)
    family.text_encoder.eval().requires_grad_(False)
    return family


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["demo", "sd35m-compute"], default="demo")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=4.5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["inproc", "http"])
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    family = build_family(args.model, device, dtype)
    # One request per batch: this benchmark isolates what the microgroup size buys; merging waiting
    # requests (the engine's default) is measured by benchmarks/engine_batching.py.
    engine = Engine(family, EngineConfig(max_outputs_per_request=args.n, max_batch_outputs=1))
    request = dict(num_inference_steps=args.steps, guidance_scale=args.guidance_scale, rollout=True,
                   rollout_sde_type="sde", rollout_noise_level=0.7, rollout_sde_step_indices=[2, 3],
                   rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    params = sum(p.numel() for p in family.transformer.parameters())
    results = {"model": args.model, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "transformer_params": params, "n": args.n, "steps": args.steps,
               "guidance_scale": args.guidance_scale, "transformer": {}, "images_per_s": {}}
    reps = 5 if device.type == "cuda" else 2
    for batch in sorted({1, *args.ms}):
        size = (family.config.image_size,) * 2  # one conditional forward (guidance 1)
        ms = transformer_step_ms(family, batch, size, 1.0, reps)
        gflop = transformer_gflop(family, batch, size, 1.0)
        results["transformer"][batch] = {"ms_per_sample": ms, "gflop_per_sample": gflop,
                                         "mfu": gflop / ms / args.peak_tflops if device.type == "cuda" else None}
    with contextlib.ExitStack() as stack:  # the HTTP server, when one is asked for, stops at the end
        for transport in args.transports:
            if transport == "http":
                client = HttpEngineClient(stack.enter_context(serving_in_thread(create_app(engine))))
            else:
                client = InProcessEngineClient(engine)
            images = {}
            for m in args.ms:
                seconds, images[m] = asyncio.run(time_group(client, args.n, m, request, args.repeats))
                forwards = args.n * args.steps * (2 if args.guidance_scale > 1 else 1)
                gflop = results["transformer"][1]["gflop_per_sample"]
                results["images_per_s"][f"{transport} M={m}"] = {
                    "images_per_s": args.n / seconds, "group_s": seconds,
                    "mfu": forwards * gflop / seconds / 1e3 / args.peak_tflops if device.type == "cuda" else None,
                }
                print(f"{transport:>6} M={m:<2} {args.n / seconds:8.2f} images/s  ({seconds:.2f} s per group)", flush=True)
            # Same seeds, different batch sizes: exact on CPU; on GPU kernels may round differently per batch size.
            reference = images[max(args.ms)]
            results[f"{transport}_max_abs_diff_vs_M{max(args.ms)}"] = {
                m: float((img - reference).abs().max()) for m, img in images.items()}
    for transport in args.transports:
        one, eight = results["images_per_s"].get(f"{transport} M=1"), results["images_per_s"].get(f"{transport} M=8")
        if one and eight:
            results[f"{transport}_M8_over_M1"] = eight["images_per_s"] / one["images_per_s"]
    t = results["transformer"]
    if 8 in t:
        results["transformer_b8_over_b1"] = t[1]["ms_per_sample"] / t[8]["ms_per_sample"]
    emit(results, args.out)


if __name__ == "__main__":
    main()
