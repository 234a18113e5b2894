"""Named training presets. Each is a set of `TrainConfig` overrides; flags given after
`--recipe NAME` override the preset again. The defaults of `TrainConfig` are sized for the 2-core
CPU main command; the `-gpu` recipes are the full-size runs."""

from __future__ import annotations

import dataclasses

from diffrl.train.config import TrainConfig

RECIPES: dict[str, dict] = {
    # The CPU main command (`make demo`, about 8 minutes on 2 cores): DiffusionNFT on the shipped demo
    # model with 4 CFG-free ODE steps, one group per category per rollout, one optimizer step of
    # 48 samples × 3 timesteps per rollout. Figures: README, docs/trainer/experiments.md.
    "shapes-nft": dict(
        loss_type="nft", use_lora=False, lr=1e-4, diffusion_num_steps=4, num_rollout=22, rollout_batch_size=6,
        n_samples_per_prompt=8, rollout_microgroup_size=8, global_batch_size=48, num_steps_per_rollout=1,
        micro_batch_size=48, eval_interval=22, eval_images_per_category=8, checkpoint_interval=11,
    ),
    # Flow-GRPO at CPU scale (CFG off: one forward per step). Its reward does not rise at this scale yet.
    "shapes-grpo": dict(loss_type="flow_grpo", use_lora=False, lr=1e-4),
    "shapes-grpo-gpu": dict(
        loss_type="flow_grpo", use_lora=False, lr=1e-4, num_rollout=200, rollout_batch_size=32,
        n_samples_per_prompt=16, rollout_microgroup_size=16, global_batch_size=256, num_steps_per_rollout=2,
        micro_batch_size=256, diffusion_guidance_scale=3.0, engine_concurrency=32, engine_max_batch_outputs=512,
        eval_interval=10, eval_images_per_category=32, checkpoint_interval=50, mixed_precision="no",
    ),
    "shapes-nft-gpu": dict(
        loss_type="nft", use_lora=False, lr=1e-4, num_rollout=200, rollout_batch_size=32, n_samples_per_prompt=16,
        rollout_microgroup_size=16, global_batch_size=256, num_steps_per_rollout=2, micro_batch_size=256,
        engine_concurrency=32, engine_max_batch_outputs=512, eval_interval=10, eval_images_per_category=32,
        checkpoint_interval=50, mixed_precision="no",  # fp32 + TF32: what docs/results.md measured
    ),
}


def recipe_config(name: str | None) -> TrainConfig:
    if name is None:
        return TrainConfig()
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
    return dataclasses.replace(TrainConfig(), recipe=name, **RECIPES[name])
