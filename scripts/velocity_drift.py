"""How far trained checkpoints have drifted from the base model: mean((v_θ − v_base)²), the
quantity DiffusionNFT's KL term (--diffusion-kl-beta with --kl-reference base) penalizes.

For each checkpoint: sample 24 train prompts with the checkpoint (10 ODE steps, CFG 1, seeds 0…23),
noise those images to t = 0.2, 0.5, 0.8 (x_t = (1 − t)·x0 + t·ε, fixed ε) and compare the two
models' velocities there. Usage: velocity_drift.py CHECKPOINT… [--device cpu]
"""

from __future__ import annotations

import argparse

import torch

from diffrl.data.shapes import train_prompts
from diffrl.engine import denoise
from diffrl.models.base import Latents
from diffrl.models.checkpoint import load_model
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.sampling import noised

NOISE_LEVELS = (0.2, 0.5, 0.8)


@torch.no_grad()
def drift(checkpoint: str, base, device: str, num_prompts: int = 24, num_steps: int = 10) -> list[float]:
    trained = load_model(SHIPPED_DEMO_MODEL, checkpoint, device=device)
    prompts = train_prompts()[::97][:num_prompts]  # spread over the categories
    height, width = trained.default_size()
    latents = trained.prepare_latents([torch.Generator().manual_seed(i) for i in range(len(prompts))], height, width)
    embeds = trained.encode_prompts(prompts).to(device)
    sigmas = trained.sigmas(num_steps, height, width).to(device)

    def velocity(family, x, t):
        return family.velocity(family.transformer, Latents(x, latents.ids), t.expand(len(x)), embeds, None, 1.0)

    start = Latents(latents.tokens.to(device), latents.ids)
    x = denoise(trained, start, sigmas, embeds, None, 1.0, generators=[]).latents  # the trained model's own samples
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1234)).to(device)
    result = []
    for t in NOISE_LEVELS:
        x_t = noised(x, noise, t)
        level = torch.tensor(t, device=device)
        result.append(((velocity(trained, x_t, level) - velocity(base, x_t, level)) ** 2).mean().item())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    base = load_model(SHIPPED_DEMO_MODEL, None, device=args.device)
    print("mean((v - v_base)^2) at t = " + ", ".join(str(t) for t in NOISE_LEVELS))
    for checkpoint in args.checkpoints:
        print(checkpoint, " ".join(f"{d:.4f}" for d in drift(checkpoint, base, args.device)))


if __name__ == "__main__":
    main()
