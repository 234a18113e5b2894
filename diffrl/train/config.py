"""The training configuration: one typed dataclass; every field is a flag (`--n-samples-per-prompt`, …).

Flag names follow the field's established names (DESIGN §8). Recipes (`recipes.py`) are named
sets of overrides; `--recipe NAME` applies one, later flags override it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from diffrl.models.demo import SHIPPED_DEMO_MODEL


@dataclass
class TrainConfig:
    recipe: str | None = None
    """Preset applied before the other flags (see `diffrl/recipes.py`)."""
    output_dir: Path | None = None
    """Run folder; default runs/<recipe or loss type>-<date-time>."""
    resume: bool = False
    """Continue the run in --output-dir from its last checkpoint."""
    seed: int = 0
    device: str = "auto"
    deterministic_mode: bool = False
    """torch.use_deterministic_algorithms: slower, bit-reproducible where the hardware allows."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """Transformer forward precision for rollouts and training alike (weights stay fp32 masters):
    auto = bf16 autocast on CUDA, fp32 elsewhere."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (less memory, ~1/3 more compute)."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks (regional; engine and trainer share them). The
    first rollout and the first training step pay the compilation; samples change by kernel rounding."""
    compile_eager_numerics: bool = True
    """With --compile: keep eager's bf16 roundings between fused ops, so the trainer's compiled replay of
    a rollout step stays close to the engine's log-prob (Flow-GRPO's ratio; see models/compile.py)."""
    float32_matmul_precision: Literal["highest", "high", "medium"] = "high"
    """torch.set_float32_matmul_precision; "high" lets GPUs use TF32 (engine and trainer alike, so the
    first-pass ratio stays 1). No effect on CPU."""

    # model
    model_path: Path = SHIPPED_DEMO_MODEL
    diffusion_model_family: str | None = None
    resolution: int | None = None
    """Side in pixels of the square images rolled out and evaluated; None: the family's default
    (e.g. 1024 for SD3.5, whose published Flow-GRPO recipes train at 512)."""
    num_frames: int | None = None
    """Frames of each rolled-out video (video families, e.g. wan2_2); None: the family's default."""
    use_lora: bool = True
    lora_rank: int = 8
    lora_alpha: float = 16.0
    use_ema: bool = False
    """Keep an EMA of the trained weights (--ema-decay per optimizer step) and evaluate, pick
    checkpoints/best and save models with it. DiffusionNFT's old policy is a separate EMA."""
    ema_decay: float = 0.9

    # algorithm
    loss_type: Literal["flow_grpo", "nft"] = "flow_grpo"
    reward: str = "shapes"
    reward_workers: int = 0
    """Score rewards in this many worker processes (microgroups in parallel, as they land); 0: inline."""
    train_categories: tuple[str, ...] = ()
    """Shapes categories to draw train prompts from (default: all six)."""
    category_sampling: Literal["uniform", "adaptive"] = "uniform"
    """uniform: categories take turns; adaptive: more groups for categories with lower training
    reward (share ∝ floor + 1 − smoothed mean reward; rewards in [0, 1]). See train/prompt_sampler.py."""
    category_difficulty: Literal["reward", "unsolved"] = "reward"
    """What adaptive sampling calls hard: reward = 1 − the category's smoothed mean reward; unsolved =
    the smoothed fraction of its samples scoring below --category-solved-reward."""
    category_solved_reward: float = 1.0
    category_sampling_floor: float = 0.05
    category_reward_smoothing: float = 0.8
    diffusion_clip_range: float = 1e-4
    diffusion_adv_clip_max: float = 5.0
    diffusion_kl_beta: float = 0.0
    kl_reference: Literal["base", "ema"] = "base"
    """What --diffusion-kl-beta pulls toward: base = the starting weights (LoRA: the adapter
    disabled; full finetune: a frozen copy of the trained parameters, sharded like them), ema =
    the EMA (needs --use-ema, or DiffusionNFT, whose EMA is its old policy)."""
    globalize_reward_std: bool = False
    globalize_reward_mean: bool = False
    drop_zero_std_groups: bool = False
    diffusion_nft_beta: float = 1.0
    nft_adaptive_weighting: bool = True
    nft_ema_ramp: float = 0.001
    nft_ema_max: float = 0.5
    nft_ema_flat: int = 0
    nft_timestep_fraction: float = 0.99
    """NFT trains each sample at the first int(K·fraction) of its shuffled K schedule timesteps."""
    nft_rollout_guidance_scale: float = 1.0
    """CFG of NFT's rollouts (1: CFG-free, as DiffusionNFT samples). Above 1 the old policy's guided
    samples are the data; the loss still trains the conditional velocity alone."""

    # rollout
    num_rollout: int = 12
    rollout_batch_size: int = 8
    """Prompt groups per rollout."""
    n_samples_per_prompt: int = 8
    rollout_microgroup_size: int = 8
    engine_concurrency: int = 8
    """In-flight requests per engine; the in-process engine denoises waiting requests together."""
    engine_max_batch_outputs: int = 64
    """Outputs the engine denoises in one batch across requests (launch-bound GPUs want many)."""
    engine_urls: tuple[str, ...] = ()
    """Engines behind `diffrl serve` to roll out on too (least-loaded routing); the trained weights are
    pushed to each before every rollout (full finetune, one process)."""
    local_engine: bool = True
    """Keep the in-process engine in the rollout pool (--no-local-engine: the URLs only)."""
    engine_token: str | None = None
    """Bearer token for the engines' weight updates (default: env DIFFRL_ENGINE_TOKEN)."""
    ray_engines: int = 0
    """Place this many engines and the trainer as Ray actors in one placement group (0 and one
    trainer rank: no Ray)."""
    ray_address: str | None = None
    """An existing Ray cluster (default: start a local one)."""
    ray_colocate: bool = True
    """PACK the bundles onto as few nodes as possible (--no-ray-colocate: SPREAD across nodes)."""
    ray_gpus_per_engine: float = 0.0
    ray_trainer_ranks: int = 1
    """Trainer actors placed through Ray. Above 1: data-parallel ranks (torch.distributed inside the
    actors, FSDP2 as under torchrun), each rolling out its share on its own in-process engine."""
    ray_gpus_per_trainer: float = 0.0
    """GPUs for each trainer actor (its in-process engine shares them)."""
    ray_reward_workers: int = 0
    """With Ray placement: score rewards in this many Ray actors of the placement group (one CPU
    each) instead of the trainers' processes; microgroups go to them in turn."""
    ray_placement_timeout_s: float = 120.0
    """How long to wait for Ray to place every bundle before giving up with the cluster's resources."""
    rollout_seed: int = 0
    diffusion_num_steps: int = 10
    diffusion_guidance_scale: float = 1.0
    diffusion_noise_level: float = 0.7
    diffusion_sde_type: Literal["sde", "cps"] = "sde"
    diffusion_sde_window_range: tuple[int, int] | None = None
    """SDE steps are a window of --diffusion-num-sde-steps steps inside [lo, hi) (default: all steps)."""

    def sde_window_range(self) -> tuple[int, int]:
        return self.diffusion_sde_window_range or (0, self.diffusion_num_steps)
    diffusion_num_sde_steps: int = 2

    # optimization
    global_batch_size: int = 64
    """Samples per optimizer step."""
    num_steps_per_rollout: int = 1
    micro_batch_size: int = 32
    """Train pairs per forward/backward (gradient accumulation up to the optimizer step)."""
    lr: float = 3e-4
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """cosine: from --lr at the first rollout down to --lr × --lr-min-ratio at --num-rollout."""
    lr_min_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0

    # evaluation and checkpoints
    eval_interval: int = 4
    """Evaluate on the held-out prompts every this many rollouts (and before the first)."""
    eval_images_per_category: int = 8
    """Held-out images per category (prompts × seeds, seeds balanced so small categories are not noise).
    0: no held-out evaluation (it scores the shapes world's test prompts: a model trained on another
    reward has nothing to gain from it)."""
    eval_guidance_scale: float | None = None
    """None: the rollout guidance scale."""
    val_images_per_category: int = 0
    """> 0: at each evaluation also score this many images per category of a fixed subset of the
    *train* prompts (`--val-prompts-per-category` of each, seeds 20 000 + k), and keep
    `checkpoints/best`: the weights with the highest validation strict accuracy so far. A checkpoint
    chosen this way never looked at the test prompts (early stopping for runs that peak and fall)."""
    val_prompts_per_category: int = 8
    eval_num_steps: int | None = None
    """ODE steps of the held-out evaluation; None: the rollout's --diffusion-num-steps. (Flow-GRPO and
    DiffusionNFT roll out with few steps and evaluate with more, e.g. 10 and 40.)"""
    checkpoint_interval: int = 4
    time_budget_minutes: float | None = None
    """Stop after the rollout that passes this wall-clock budget (then the final eval and checkpoint)."""


def uses_ray(cfg: TrainConfig) -> bool:
    """Whether the run is placed through Ray (engines or several trainer ranks as actors)."""
    return cfg.ray_engines > 0 or cfg.ray_trainer_ranks > 1
