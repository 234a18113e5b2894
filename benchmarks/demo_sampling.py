"""Sampling cost of the shipped demo model: transformer forward per sample at several batch sizes,
and whole 10-step images with and without CFG. Runs on CPU or CUDA (`--device`).

    .venv/bin/python benchmarks/demo_sampling.py --device cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.evaluation.shapes import generate
from diffrl.models.base import Latents
from diffrl.models.demo import DemoFamily
from diffrl.sampling import make_generators


def _timed(fn, device, reps):
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    device = torch.device(args.device)
    family = DemoFamily.load(SHIPPED_DEMO_MODEL, device=device)
    results = {"device": str(device), "machine": platform.node(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "forward_ms_per_sample": {}, "image_s": {}}
    for batch in (1, 8, 16):
        latents = family.prepare_latents(make_generators(range(batch), device=device), 64, 64)
        cond = family.encode_prompts(["a red circle"]).repeat(batch)
        sigma = torch.full((batch,), 0.5, device=device)
        seconds = _timed(lambda: family.velocity(family.transformer, Latents(latents.tokens, latents.ids), sigma,
                                                 cond, None, 1.0), device, args.reps)
        results["forward_ms_per_sample"][batch] = 1000 * seconds / batch
    for scale in (1.0, 3.0):
        seconds = _timed(lambda: generate(family, ["a red circle"] * 16, list(range(16)), num_steps=10,
                                          guidance_scale=scale, batch_size=16), device, 1)
        results["image_s"][f"10 steps, CFG {scale}, batch 16"] = seconds / 16
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
