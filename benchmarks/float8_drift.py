"""How far `--float8` moves a family's samples from its plain forward, and what it saves, on the same weights
and seeds in one run.

    python benchmarks/float8_drift.py --family sd3 --checkpoint /tmp/sd35m --resolution 512 --guidance-scale 4.5
    python benchmarks/float8_drift.py --family flux3_image --checkpoint /tmp/flux3 --guidance-scale 1

One Flow-GRPO request of `--n` outputs (SDE on `--sde-steps`, trajectories returned) through the engine, plain
and then with the blocks' linear layers in FP8 (`diffrl.models.float8`): per output, the relative L2 distance of
the final latent and the PSNR of the decoded image against the plain forward's, the mean |Δ log p| of the SDE
steps (each sample's own trajectory), and seconds per image for each forward (median of `--repeats` after a
warm-up). A missing `--checkpoint` folder is first filled with random weights at the family's real size
(`family_rollout.make_checkpoint`). Random weights lack the outlier channels of trained ones, which FP8 rounds
worst, so a trained model's drift is measured by evaluating it both ways (`diffrl evaluate --float8`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from family_rollout import add_checkpoint_arguments, make_checkpoint
from report import emit

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models import resolve_family
from diffrl.models.speed import SpeedOptions


def timed_generate(engine: Engine, request: RolloutRequest, repeats: int, device: torch.device):
    outputs, times = None, []
    for _ in range(repeats + 1):  # the first is the warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        outputs = engine.generate(request)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return outputs, statistics.median(times[1:]) / request.num_outputs_per_prompt


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR of two images in [0, 1] (or uint8, scaled)."""
    scale = 255.0 if a.dtype == torch.uint8 else 1.0
    mse = ((a.float() - b.float()) / scale).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1.0 / mse)).item()


def drift(plain, fp8) -> dict:
    """Per-output distances between the two forwards' outputs of one request, summarized."""
    latent_rel, psnrs, logp = [], [], []
    for a, b in zip(plain, fp8, strict=True):
        la, lb = a.dit_trajectory.latents[-1].float(), b.dit_trajectory.latents[-1].float()
        latent_rel.append(((lb - la).norm() / la.norm()).item())
        psnrs.append(psnr(a.generated_output, b.generated_output))
        logp.append((a.rollout_log_probs - b.rollout_log_probs).abs().mean().item())
    return {"final_latent_relative_l2": statistics.mean(latent_rel), "image_psnr_db": statistics.mean(psnrs),
            "image_psnr_db_min": min(psnrs), "sde_log_prob_mean_abs_diff": statistics.mean(logp)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    add_checkpoint_arguments(parser)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sde-steps", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the family's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of the blocks, both ways")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if not args.checkpoint.exists():
        make_checkpoint(args.family, args.checkpoint, device)
    family = resolve_family(args.family, args.checkpoint).load(args.checkpoint, device=device,
                                                               dtype=getattr(torch, args.dtype))
    size = (args.resolution,) * 2 if args.resolution else family.default_size()
    request = RolloutRequest(
        prompt="a photo of a red fox in the snow", seed=1234, num_outputs_per_prompt=args.n, height=size[0],
        width=size[1], num_inference_steps=args.steps,
        guidance_scale=family.default_guidance_scale if args.guidance_scale is None else args.guidance_scale,
        rollout=True, rollout_sde_type="sde", rollout_noise_level=0.7, rollout_sde_step_indices=args.sde_steps,
        rollout_return_dit_trajectory=True)
    results = {"family": args.family, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "height": size[0], "width": size[1], "n": args.n, "steps": args.steps,
               "guidance_scale": request.guidance_scale, "compile": args.compile}
    config = EngineConfig(max_outputs_per_request=max(64, args.n))
    SpeedOptions(compile=args.compile).compile_family(family)
    plain, results["plain_s_per_image"] = timed_generate(Engine(family, config), request, args.repeats, device)
    torch._dynamo.reset()  # the FP8 layers compile afresh
    speed = SpeedOptions(float8=True, compile=args.compile)
    speed.apply(family)
    speed.compile_family(family)
    fp8, results["float8_s_per_image"] = timed_generate(Engine(family, config), request, args.repeats, device)
    results["float8_speedup"] = results["plain_s_per_image"] / results["float8_s_per_image"]
    results.update(drift(plain, fp8))
    emit(results, args.out)
    return results


if __name__ == "__main__":
    main()
