"""Rollout cost of a real-size model family on random weights: our engine against the transformer alone
and against diffusers' own pipeline on the same weights in the same run.

    python benchmarks/family_rollout.py --family sd3 --checkpoint /tmp/sd35m --resolution 512 --guidance-scale 4.5
    python benchmarks/family_rollout.py --family flux3_image --checkpoint /tmp/flux3 --resolution 1024 --guidance-scale 1

A missing `--checkpoint` folder is first filled with random weights at the family's real size, built in
code (no download; `REAL_SIZES` below: SD3.5-Medium, FLUX 3 Klein's class defaults, Krea-2, Qwen-Image),
with shallow text encoders where the family's builder makes them (a prompt is encoded once per request).

What it measures is `diffrl bench` (`diffrl/cli/bench.py` says what; the baseline is diffusers' own
pipeline on the same weights, in the same run, for families with a `reference_pipeline()`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from report import emit

from diffrl.cli.bench import BenchConfig, bench


# family → extra arguments of its `diffrl.models.random_checkpoints` module's save_random_checkpoint
REAL_SIZES = {
    "sd3": {"with_t5": False},  # SD3.5-Medium, 2.24 B
    "flux3_image": {},  # 5.54 B
    "krea2": {},  # 12.8 B (26 GB on disk in bf16)
    "qwen_image": {},  # 20.4 B (41 GB)
}


def make_checkpoint(family: str, path: Path, device: torch.device) -> None:
    import importlib

    if family not in REAL_SIZES:
        raise SystemExit(f"--family {family}: this benchmark makes random checkpoints for {', '.join(REAL_SIZES)}")
    module = importlib.import_module(f"diffrl.models.random_checkpoints.{family}")
    start = time.perf_counter()
    module.save_random_checkpoint(path, module.real(), device=device, dtype=torch.bfloat16, **REAL_SIZES[family])
    print(f"wrote a random {family} checkpoint to {path} in {time.perf_counter() - start:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=sorted(REAL_SIZES), required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--resolution", type=int, default=None, help="default: the family's")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the family's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200: 790)")
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of the family's blocks")
    parser.add_argument("--eager-numerics", action="store_true",
                        help="with --compile: inductor's emulate_precision_casts (the trainer's default)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not args.checkpoint.exists():
        make_checkpoint(args.family, args.checkpoint, torch.device(args.device))
    results = bench(BenchConfig(
        model_path=args.checkpoint, diffusion_model_family=args.family, device=args.device, dtype=args.dtype,
        resolution=args.resolution, n=args.n, ms=tuple(args.ms), steps=args.steps, guidance_scale=args.guidance_scale,
        repeats=args.repeats, peak_tflops=args.peak_tflops, compile=args.compile, eager_numerics=args.eager_numerics))
    emit(results, args.out)


if __name__ == "__main__":
    main()
