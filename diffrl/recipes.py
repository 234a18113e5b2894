"""Named training presets. Each is a set of `TrainConfig` overrides; flags given after
`--recipe NAME` override the preset again.

`shapes-nft` and `shapes-grpo` run at GPU size on a CUDA machine and scale down on a CPU (the
device is `--device`, `auto` = CUDA when present); `shapes-nft-gpu` / `shapes-grpo-gpu` force the
GPU size (what `docs/results.md` measured). `sd3-grpo` is Flow-GRPO's SD3.5 setting for a checkpoint
given with `--model-path`.
"""

from __future__ import annotations

import dataclasses

import torch

from diffrl.train.config import TrainConfig

_GPU_BATCH = dict(  # 32 prompts × 16 samples per rollout, 2 optimizer steps of 256 samples
    num_rollout=200, rollout_batch_size=32, n_samples_per_prompt=16, rollout_microgroup_size=16,
    global_batch_size=256, num_steps_per_rollout=2, micro_batch_size=256, engine_concurrency=32,
    engine_max_batch_outputs=512, eval_interval=10, checkpoint_interval=50,
    eval_images_per_category=64,  # 32 per category proved too noisy to tell runs apart (docs/results.md)
    val_images_per_category=64,  # checkpoints/best by validation on train prompts: runs peak, then fall back
    mixed_precision="no",  # fp32 + TF32: what docs/results.md measured; bf16 is --mixed-precision bf16
)

# Flow-GRPO on an SD3 / SD3.5 checkpoint (`--model-path`) at the published recipe's sampling settings
# (DESIGN §9: 512², 10 steps, CFG 4.5, LoRA r32; noise 0.7, clip 1e-4), 9 of the 10 steps trained; the
# run BENCHMARKS.md measured on one H200 (0.465 s per sample with --compile, 0.83 s eager). Give it a
# reward (`--reward`); the shapes held-out evaluation is off.
_SD3_GRPO = dict(loss_type="flow_grpo", use_lora=True, lora_rank=32, lora_alpha=64.0, resolution=512,
                 diffusion_num_steps=10, diffusion_guidance_scale=4.5, diffusion_noise_level=0.7,
                 diffusion_sde_window_range=(0, 9), diffusion_num_sde_steps=9, diffusion_clip_range=1e-4,
                 rollout_batch_size=4, n_samples_per_prompt=16, rollout_microgroup_size=16, global_batch_size=64,
                 num_steps_per_rollout=1, micro_batch_size=8, eval_images_per_category=0)

SIZED: dict[str, dict[str, dict]] = {
    "sd3-grpo": {"gpu": _SD3_GRPO, "cpu": _SD3_GRPO},  # a real SD3 has no CPU size
    "shapes-nft": {
        # DiffusionNFT: CFG-free ODE rollouts under the EMA old policy, full finetune.
        # Cosine decay over 60 rollouts: at a constant rate, or over more rollouts, the held-out
        # accuracy fell after its peak (from the shipped model it peaks at rollouts 40-60 of a
        # 100-rollout cosine; over 60 the last checkpoint keeps the peak: docs/results.md, session 9).
        # Adaptive category sampling (more groups for the categories with lower training reward) and
        # an optimizer step in two micro-batches (the demo model is launch-bound; 30 GiB of GPU memory)
        # gave the best held-out accuracy (docs/results.md).
        "gpu": dict(loss_type="nft", use_lora=False, lr=1e-4,
                    **{**_GPU_BATCH, "num_rollout": 60, "micro_batch_size": 1152},
                    lr_schedule="cosine", lr_min_ratio=0.1, category_sampling="adaptive"),
        # The CPU main command (`make demo`, about 8 minutes on 2 cores): 4 steps, one group per
        # category per rollout, one optimizer step of 48 samples × 3 timesteps. Figures: README.
        "cpu": dict(loss_type="nft", use_lora=False, lr=1e-4, diffusion_num_steps=4, num_rollout=22,
                    rollout_batch_size=6, n_samples_per_prompt=8, rollout_microgroup_size=8, global_batch_size=48,
                    num_steps_per_rollout=1, micro_batch_size=48, eval_interval=22, eval_images_per_category=8,
                    checkpoint_interval=11),
    },
    "shapes-grpo": {
        # Flow-GRPO with CFG 3 and 2 SDE steps per rollout inside the first 4 of 10 steps, clip 1e-3,
        # cosine decay over 250 rollouts and adaptive categories: the best GRPO runs of docs/results.md
        # (session 5: 0.8 held-out in 255 s alone on an H200). One optimizer step's 512 pairs in one
        # micro-batch. Sweep files from before session 5 pin the values they ran with.
        "gpu": dict(loss_type="flow_grpo", use_lora=False, lr=1e-4, diffusion_guidance_scale=3.0,
                    **{**_GPU_BATCH, "num_rollout": 250, "micro_batch_size": 512},
                    diffusion_clip_range=1e-3, diffusion_sde_window_range=(0, 4),
                    lr_schedule="cosine", lr_min_ratio=0.1, category_sampling="adaptive"),
        # At CPU scale (CFG off: one forward per step) its reward does not rise yet.
        "cpu": dict(loss_type="flow_grpo", use_lora=False, lr=1e-4),
    },
}


def recipe_names() -> list[str]:
    return sorted([*SIZED, *(f"{name}-gpu" for name in SIZED)])


def recipe_config(name: str | None, device: str = "auto") -> TrainConfig:
    """The recipe's values on top of `TrainConfig`'s defaults, sized for `device`."""
    if name is None:
        return TrainConfig()
    base, size = (name.removesuffix("-gpu"), "gpu") if name.endswith("-gpu") else (name, None)
    if base not in SIZED:
        raise ValueError(f"unknown recipe {name!r}; known: {', '.join(recipe_names())}")
    if size is None:
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        size = "gpu" if cuda else "cpu"
    return dataclasses.replace(TrainConfig(), recipe=name, **SIZED[base][size])
