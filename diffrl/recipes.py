"""Named training presets. Each is a set of `TrainConfig` overrides; flags given after
`--recipe NAME` override the preset again. The defaults of `TrainConfig` are sized for the 2-core
CPU main command; the `-gpu` recipes are the full-size runs."""

from __future__ import annotations

import dataclasses

from diffrl.train.config import TrainConfig

RECIPES: dict[str, dict] = {
    # CPU main command: a short Flow-GRPO run on the shipped demo model (CFG off: one forward per step).
    "shapes-grpo": dict(loss_type="flow_grpo", use_lora=False, lr=1e-4),
    "shapes-nft": dict(loss_type="nft", use_lora=False, lr=1e-4, diffusion_num_steps=10),
    "shapes-grpo-gpu": dict(
        loss_type="flow_grpo", use_lora=False, lr=1e-4, num_rollout=200, rollout_batch_size=32,
        n_samples_per_prompt=16, rollout_microgroup_size=16, global_batch_size=256, num_steps_per_rollout=2,
        micro_batch_size=256, diffusion_guidance_scale=3.0, engine_concurrency=32, engine_max_batch_outputs=512, eval_interval=10, eval_images_per_category=32, checkpoint_interval=50,
    ),
    "shapes-nft-gpu": dict(
        loss_type="nft", use_lora=False, lr=1e-4, num_rollout=200, rollout_batch_size=32, n_samples_per_prompt=16,
        rollout_microgroup_size=16, global_batch_size=256, num_steps_per_rollout=2, micro_batch_size=256,
        engine_concurrency=32, engine_max_batch_outputs=512, eval_interval=10, eval_images_per_category=32, checkpoint_interval=50,
    ),
}


def recipe_config(name: str | None) -> TrainConfig:
    if name is None:
        return TrainConfig()
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
    return dataclasses.replace(TrainConfig(), recipe=name, **RECIPES[name])
