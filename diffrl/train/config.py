"""The training configuration: a tree of dataclasses, one per part of the system; every field is a flag.

Flags keep the field's established name without the section prefix (`--lr`, not `--optim.lr`;
docs/architecture.md, "Data flow"), so field names are unique across the tree. `TrainConfig.flat(**fields)` and
`cfg.replace(**fields)` take the same flat names, which is how recipes (`diffrl/recipes.py`) and
tests spell a configuration. Each section checks its own fields (`check`); `TrainConfig.check`
adds what spans sections. The rollout section (`RolloutSettings`) is defined in the rollout layer
(`diffrl/rollout/settings.py`), whose manager takes it as it is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from diffrl.algorithms.methods import METHODS, SDE_LOSS_TYPES, folds_lora
from diffrl.assets import SHIPPED_DEMO_MODEL
from diffrl.rollout.layout import check_batch_invariant
from diffrl.rollout.settings import RolloutSettings
from diffrl.utils.size import sample_size, size_flags

# --condition-image-size's least side: FLUX 3's image processor pads a reference to a 64x64 canvas at least.
MIN_CONDITION_IMAGE_SIZE = 64

# This module imports nothing that imports torch or httpx (tests/test_cli_help.py checks): `diffrl train --help`
# builds its parser from these dataclasses. The checks that read the rewards' or the models' modules import them
# where they run (deferred), when a run starts.


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class ModelConfig:
    model_path: Path = SHIPPED_DEMO_MODEL
    """Local diffusers-format model directory to train (default: the shipped demo model)."""
    diffusion_model_family: str | None = None
    """The model family (demo, sd3, flux3_image, qwen_image, qwen_image21, krea2, wan2_2, ltx2, cosmos3, …); None: detected
    from the model folder."""
    init_from: Path | None = None
    """Start from this checkpoint's weights instead of the base model's own: a run checkpoint
    (RUN/checkpoints/rollout-N or best), a PEFT adapter folder, or a full model or transformer folder of the same
    family. A LoRA adapter warm-starts the run's adapter (its rank, alpha and targets must be the run's); full
    weights replace the transformer's (a LoRA run then trains a fresh adapter on them). Not a resume: the optimizer,
    the rollout count, the seeds and the EMA start fresh. --diffusion-kl-beta's base is the model the run starts
    from with its adapter switched off: the loaded full weights, or for a LoRA warm start the --model-path model."""
    resolution: int | None = None
    """Side in pixels of the square images rolled out and evaluated (shorthand for --height N --width N);
    None: --height/--width, else the family's default (e.g. 1024 for SD3.5, whose published Flow-GRPO
    recipes train at 512)."""
    height: int | None = None
    """Height in pixels of the samples rolled out and evaluated, with --width, for sizes that are not
    square (e.g. video at 512 × 768); not with --resolution."""
    width: int | None = None
    """Width in pixels of the samples, with --height."""
    num_frames: int | None = None
    """Frames of each rolled-out video (video families, e.g. wan2_2); None: the family's default."""
    flow_shift: float | None = None
    """Sample and train with this static schedule shift (σ' = s·σ / (1 + (s − 1)·σ)) in place of the checkpoint's own,
    static or resolution-dependent (e.g. Wan's 3.0 at 480p, 5.0 at 720p; diffusers' scheduler `shift` /
    `flow_shift`). None: the checkpoint's. Its checkpoints, served or evaluated, sample with it too."""
    condition_image_size: int | None = None
    """Image-conditioned models: each condition image is sized to at most N × N pixels of area (aspect kept) before it
    is encoded, in place of the pipeline's own cap (Qwen-Image-Edit's 1024², resized to exactly N² as its pipelines
    resize; FLUX.1 Kontext, FLUX.2 and FLUX 3 editing: downscaled when larger), as Flow-Factory's
    `condition_image_size` trains on smaller sources than the model samples with. None: the pipeline's sizing. Its
    checkpoints, served or evaluated, take the same size unless told otherwise."""
    use_lora: bool = True
    """Train a LoRA adapter on the transformer (--no-use-lora: a full finetune of the transformer)."""
    lora_rank: int = 8
    """Rank of the LoRA adapter's matrices."""
    lora_alpha: float = 16.0
    """LoRA scale numerator: the adapter's update is scaled by alpha / rank."""
    lora_target_modules: tuple[str, ...] = ()
    """Module names (or suffixes) the adapter wraps; empty: the family's default set."""
    fold_lora_without_grad: Literal["auto", "on", "off"] = "auto"
    """With --use-lora, forwards without gradients (the rollouts, DiffusionNFT's old policy) run each adapted linear
    layer as one matmul with the adapter folded into its weight (W + s·B·A, rounded once), which saves the adapter's
    thin matmuls and the activation-sized tensors they read and write (`models/lora.py`). Its rounding differs from
    the trained forward's, so only methods whose no-gradient forwards are sampling and targets take it (nft, sft;
    `algorithms/methods.py`); auto: on for those, off for the others."""
    lora_components: tuple[str, ...] = ()
    """With --use-lora, the parts of the model that get the adapter, for a family made of several (Wan2.2's experts:
    `transformer` the high-noise one, `transformer_2` the low-noise one); empty: all of them. The others sample as
    they were loaded, cost no adapter matmuls, and are left out of the checkpoint."""
    mixed_precision: Literal["auto", "no", "bf16"] = "auto"
    """Transformer forward precision for rollouts and training alike (trained weights stay fp32
    masters): auto = bf16 autocast on CUDA, fp32 elsewhere."""
    offload_text_encoder: bool = False
    """Keep the text encoders on the CPU and move them to the GPU only to encode prompts (frees their memory
    for rollouts and training; costs a copy each way per encode)."""
    offload_idle_expert: bool = False
    """Wan2.2 A14B: keep each expert's frozen weights in pinned host memory while the other denoises (its 28.6 GB in
    bf16), copied in when a step needs it (`ExpertOffload`): an engine batch switches expert once, at the boundary.
    With --use-lora (the adapters stay on the device), one process."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass (less memory, ~1/3 more compute)."""
    gradient_checkpointing_interval: int = 1
    """With --gradient-checkpointing: recompute one block in every N (1: every block). A larger N keeps more
    activations and recomputes fewer blocks, trading memory for speed (models/checkpointing.py)."""
    gradient_checkpointing_keeps: Literal["inputs", "matmuls"] = "inputs"
    """With --gradient-checkpointing: what a checkpointed block keeps for the backward. inputs: nothing else (the
    whole block is recomputed); matmuls: also every matmul's and attention's output, so the backward recomputes only
    the elementwise and norm work between them (torch's selective activation checkpointing: more memory than
    inputs, far less than no checkpointing; models/checkpointing.py)."""
    compile: bool = False
    """torch.compile the transformer's repeated blocks (regional; engine and trainer share them). The
    first rollout and the first training step pay the compilation; samples change by kernel rounding."""
    compile_eager_numerics: bool = True
    """With --compile: keep eager's bf16 roundings between fused ops, so the trainer's compiled replay of
    a rollout step stays close to the engine's log-prob (Flow-GRPO's ratio; see models/compile.py)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    """With --compile: torch.compile's mode. max-autotune-no-cudagraphs times GEMM and fusion choices per shape
    (compilation takes several times longer). reduce-overhead is refused: CUDA graphs fail under per-block
    compilation (each block's replay overwrites the previous block's output). See models/compile.py."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of every transformer forward, rollouts and training alike (one kernel, so the first-pass
    ratio is not moved by a kernel switch); auto: torch's choice. cudnn and efficient need CUDA; deterministic
    mode allows efficient and math only."""
    fuse_qkv: bool = False
    """SD3: each attention stream's q, k and v projections as one matmul (weights concatenated per call, so
    full finetunes and weight updates stay exact). Streams whose projections carry LoRA stay unfused: with
    SD3's default targets only the image-only attention of SD3.5's dual-attention blocks fuses. Refused when
    LoRA leaves nothing to fuse."""
    float8: bool = False
    """The transformer blocks' linear layers as FP8 matmuls with rowwise scales (a row's scale is its own, so
    samples stay independent of their batchmates), in rollout and training alike (models/float8.py); needs FP8
    tensor cores (compute capability 8.9+) or the CPU. Changes the model's numerics against the bf16 forward
    (benchmarks/float8_drift.py, `diffrl evaluate --float8` measure by how much), not the on-policy ratio."""
    vae_decode_batch: int | None = None
    """Images per VAE decode call in rollouts and evaluation; 0: all at once. None: one per call on CPU (sample
    k's image then does not depend on its batch), 8 at 512² (a pixel budget) on a GPU."""
    float32_matmul_precision: Literal["highest", "high", "medium"] = "high"
    """torch.set_float32_matmul_precision; "high" lets GPUs use TF32 (engine and trainer alike, so the
    first-pass ratio stays 1). No effect on CPU."""

    def check(self) -> None:
        _require(self.lora_rank >= 1 and self.lora_alpha > 0,
                 f"--lora-rank must be >= 1 and --lora-alpha > 0 (got {self.lora_rank}, {self.lora_alpha})")
        self.size()  # refuses --resolution with --height/--width, one side alone, or a side below 1
        _require(self.use_lora or not self.lora_components,
                 f"--lora-components {' '.join(self.lora_components)} chooses where a LoRA goes; a full finetune "
                 "(--no-use-lora) trains every part")
        _require(self.init_from is None or Path(self.init_from).is_dir(),
                 f"--init-from {self.init_from}: no such directory (a run checkpoint, an adapter or a model folder)")
        self.speed_options().check()
        _require(self.gradient_checkpointing_interval >= 1,
                 f"--gradient-checkpointing-interval must be >= 1 (got {self.gradient_checkpointing_interval})")
        _require(self.gradient_checkpointing or self.gradient_checkpointing_keeps == "inputs",
                 "--gradient-checkpointing-keeps matmuls needs --gradient-checkpointing")

    def folds_lora(self, loss_type: str) -> bool:
        """Whether the run's adapter folds in forwards without gradients (--fold-lora-without-grad; auto: the
        method's `folds_lora`)."""
        return self.use_lora and folds_lora(loss_type, self.fold_lora_without_grad)

    def speed_options(self):
        """The forward's speed settings, as the engine processes and the policy apply them."""
        from diffrl.models.speed import SpeedOptions  # deferred: the models package imports torch (train --help)

        return SpeedOptions.of(self)

    def size(self) -> tuple[int, int] | None:
        """(height, width) of rollouts and evaluation; None: the family's default."""
        return sample_size(self.resolution, self.height, self.width)

    def size_flags(self) -> str:
        return size_flags(self.resolution, self.height, self.width)


@dataclass
class EnginePoolConfig:
    engine_concurrency: int = 8
    """In-flight requests per engine; the in-process engine denoises waiting requests together."""
    engine_max_batch_outputs: int = 64
    """Outputs the engine denoises in one batch across requests (launch-bound GPUs want many)."""
    engine_urls: tuple[str, ...] = ()
    """Engines behind `diffrl serve` to roll out on too (least-loaded routing); the trained weights are
    pushed to each before every rollout (one process)."""
    local_engine: bool = True
    """Keep the in-process engine in the rollout pool (--no-local-engine: the URLs only)."""
    engine_token: str | None = None
    """Bearer token for the engines' weight updates (default: env DIFFRL_ENGINE_TOKEN)."""
    colocate: bool = False
    """Roll out on an engine in its own process on the trainer's device (started by the trainer) in place
    of the in-process one: weights reach it by tensor sharing (CUDA IPC handles on a GPU), and it sleeps
    while the trainer trains (--engine-sleep-level). Held-out evaluation still samples in-process."""
    update_weight_buffer_size: int = 512 * 2**20
    """Bytes per weight bucket sent to a --colocate engine (a larger tensor goes alone): the extra device
    memory a weight sync holds on each side."""
    engine_sleep_level: Literal[0, 1, 2] = 1
    """What a --colocate engine releases while the trainer trains: 0 nothing, 1 its cached memory
    (activations, the allocator's cache), 2 also its weights (to pinned host memory until the next rollout)."""
    engine_copy_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Under torchrun, each rank's engine samples from a full copy of the transformer. A full finetune's copy:
    float32 (the fp32 masters' values: the engine computes what the trainer's forward does), bfloat16 (half the
    memory; the engine's norm and modulation weights are then bf16-rounded, a drift of bf16 rounding from the
    trainer's forward; needs a bf16 forward), auto: float32 unless it would take over 40% of the GPU, then bfloat16.
    A LoRA's copy is the base as loaded (bf16 with a bf16 forward) and the adapters in fp32."""
    engine_forward_graph: Literal["auto", "inference", "training"] = "auto"
    """The graph the in-process engine's denoising forward runs: inference (no gradients) or training (gradients on
    for the trained parameters, detached at once: the graph the trainer replays a rollout step in, so a compiled
    replay gives the rollout's log-probs; `EngineConfig.forward_graph`). auto: training when the blocks are compiled
    (--compile), the loss replays rollout steps (flow_grpo, grpo_guard) and one process trains; inference otherwise.
    Without gradient checkpointing the engine then runs --micro-batch-size outputs per forward (a forward with
    gradients keeps its activations until detached). Eager gives the same numbers either way."""


    def check(self) -> None:
        _require(self.engine_concurrency >= 1, f"--engine-concurrency must be >= 1, got {self.engine_concurrency}")
        _require(self.engine_max_batch_outputs >= 1,
                 f"--engine-max-batch-outputs must be >= 1, got {self.engine_max_batch_outputs}")
        _require(self.update_weight_buffer_size >= 1,
                 f"--update-weight-buffer-size must be >= 1 byte, got {self.update_weight_buffer_size}")
        # Only a --colocate engine sleeps and takes bucketed syncs: without it these would do nothing, silently.
        _require(self.colocate or self.engine_sleep_level == 1,
                 f"--engine-sleep-level {self.engine_sleep_level} sets what a --colocate engine releases; "
                 "add --colocate or drop it")
        _require(self.colocate or self.update_weight_buffer_size == 512 * 2**20,
                 f"--update-weight-buffer-size {self.update_weight_buffer_size} sizes the weight buckets of a "
                 "--colocate engine; add --colocate or drop it")


@dataclass
class AlgorithmConfig:
    loss_type: Literal["flow_grpo", "grpo_guard", "nft", "awm", "dpo", "dgpo", "crd", "sft"] = "flow_grpo"
    """flow_grpo: clipped-ratio policy gradient on SDE steps (DanceGRPO: --diffusion-sde-type dance; MixGRPO:
    --diffusion-sde-step-strategy sliding); grpo_guard: the same with GRPO-Guard's normalized ratio; on ODE
    samples: nft (DiffusionNFT), awm (Advantage Weighted Matching), dpo (online Diffusion-DPO), dgpo (Direct Group
    Preference Optimization), crd (Centered Reward Distillation), sft (flow-matching fine-tuning on the samples
    that beat their prompt's mean reward). docs/algorithms.md compares them."""
    diffusion_clip_range: float = 1e-4
    """PPO-style clip of the policy ratio around 1 (Flow-GRPO's clip range)."""
    diffusion_adv_clip_max: float = 5.0
    """Advantages are clipped to [−this, this]."""
    diffusion_kl_beta: float = 0.0
    """Weight of the KL term to the reference (--kl-reference); 0: none."""
    detach_uncond: bool = False
    """With CFG, the unconditional half carries no gradient, as in flow_grpo's SD3 train step (`noise_pred_uncond.detach()`;
    its Qwen-Image step and Flow-Factory differentiate both halves, the default). The halves then run as two
    forwards, in the rollouts too (the replay must be their forward), and the backward covers the conditional rows
    only: a quarter (LoRA) to a third (full finetune) less training work per pair."""
    reuse_rollout_uncond: bool = True
    """With --detach-uncond, the first optimizer step of a rollout takes CFG's unconditional velocity from the rollout
    (an in-process engine returns it, `rollout_return_uncond_velocity`) instead of computing it again: the weights
    are the ones that sampled and the half carries no gradient, so the forward would give the same value wherever
    the replay runs the rollout's graph at its batch shape (bit for bit in the compiled SD3.5 recipes; within
    rounding where a kernel rounds a row by its batch), and a pair costs the conditional forward and its backward
    alone. Later optimizer steps (new weights), remote engines and replayed rollouts compute it.
    --no-reuse-rollout-uncond computes it always (one more forward per pair)."""
    kl_type: Literal["x-based", "v-based"] | None = None
    """What --diffusion-kl-beta measures: x-based = the SDE step's means, mean((μ_θ − μ_ref)²)/(2σ²) (Flow-GRPO);
    v-based = the velocities, mean((v_θ − v_ref)²) (DanceGRPO). None: x-based for the SDE methods; the methods
    on ODE samples have no step mean and take v-based only."""
    kl_reference: Literal["base", "ema"] = "base"
    """What --diffusion-kl-beta pulls toward: base = the starting weights (LoRA: the adapter
    disabled; full finetune: a frozen copy of the trained parameters, sharded like them), ema =
    the EMA (needs --use-ema, or DiffusionNFT, whose EMA is its old policy)."""
    kl_cfg: float = 1.0
    """DGPO and CRD: the CFG scale of the base model's velocity their KL term (and DGPO's preference) compares with;
    above 1 the reference is guided, uncond + s·(cond − uncond), so the policy learns the guided model's velocity
    without CFG (CRD's published OCR setting: 4.5). Rollouts then also return the negative prompt's conditioning (a
    diffrl engine's `rollout_return_negative_env`). 1: unguided."""
    globalize_reward_std: bool = False
    """Normalize advantages by the reward std of the whole batch instead of each prompt group's."""
    globalize_reward_mean: bool = False
    """Center advantages on the mean reward of the whole batch instead of each prompt group's."""
    drop_zero_std_groups: bool = False
    """Leave out of training the prompt groups whose rewards are all equal (no signal)."""
    advantage_aggregation: Literal["sum", "gdpo"] = "sum"
    """How a `multi:` reward's terms make advantages: sum = normalize their weighted sum; gdpo = normalize each term
    within its prompt's group, then combine by weight and standardize over the batch (GDPO, arXiv 2601.05242)."""
    use_ema: bool = False
    """Keep an EMA of the trained weights (--ema-decay per optimizer step) and evaluate, pick
    checkpoints/best and save models with it. DiffusionNFT's old policy is a separate EMA."""
    ema_decay: float = 0.9
    """With --use-ema: the EMA's decay per update (one update per --ema-update-interval optimizer steps)."""
    ema_update_interval: int = 1
    """With --use-ema: update the EMA once every this many optimizer steps."""
    ema_warmup: int = 0
    """With --use-ema: the u-th update (from 1) decays by min(--ema-decay, u / (W + u − 1)), the warm-up of diffusers'
    and timm's EMAs, so the first weights are not held long; 0: --ema-decay from the first update."""
    diffusion_nft_beta: float = 1.0
    """DiffusionNFT's β: how far the positive and negative implicit policies lie from the old policy."""
    nft_adaptive_weighting: bool = True
    """DiffusionNFT: divide each sample's squared error by its (detached) mean absolute error (the paper's
    adaptive weighting); --no-nft-adaptive-weighting: the plain squared error."""
    nft_ema_ramp: float = 0.001
    """DiffusionNFT old policy: its decay grows by this per rollout after --nft-ema-flat rollouts (δ = min(max(k −
    flat, 0)·ramp, --nft-ema-max))."""
    nft_ema_max: float = 0.5
    """DiffusionNFT old policy: the largest decay δ (θ_old ← δ·θ_old + (1 − δ)·θ)."""
    nft_ema_flat: int = 0
    """DiffusionNFT old policy: rollouts with decay 0 (the old policy is the current one) before the ramp."""
    nft_timestep_fraction: float = 0.99
    """The methods on ODE samples (nft, awm, dpo, dgpo, crd, sft) train each sample (or group) at the first
    int(K·fraction) of its shuffled K schedule timesteps (DiffusionNFT's name and default)."""
    train_timestep_range: tuple[float, float] = (0.0, 1.0)
    """The methods on ODE samples: the part of the way from noise to image their timesteps come from, START END as
    fractions of it (the schedule steps whose σ lies in [1 − END, 1 − START]; Flow-Factory's timestep_range).
    0 0.5: the steps of σ ≥ 0.5 only; --nft-timestep-fraction (or --train-timesteps) then picks among them."""
    train_timesteps: int | None = None
    """The methods on ODE samples: train each sample (or group) at exactly this many of its candidate steps (at most
    all of them), instead of --nft-timestep-fraction of them."""
    train_timestep_sampling: Literal["schedule", "schedule_with_first", "schedule_without_first", "uniform",
                                     "logit_normal"] = "schedule"
    """The methods on ODE samples: schedule = the rollout schedule's own σ's (DiffusionNFT's), a random subset of those
    in --train-timestep-range (schedule_with_first: always with the noisiest of them; schedule_without_first: never,
    as Flow-Factory's discrete_with_init / discrete_wo_init); uniform and
    logit_normal = as many σ's drawn continuously inside --train-timestep-range (stratified; logit_normal: the
    sigmoid of a standard normal, the flow-matching pretraining density), warped by --train-timestep-shift."""
    train_timestep_shift: float = 1.0
    """With --train-timestep-sampling uniform or logit_normal: u ← s·u / (1 + (s − 1)·u) before the range is applied,
    u the fraction of the way from noise to image (s > 1 moves the draws toward the image, lower σ; Flow-Factory's
    time_shift, 3 by default there for logit_normal)."""
    nft_rollout_guidance_scale: float = 1.0
    """CFG of NFT's rollouts (1: CFG-free, as DiffusionNFT samples). Above 1 the old policy's guided
    samples are the data; the loss still trains the conditional velocity alone."""

    def timestep_choice(self):
        """The re-noising methods' timesteps (`algorithms.pairs.TimestepChoice`) from the flags above."""
        from diffrl.algorithms.pairs import TimestepChoice  # deferred: it imports torch (train --help)

        return TimestepChoice(fraction=self.nft_timestep_fraction, range=tuple(self.train_timestep_range),
                              count=self.train_timesteps, sampling=self.train_timestep_sampling,
                              shift=self.train_timestep_shift)

    def check(self) -> None:
        # Values that would train silently wrong: a negative KL pushes away from the reference, a clip range or
        # advantage clip of 0 or below zeroes or flips the update, an EMA decay above 1 diverges.
        _require(self.diffusion_clip_range > 0, f"--diffusion-clip-range must be > 0, got {self.diffusion_clip_range}")
        _require(self.diffusion_adv_clip_max > 0,
                 f"--diffusion-adv-clip-max must be > 0, got {self.diffusion_adv_clip_max}")
        _require(self.diffusion_kl_beta >= 0, f"--diffusion-kl-beta must be >= 0, got {self.diffusion_kl_beta}")
        _require(self.kl_cfg >= 1, f"--kl-cfg must be >= 1 (1: an unguided reference), got {self.kl_cfg}")
        _require(0 <= self.ema_decay <= 1, f"--ema-decay must be in [0, 1], got {self.ema_decay}")
        _require(self.ema_update_interval >= 1 and self.ema_warmup >= 0,
                 f"--ema-update-interval must be >= 1 and --ema-warmup >= 0 (got {self.ema_update_interval}, "
                 f"{self.ema_warmup})")
        _require(self.use_ema or (self.ema_update_interval == 1 and self.ema_warmup == 0),
                 "--ema-update-interval and --ema-warmup shape the evaluation EMA: pass --use-ema")
        _require(self.nft_rollout_guidance_scale >= 1 and (self.nft_rollout_guidance_scale == 1 or self.loss_type == "nft"),
                 f"--nft-rollout-guidance-scale must be >= 1 and applies to --loss-type nft only "
                 f"(got {self.nft_rollout_guidance_scale} with --loss-type {self.loss_type})")
        _require(not (self.diffusion_kl_beta > 0 and self.kl_reference == "ema"
                      and not (self.use_ema or METHODS[self.loss_type].sampler == "old")),
                 "--kl-reference ema needs an EMA: pass --use-ema (or --kl-reference base)")
        _require(self.kl_type != "x-based" or self.loss_type in SDE_LOSS_TYPES,
                 f"--kl-type x-based compares SDE step means; --loss-type {self.loss_type} samples ODE paths "
                 "(use --kl-type v-based)")

    def resolved_kl_type(self) -> str:
        return self.kl_type or ("x-based" if self.loss_type in SDE_LOSS_TYPES else "v-based")


@dataclass
class GrpoGuardConfig:
    """--loss-type grpo_guard."""

    grpo_guard_ratio_norm: bool = True
    """Add GRPO-Guard's mean correction mean((μ_θ − μ_old)²)/(2s) to the std-scaled log-ratio; without it the
    loss is TempFlow-GRPO's noise-aware weighting alone (losses.guard_log_ratio)."""

    def check(self) -> None:
        pass


@dataclass
class AwmConfig:
    """--loss-type awm: advantage-weighted flow matching on on-policy ODE samples (clipped by
    --diffusion-clip-range against the rollout's weights)."""

    awm_weighting: Literal["uniform", "t", "t2", "huber", "ghuber"] = "uniform"
    """How the flow-matching error ℓ at timestep t becomes a log-likelihood: uniform −ℓ, t −t·ℓ, t2 −t²·ℓ,
    huber −t·sqrt(ℓ), ghuber −(t/p)·ℓ^p (p = --awm-ghuber-power); losses.awm_log_prob."""
    awm_ghuber_power: float = 0.25
    """--awm-weighting ghuber: the power p."""
    awm_ema_kl_beta: float = 0.0
    """Weight of a v-based KL to an EMA of the trained weights (a moving anchor; 0: none)."""
    awm_ema_decay: float = 0.9
    """Decay of that EMA, once per rollout."""
    awm_ema_schedule: Literal["constant", "linear", "power"] = "constant"
    """How that decay reaches --awm-ema-decay over the first --awm-ema-warmup rollouts (rollout k from 0): constant;
    linear, decay · min(k / W, 1); power, min(decay, (1 + k) / (W + k)) (Flow-Factory's EMA schedules of those names,
    stepped once per rollout as its EMA once per epoch)."""
    awm_ema_warmup: int = 10
    """W of --awm-ema-schedule linear or power, in rollouts."""

    def check(self) -> None:
        _require(0 < self.awm_ghuber_power <= 1, f"--awm-ghuber-power must be in (0, 1], got {self.awm_ghuber_power}")
        _require(self.awm_ema_kl_beta >= 0, f"--awm-ema-kl-beta must be >= 0, got {self.awm_ema_kl_beta}")
        _require(0 <= self.awm_ema_decay <= 1, f"--awm-ema-decay must be in [0, 1], got {self.awm_ema_decay}")
        _require(self.awm_ema_warmup >= 1, f"--awm-ema-warmup must be >= 1, got {self.awm_ema_warmup}")


@dataclass
class DpoConfig:
    """--loss-type dpo: each prompt group's best and worst sample as a preference pair, against the base model."""

    dpo_beta: float = 2000.0
    """β of the Bradley–Terry loss on flow-matching errors (Flow-Factory's default; the errors are per-element means)."""

    def check(self) -> None:
        _require(self.dpo_beta > 0, f"--dpo-beta must be > 0, got {self.dpo_beta}")


@dataclass
class DgpoConfig:
    """--loss-type dgpo: a group's better-than-mean samples preferred to its worse, against the base model."""

    dgpo_beta: float = 100.0
    """β of DGPO's group preference loss."""
    dgpo_clip_dsm: bool = False
    """PPO-style clip on each sample's flow-matching error against the old policy (a fast EMA of the weights): a
    sample whose likelihood ratio exp(ℓ_old − ℓ_θ) has moved past 1 ± --diffusion-clip-range in the direction its
    advantage asks passes no gradient (it still counts in its group's preference). The reference code's default
    (with --diffusion-clip-range 0.05)."""
    dgpo_clip_kl: bool = False
    """The same clip on the KL term (--diffusion-kl-beta)."""
    dgpo_use_ema_ref: bool = False
    """The preference relative to the old policy's error instead of the frozen base model's."""
    dgpo_switch_ema_ref: int | None = None
    """With an old policy (--dgpo-clip-dsm, --dgpo-clip-kl or --dgpo-use-ema-ref): rollouts sample under it after
    this many optimizer steps (the reference code's 200); None: always the current weights."""
    dgpo_ema_ref_max_decay: float = 0.3
    """The old policy's decay per optimizer step k is min(this, --dgpo-ema-ref-ramp-rate · k)."""
    dgpo_ema_ref_ramp_rate: float = 0.001
    """See --dgpo-ema-ref-max-decay."""

    def keeps_old_policy(self) -> bool:
        return self.dgpo_clip_dsm or self.dgpo_clip_kl or self.dgpo_use_ema_ref

    def check(self) -> None:
        _require(self.dgpo_beta > 0, f"--dgpo-beta must be > 0, got {self.dgpo_beta}")
        _require(0 <= self.dgpo_ema_ref_max_decay <= 1 and self.dgpo_ema_ref_ramp_rate >= 0,
                 f"--dgpo-ema-ref-max-decay must be in [0, 1] and --dgpo-ema-ref-ramp-rate >= 0 (got "
                 f"{self.dgpo_ema_ref_max_decay}, {self.dgpo_ema_ref_ramp_rate})")
        _require(self.dgpo_switch_ema_ref is None or (self.dgpo_switch_ema_ref >= 0 and self.keeps_old_policy()),
                 "--dgpo-switch-ema-ref samples under DGPO's old policy, which is kept with --dgpo-clip-dsm, "
                 "--dgpo-clip-kl or --dgpo-use-ema-ref (and must be >= 0)")


@dataclass
class CrdConfig:
    """--loss-type crd: the implicit reward against an old snapshot matched to the centered reward; samples
    from a second, slower snapshot. Snapshot schedules are (start rollout, start decay, slope, end decay):
    decay = the start value before the start, then min(start + (k − start)·slope, end); snapshot ← decay·snapshot
    + (1 − decay)·θ after each rollout's update."""

    crd_beta: float = 1.0
    """β of CRD: the scale of the implicit reward (the old snapshot's error minus the model's) matched to the reward."""
    crd_loss: Literal["mse", "bce"] = "mse"
    """How the centered implicit reward is matched to the centered reward: mse (squared difference) or bce
    (binary cross-entropy against the sigmoid of the centered reward)."""
    crd_old_decay: tuple[float, float, float, float] = (0.0, 0.25, 0.005, 0.999)
    """The old snapshot (the implicit reward's baseline); the paper's OCR setting."""
    crd_sampling_decay: tuple[float, float, float, float] = (75.0, 0.0, 0.0075, 0.999)
    """The sampling snapshot (rolls out); the paper's OCR setting."""
    crd_reward_adaptive_kl: bool = True
    """With --diffusion-kl-beta: weigh each sample's KL by its reward (1e-4/β for the worst, β for the best)."""

    def check(self) -> None:
        _require(self.crd_beta > 0, f"--crd-beta must be > 0, got {self.crd_beta}")
        for flag, (start, value, slope, end) in (("--crd-old-decay", self.crd_old_decay),
                                                 ("--crd-sampling-decay", self.crd_sampling_decay)):
            _require(start >= 0 and 0 <= value <= 1 and slope >= 0 and 0 <= end <= 1,
                     f"{flag} START VALUE SLOPE END needs START >= 0, SLOPE >= 0 and decays in [0, 1]; got "
                     f"{start} {value} {slope} {end}")


@dataclass
class OptimConfig:
    global_batch_size: int = 64
    """Samples per optimizer step."""
    num_steps_per_rollout: int = 1
    """Optimizer steps per rollout (the rollout's samples are split over them)."""
    micro_batch_size: int = 32
    """Train pairs per forward/backward (gradient accumulation up to the optimizer step)."""
    lr: float = 3e-4
    """Learning rate (AdamW)."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """cosine: from --lr at the first rollout down to --lr × --lr-min-ratio at --num-rollout."""
    lr_min_ratio: float = 0.1
    """With --lr-schedule cosine: the last rollout's rate as a fraction of --lr."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    adam_beta1: float = 0.9
    """AdamW β1."""
    adam_beta2: float = 0.999
    """AdamW β2."""
    grad_clip: float = 1.0
    """Gradients are clipped to this global norm (inf: no clipping)."""
    offload_optimizer: bool = False
    """Keep the optimizer state (Adam's moments) in host memory while the engines sample and on the device
    for the update: the same steps, less device memory during rollouts (a copy each way per rollout)."""
    offload_reference: bool = False
    """Keep a full finetune's frozen starting weights (the KL reference to the base, a preference method's base
    model) in host memory, copied in for each use: the device saves their copy (the transformer, in bf16 with a
    bf16 forward) for two host-device copies of it per reference forward. LoRA has no such copy."""

    def check(self) -> None:
        _require(self.lr >= 0, f"--lr must be >= 0, got {self.lr}")
        _require(0 <= self.lr_min_ratio <= 1, f"--lr-min-ratio must be in [0, 1], got {self.lr_min_ratio}")
        _require(self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}")
        _require(self.grad_clip > 0, f"--grad-clip must be > 0 (inf: no clipping), got {self.grad_clip}")
        for name in ("global_batch_size", "num_steps_per_rollout", "micro_batch_size"):
            _require(getattr(self, name) >= 1, f"--{name.replace('_', '-')} must be >= 1")
        _require(0 <= self.adam_beta1 < 1 and 0 <= self.adam_beta2 < 1,
                 f"--adam-beta1/--adam-beta2 must be in [0, 1) (got {self.adam_beta1}, {self.adam_beta2})")


@dataclass
class TaskConfig:
    prompt_data: Path | None = None
    """Training prompts: a .txt file (one per line), a .jsonl file (--input-key is the prompt, the other
    keys reach the reward as metadata) or a directory with train.txt/test.txt or
    train_metadata.jsonl/test_metadata.jsonl. None: the shapes world (the zero-configuration default)."""
    eval_prompt_data: Path | None = None
    """Held-out prompts (same formats); None: the test split of a --prompt-data directory."""
    input_key: str = "prompt"
    """The key of a .jsonl file's prompt (refused when every prompt file read is a .txt: it has no keys)."""
    train_num_prompts: int | None = None
    """With --prompt-data: train on only the first this many training prompts, in file order (None: all)."""
    reward: str = "shapes"
    """The reward spec: a name (shapes, ocr, jpeg_compressibility, …), NAME@PATH for a model reward,
    multi:NAME=W,… or module:function (`diffrl rewards` lists them)."""
    eval_reward: str | None = None
    """A held-out judge (a reward spec like --reward's) that scores every held-out evaluation beside the trained
    reward (`eval/judge`), with how far each moved since the first evaluation in units of its spread there
    (`eval/reward_gain_sd`, `eval/judge_gain_sd`) and their difference (`eval/hacking_gap_sd`): a trained reward
    that rises where the judge does not is being gamed. Prompt-set runs (the shapes world's judge is its verifier)."""
    reward_schedule: tuple[str, ...] = ()
    """Weights of a multi: reward's terms that change over the run, each NAME:START:END:FIRST:LAST: the term's
    weight moves linearly from START at rollout FIRST to END at rollout LAST (rewards/schedule.py); the rollout's
    weights are logged as rollout/reward_weight/<name>."""
    reward_frames: int | None = None
    """Video: the reward (rollouts and held-out evaluation alike) sees only this many evenly spaced frames
    of each video, first and last included; None: every frame."""
    reward_workers: int = 0
    """Score rewards in this many worker processes (microgroups in parallel, as they land); 0: inline."""
    reward_device: str | None = None
    """Where model rewards (pickscore, hpsv2, …) run; None: CUDA when present, else the CPU."""
    reward_colocate: bool = False
    """Model rewards share the trainer's GPU but leave it while the trainer trains: moved to host memory after
    each rollout and evaluation, back before the next one scores (as a --colocate engine sleeps); with
    --reward-workers each worker moves its own copy. Costs a copy of the reward's weights each way per rollout."""
    world: Literal["shapes", "shapes-edit"] = "shapes"
    """Without --prompt-data: the shapes world (text to image), or its editing world (shapes-edit: an instruction and
    its rendered source scene per prompt, for an image-conditioned family, judged by --reward shapes_edit or
    shapes_edit_strict; docs/editing-world.md)."""
    condition_images: Literal["auto", "required"] = "auto"
    """Whether every prompt must carry a condition image (image to video's first frame, an edit's source).
    required: every row of --prompt-data (and of the held-out prompts evaluated) names one under `image` or
    `images`, else the run stops at start-up naming the file and the first row without one; what an
    image-to-video recipe sets, as a checkpoint that also makes video from text alone (LTX-2) would otherwise
    train text to video on such rows. auto: what the checkpoint needs (one that cannot run without a condition
    image, e.g. Wan2.2 I2V, requires one in every row the same way). Either way a row with more condition images
    than the checkpoint takes (any, on a text-only one) is refused at start-up."""
    train_categories: tuple[str, ...] = ()
    """Shapes categories to draw train prompts from (default: all six)."""
    category_sampling: Literal["uniform", "adaptive"] = "uniform"
    """uniform: categories take turns; adaptive: more groups for categories with lower training
    reward (share ∝ floor + 1 − smoothed mean reward; rewards in [0, 1]). See tasks/prompt_sampler.py."""
    category_difficulty: Literal["reward", "unsolved"] = "reward"
    """What adaptive sampling calls hard: reward = 1 − the category's smoothed mean reward; unsolved =
    the smoothed fraction of its samples scoring below --category-solved-reward."""
    category_solved_reward: float = 1.0
    """--category-difficulty unsolved: a sample scoring below this counts as unsolved."""
    category_sampling_floor: float = 0.05
    """Adaptive sampling: every category's share is at least proportional to this (no category starves)."""
    category_reward_smoothing: float = 0.8
    """Adaptive sampling: weight of the previous value in each category's exponential average."""

    def check(self) -> None:
        # deferred: the rewards package imports torch and httpx, which `diffrl train --help` should not pay for
        from diffrl.rewards import SHAPES_TEXT_TO_IMAGE_REWARDS, model_rewards_in, multi_weights
        from diffrl.rewards.schedule import parse_schedule

        _require(self.reward_workers >= 0, f"--reward-workers must be >= 0, got {self.reward_workers}")
        _require(self.reward_frames is None or self.reward_frames >= 1,
                 f"--reward-frames must be >= 1 (or unset: every frame), got {self.reward_frames}")
        _require(self.prompt_data is not None or self.eval_prompt_data is None,
                 "--eval-prompt-data needs --prompt-data (the shapes world has its own test split)")
        _require(self.train_num_prompts is None or (self.train_num_prompts >= 1 and self.prompt_data is not None),
                 f"--train-num-prompts {self.train_num_prompts} needs --prompt-data and a count >= 1")
        if self.reward_schedule:  # names, numbers and ranges checked before anything loads
            parse_schedule(self.reward_schedule,
                           multi_weights(self.reward) if self.reward.startswith("multi:") else {})
        _require(self.eval_reward is None or self.prompt_data is not None,
                 "--eval-reward judges a --prompt-data run's held-out images; the shapes world is judged by its exact "
                 "verifier (eval/strict)")
        if self.world == "shapes-edit":
            _require(self.prompt_data is None, "--world shapes-edit draws its own prompts; drop --prompt-data")
            _require(self.reward not in SHAPES_TEXT_TO_IMAGE_REWARDS, f"--reward {self.reward} judges text-to-image "
                     "shapes prompts; the editing world's are edits: pass --reward shapes_edit (or shapes_edit_strict)")
            _require(not self.train_categories, "--train-categories picks text-to-image shapes categories; "
                     "--world shapes-edit has edit kinds")
        _require(self.prompt_data is None or not self.train_categories,
                 "--train-categories picks shapes categories; a --prompt-data set has none")
        if self.reward_colocate:
            _require(bool(model_rewards_in(self.reward)),
                     f"--reward-colocate moves model rewards (clipscore, pickscore, aesthetic, hpsv2, temporal_clip) "
                     f"off the GPU; --reward {self.reward} has none")
            _require(self.reward_device != "cpu", "--reward-colocate with --reward-device cpu: the reward is never "
                                                  "on the GPU (drop one of them)")


@dataclass
class EvalConfig:
    eval_interval: int = 4
    """Evaluate on the held-out prompts every this many rollouts (and before the first)."""
    eval_num_prompts: int = 64
    """With --prompt-data: evaluate on the first this many held-out prompts (0: no evaluation)."""
    n_samples_per_eval_prompt: int = 1
    """With --prompt-data: images per held-out prompt (seeds 10 000 + k)."""
    eval_images_per_category: int = 8
    """Shapes world: held-out images per category (prompts × seeds, seeds balanced so small categories
    are not noise). 0: no held-out evaluation."""
    eval_guidance_scale: float | None = None
    """None: the rollout guidance scale."""
    eval_guidance_scale_2: float | None = None
    """The held-out CFG scale of a second (low-noise) expert (Wan2.2); None: the rollouts' --diffusion-guidance-scale-2
    when --eval-guidance-scale is unset, else --eval-guidance-scale."""
    val_images_per_category: int = 0
    """Shapes world, > 0: at each evaluation also score this many images per category of a fixed subset
    of the *train* prompts (`--val-prompts-per-category` of each, seeds 20 000 + k), and keep
    `checkpoints/best`: the weights with the highest validation strict accuracy so far. A checkpoint
    chosen this way never looked at the test prompts (early stopping for runs that peak and fall)."""
    val_prompts_per_category: int = 8
    """With --val-images-per-category: train prompts of each category in the validation subset."""
    eval_num_steps: int | None = None
    """ODE steps of the held-out evaluation; None: the rollout's --diffusion-num-steps. (Flow-GRPO and
    DiffusionNFT roll out with few steps and evaluate with more, e.g. 10 and 40.)"""
    eval_resolution: int | None = None
    """Side of the square held-out samples (as --resolution); None: --eval-height/--eval-width, else the rollouts'
    size. (Published recipes roll out small and evaluate at the model's own size, e.g. 384² and 1024².)"""
    eval_height: int | None = None
    """Height of the held-out samples, with --eval-width; None: the rollouts'."""
    eval_width: int | None = None
    """Width of the held-out samples, with --eval-height."""
    eval_num_frames: int | None = None
    """Frames of each held-out video (video families); None: the rollouts' --num-frames."""
    eval_condition_image_size: int | None = None
    """Image-conditioned models: the held-out evaluation's condition images sized to at most N × N pixels of area (as
    --condition-image-size, which rollouts use); None: the rollouts' sizing. (Flow-Factory's editing examples train on
    384² sources and evaluate on 512² or 1024² ones.)"""
    eval_log_images: int = 8
    """Evaluation images logged to TensorBoard at each evaluation."""
    eval_batch_size: int = 16
    """With --prompt-data: held-out samples denoised as one batch (memory, and the batch a sample is computed in:
    fixed for a run). Large outputs with large references want fewer (Qwen-Image-Edit at 1024²: 1, as Flow-Factory)."""
    eval_before_train: bool = True
    """Evaluate the starting weights before the first rollout (--no-eval-before-train: the first evaluation is
    after --eval-interval rollouts)."""

    def check(self) -> None:
        _require(self.eval_interval >= 1, "--eval-interval must be >= 1")
        _require(self.eval_log_images >= 0, f"--eval-log-images must be >= 0, got {self.eval_log_images}")
        _require(self.eval_batch_size >= 1, f"--eval-batch-size must be >= 1, got {self.eval_batch_size}")
        _require(self.eval_guidance_scale is None or self.eval_guidance_scale >= 0,
                 f"--eval-guidance-scale must be >= 0, got {self.eval_guidance_scale}")
        _require(self.eval_guidance_scale_2 is None or self.eval_guidance_scale_2 >= 0,
                 f"--eval-guidance-scale-2 must be >= 0, got {self.eval_guidance_scale_2}")
        _require(self.eval_condition_image_size is None or self.eval_condition_image_size >= MIN_CONDITION_IMAGE_SIZE,
                 f"--eval-condition-image-size must be at least {MIN_CONDITION_IMAGE_SIZE} pixels, got "
                 f"{self.eval_condition_image_size}")
        _require(self.eval_images_per_category >= 0, f"--eval-images-per-category must be >= 0 (0: no held-out "
                                                     f"evaluation), got {self.eval_images_per_category}")
        _require(self.val_images_per_category >= 0 and self.val_prompts_per_category >= 1,
                 f"--val-images-per-category must be >= 0 (got {self.val_images_per_category}) and "
                 f"--val-prompts-per-category >= 1 (got {self.val_prompts_per_category})")
        _require(self.eval_num_prompts >= 0 and self.n_samples_per_eval_prompt >= 1,
                 f"--eval-num-prompts must be >= 0 and --n-samples-per-eval-prompt >= 1 "
                 f"(got {self.eval_num_prompts}, {self.n_samples_per_eval_prompt})")
        _require(self.eval_num_steps is None or self.eval_num_steps >= 1,
                 f"--eval-num-steps must be >= 1, got {self.eval_num_steps}")
        sample_size(self.eval_resolution, self.eval_height, self.eval_width, flags="--eval-")
        _require(self.eval_num_frames is None or self.eval_num_frames >= 1,
                 f"--eval-num-frames must be >= 1, got {self.eval_num_frames}")


@dataclass
class CheckpointConfig:
    output_dir: Path | None = None
    """Run folder; default runs/<recipe or loss type>-<date-time>."""
    resume: bool = False
    """Continue the run in --output-dir from its last checkpoint."""
    checkpoint_interval: int = 4
    """Save a checkpoint every this many rollouts (and at the end)."""
    keep_last_checkpoints: int | None = None
    """Keep only the newest N `checkpoints/rollout-N` folders (older ones are removed after each save; `best/`
    stays); None: every checkpoint."""
    time_budget_minutes: float | None = None
    """Stop after the rollout that passes this wall-clock budget (then the final eval and checkpoint)."""
    use_wandb: bool = False
    """Also log metrics and evaluation images to Weights & Biases (the `wandb` package; its key from
    WANDB_API_KEY or `wandb login`, never from a flag)."""
    wandb_project: str = "diffrl"
    """With --use-wandb: the W&B project."""
    wandb_group: str | None = None
    """With --use-wandb: the W&B group (runs to compare together)."""
    wandb_run_name: str | None = None
    """Default: the run folder's name."""
    wandb_mode: str = "online"
    """online, or offline (written under the run folder, `wandb sync` later)."""
    use_swanlab: bool = False
    """Also log metrics and evaluation images to SwanLab (the `swanlab` package; its key from SWANLAB_API_KEY or
    `swanlab login`, never from a flag)."""
    swanlab_project: str = "diffrl"
    """With --use-swanlab: the SwanLab project."""
    swanlab_group: str | None = None
    """With --use-swanlab: the experiment group (runs to compare together)."""
    swanlab_run_name: str | None = None
    """With --use-swanlab: the experiment's name; default: the run folder's name."""
    swanlab_mode: Literal["online", "local", "offline", "disabled"] = "online"
    """online, offline (written under the run folder's swanlog/, `swanlab sync` later), local (there too, for a local
    dashboard: `pip install 'swanlab[dashboard]'`, `swanlab watch RUN/swanlog`) or disabled."""

    def check(self) -> None:
        _require(self.checkpoint_interval >= 1, "--checkpoint-interval must be >= 1")
        _require(self.keep_last_checkpoints is None or self.keep_last_checkpoints >= 1,
                 f"--keep-last-checkpoints must be >= 1 (a run keeps its newest checkpoint to resume from), got "
                 f"{self.keep_last_checkpoints}")
        _require(self.time_budget_minutes is None or self.time_budget_minutes > 0,
                 f"--time-budget-minutes must be > 0, got {self.time_budget_minutes}")
        _require(not self.resume or self.output_dir is not None, "--resume needs the --output-dir of the run to continue")
        _require(self.wandb_mode in ("online", "offline"), f"--wandb-mode must be online or offline, got {self.wandb_mode!r}")


@dataclass
class PlacementConfig:
    device: str = "auto"
    """Where the trainer and its in-process engine run: auto (CUDA when present), cpu, cuda, cuda:N."""
    ray_engines: int = 0
    """Place this many engines and the trainer as Ray actors in one placement group (0 and one
    trainer rank: no Ray)."""
    ray_address: str | None = None
    """An existing Ray cluster (default: start a local one)."""
    ray_colocate: bool = True
    """PACK the bundles onto as few nodes as possible (--no-ray-colocate: SPREAD across nodes)."""
    ray_gpus_per_engine: float = 0.0
    """GPUs for each Ray engine actor (--ray-engines)."""
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

    def uses_ray(self) -> bool:
        return self.ray_engines > 0 or self.ray_trainer_ranks > 1

    def check(self) -> None:
        _require(self.ray_trainer_ranks >= 1, f"--ray-trainer-ranks must be >= 1, got {self.ray_trainer_ranks}")
        _require(not (self.ray_trainer_ranks > 1 and self.ray_engines),
                 "--ray-trainer-ranks > 1 rolls out on each rank's in-process engine; with --ray-engines "
                 "every rank would push its weights to them (use one or the other)")
        _require(self.ray_reward_workers >= 0 and not (self.ray_reward_workers and not self.uses_ray()),
                 "--ray-reward-workers places reward actors beside --ray-engines N (N >= 1) or "
                 f"--ray-trainer-ranks T (T >= 2); got {self.ray_reward_workers} reward workers, "
                 f"{self.ray_engines} engines and {self.ray_trainer_ranks} trainer ranks")


@dataclass
class ReplayConfig:
    save_rollout_data: Path | None = None
    """Write each rollout's record under this folder, one file per rollout (seeds, prompts, rewards and the
    trajectories the trainer uses; see train/replay.py)."""
    load_rollout_data: Path | None = None
    """Take each rollout from its record under this folder instead of rolling out: no engine, no reward
    model, no held-out evaluation (implies --debug-train-only); the records must be of this configuration."""
    debug_rollout_only: bool = False
    """Roll out (rewards, metrics, records, evaluation) but take no training step."""
    debug_train_only: bool = False
    """Train only, from --load-rollout-data's records: nothing samples."""

    def check(self) -> None:
        _require(not self.debug_train_only or self.load_rollout_data is not None,
                 "--debug-train-only trains from saved rollouts: pass --load-rollout-data DIR")
        _require(not (self.debug_rollout_only and self.load_rollout_data is not None),
                 "--debug-rollout-only rolls out and --load-rollout-data replaces rolling out: pass one of them")
        _require(not (self.save_rollout_data is not None and self.load_rollout_data is not None),
                 "--save-rollout-data with --load-rollout-data would only copy the records: pass one of them")


_SECTIONS = {"model": ModelConfig, "rollout": RolloutSettings, "engine": EnginePoolConfig,
             "algorithm": AlgorithmConfig, "optim": OptimConfig, "task": TaskConfig, "eval": EvalConfig,
             "checkpoint": CheckpointConfig, "placement": PlacementConfig, "replay": ReplayConfig,
             "grpo_guard": GrpoGuardConfig, "awm": AwmConfig, "dpo": DpoConfig, "dgpo": DgpoConfig, "crd": CrdConfig}


@dataclass
class TrainConfig:
    recipe: str | None = None
    """Preset applied before the other flags (see `diffrl/recipes.py`)."""
    seed: int = 0
    """Seed of the trainer: torch's global seed, the prompt draws and the training steps' timestep and noise draws
    (rollout noise is --rollout-seed's)."""
    deterministic_mode: bool = False
    """torch.use_deterministic_algorithms: slower, bit-reproducible where the hardware allows."""
    model: ModelConfig = field(default_factory=ModelConfig)
    rollout: RolloutSettings = field(default_factory=RolloutSettings)
    engine: EnginePoolConfig = field(default_factory=EnginePoolConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    # One section per method that has settings of its own (--loss-type picks the method).
    grpo_guard: GrpoGuardConfig = field(default_factory=GrpoGuardConfig)
    awm: AwmConfig = field(default_factory=AwmConfig)
    dpo: DpoConfig = field(default_factory=DpoConfig)
    dgpo: DgpoConfig = field(default_factory=DgpoConfig)
    crd: CrdConfig = field(default_factory=CrdConfig)

    @classmethod
    def flat(cls, **fields) -> TrainConfig:
        """A configuration from flat field names (the flags' names), e.g. `TrainConfig.flat(lr=1e-4)`."""
        return cls().replace(**fields)

    @classmethod
    def from_settings(cls, settings: dict, source: str = "the config file") -> TrainConfig:
        """A configuration from what a run's `config.json` holds (`{"flags": …}` or `{"tree": …}`), a tree of
        sections, or flat names. Values read back from JSON or YAML take their field's type (a path from a string,
        a tuple from a list); an unknown setting is refused naming `source`."""
        if not isinstance(settings, dict):
            raise ValueError(f"{source}: expected a mapping of settings, got {type(settings).__name__}")
        settings = settings.get("flags", settings.get("tree", settings))
        flat = {}
        for key, value in settings.items():
            if key in _SECTIONS and isinstance(value, dict):
                flat.update(value)
            else:
                flat[key] = value
        unknown = sorted(k for k in flat if k not in _TYPES)
        if unknown:
            raise ValueError(f"{source}: unknown training setting(s) {', '.join(unknown)}")
        return cls().replace(**{k: _typed(_TYPES[k], v) for k, v in flat.items()})

    def replace(self, **fields) -> TrainConfig:
        """A copy with fields changed by their flat names; an unknown name is refused."""
        top = {k: fields.pop(k) for k in list(fields) if k in ("recipe", "seed", "deterministic_mode")}
        sections = {}
        for name in _SECTIONS:
            own = {k: fields.pop(k) for k in list(fields) if k in _FIELDS_OF[name]}
            if own:
                sections[name] = dataclasses.replace(getattr(self, name), **own)
        if fields:
            raise ValueError(f"unknown training setting(s): {', '.join(sorted(fields))}")
        return dataclasses.replace(self, **top, **sections)

    def check(self) -> None:
        """Refuse contradictory settings up front, naming the flags."""
        from diffrl.rewards.groups import is_group_reward  # deferred: the rewards package imports torch (train --help)

        for name in _SECTIONS:
            getattr(self, name).check()
        self.model.speed_options().check(self.deterministic_mode)  # the attention kernels it allows
        r, o, a = self.rollout, self.optim, self.algorithm
        check_batch_invariant(r.rollout_batch_size, r.n_samples_per_prompt, o.global_batch_size, o.num_steps_per_rollout)
        rows = METHODS[a.loss_type].rows
        _require(rows == "sample" or r.n_samples_per_prompt > 1,
                 f"--loss-type {a.loss_type} compares the samples of one prompt: --n-samples-per-prompt must be >= 2")
        _require(r.n_samples_per_prompt > 1 or a.globalize_reward_mean or self.replay.debug_rollout_only,
                 "--n-samples-per-prompt 1: each sample is its prompt's mean reward, so every advantage is 0 and "
                 "nothing trains; sample 2 or more per prompt, or pass --globalize-reward-mean")
        if a.loss_type in SDE_LOSS_TYPES:  # ODE methods never read the SDE window (a recipe's own stays unread)
            lo, hi = r.sde_window_range()
            _require(0 <= lo < hi <= r.diffusion_num_steps,
                     f"--diffusion-sde-window-range {lo},{hi} must satisfy 0 <= lo < hi <= --diffusion-num-steps "
                     f"({r.diffusion_num_steps})")
            _require(1 <= r.diffusion_num_sde_steps <= hi - lo,
                     f"--diffusion-num-sde-steps {r.diffusion_num_sde_steps} does not fit in "
                     f"--diffusion-sde-window-range {lo},{hi}")
        lo, hi = a.train_timestep_range
        _require(0 <= lo < hi <= 1, f"--train-timestep-range {lo:g} {hi:g} must satisfy 0 <= start < end <= 1")
        _require(a.train_timesteps is None or a.train_timesteps >= 1,
                 f"--train-timesteps must be >= 1, got {a.train_timesteps}")
        _require(a.train_timestep_shift > 0, f"--train-timestep-shift must be > 0, got {a.train_timestep_shift}")
        _require(self.model.flow_shift is None or self.model.flow_shift > 0,
                 f"--flow-shift must be > 0, got {self.model.flow_shift}")
        _require(self.model.condition_image_size is None or self.model.condition_image_size >= MIN_CONDITION_IMAGE_SIZE,
                 f"--condition-image-size must be at least {MIN_CONDITION_IMAGE_SIZE} pixels, got "
                 f"{self.model.condition_image_size}")
        _require(a.loss_type in SDE_LOSS_TYPES or a.train_timesteps is not None
                 or int(r.diffusion_num_steps * a.nft_timestep_fraction) >= 1,
                 f"--nft-timestep-fraction {a.nft_timestep_fraction} keeps no timestep of "
                 f"--diffusion-num-steps {r.diffusion_num_steps}")
        _require(self.replay.load_rollout_data is None or not (self.engine.engine_urls or self.placement.ray_engines
                                                               or self.engine.colocate),
                 "--load-rollout-data trains without engines: drop --engine-urls, --ray-engines and --colocate")
        _require(not (self.engine.colocate and self.uses_ray()),
                 "--colocate starts its engine beside a one-process trainer; not with --ray-engines or "
                 "--ray-trainer-ranks")
        _require(not (is_group_reward(self.task.reward) and self.placement.ray_reward_workers),
                 f"--reward {self.task.reward} scores a prompt's whole group at once, which --ray-reward-workers' "
                 "actors do not yet; use --reward-workers N")
        _require(self.model.fold_lora_without_grad != "on" or METHODS[a.loss_type].folds_lora,
                 f"--fold-lora-without-grad on with --loss-type {a.loss_type}: its loss sets a no-gradient forward "
                 "against a trained one (a replayed log-prob or an old policy's likelihood), which the fold's rounding "
                 "would move; only " + ", ".join(n for n, m in METHODS.items() if m.folds_lora) + " take it")
        _require(self.model.use_lora or self.model.fold_lora_without_grad != "on",
                 "--fold-lora-without-grad on folds a LoRA adapter; a full finetune (--no-use-lora) has none")
        _require(not (o.offload_reference and self.model.use_lora),
                 "--offload-reference keeps a full finetune's copy of its starting weights on the host; with "
                 "--use-lora the base is the adapter switched off and there is no copy (drop one of them)")
        copy_dtype = self.engine.engine_copy_dtype
        _require(copy_dtype == "auto" or not self.model.use_lora,
                 f"--engine-copy-dtype {copy_dtype} sets a full finetune's engine copy; with --use-lora the copy is the "
                 "base as loaded and the adapters (drop one of them)")
        _require(copy_dtype != "bfloat16" or self.model.mixed_precision != "no",
                 "--engine-copy-dtype bfloat16 needs a bf16 forward (--mixed-precision bf16, or auto on a GPU)")
        t, e = self.task, self.eval
        if t.prompt_data is not None:  # what only the shapes world reads would be ignored
            _require(t.category_sampling == "uniform", f"--category-sampling {t.category_sampling} draws shapes "
                     "categories; a --prompt-data set has none (set by the flag or the recipe: pass "
                     "--category-sampling uniform)")
            _require(e.val_images_per_category == 0, "--val-images-per-category scores shapes train prompts to keep "
                     "checkpoints/best; with --prompt-data there is no validation set (pass --val-images-per-category 0)")
        else:  # what only a prompt set reads would be ignored
            _require(t.input_key == "prompt", f"--input-key {t.input_key} picks the prompt of a --prompt-data .jsonl "
                     "file; the shapes world has no prompt file")
            _require(e.n_samples_per_eval_prompt == 1, f"--n-samples-per-eval-prompt {e.n_samples_per_eval_prompt} is "
                     "for --prompt-data; the shapes world's held-out images are --eval-images-per-category")
        _require(a.advantage_aggregation == "sum" or (t.reward.startswith("multi:") and not a.globalize_reward_mean
                                                       and not a.globalize_reward_std),
                 f"--advantage-aggregation gdpo normalizes each term of a multi: reward within its prompt's group "
                 f"(--reward multi:NAME=W,…; got --reward {t.reward}), without --globalize-reward-mean/-std")
        _require(a.advantage_aggregation == "sum" or self.replay.load_rollout_data is None,
                 "--advantage-aggregation gdpo needs each reward term; rollout records keep only their sum")
        _require(a.advantage_aggregation == "sum" or not self.placement.ray_reward_workers,
                 "--advantage-aggregation gdpo needs each reward term; Ray reward actors return only their sum")
        _require(not (self.task.reward_colocate and self.placement.ray_reward_workers),
                 "--reward-colocate moves the rewards of the trainer's process and of --reward-workers; Ray reward "
                 "actors (--ray-reward-workers) keep theirs")

    def uses_ray(self) -> bool:
        return self.placement.uses_ray()

    def as_flat_dict(self) -> dict:
        """Every setting by its flat name (what `config.json` of a run holds, beside the tree)."""
        out = {"recipe": self.recipe, "seed": self.seed, "deterministic_mode": self.deterministic_mode}
        for name in _SECTIONS:
            out.update(dataclasses.asdict(getattr(self, name)))
        return out


_FIELDS_OF = {name: {f.name for f in dataclasses.fields(kind)} for name, kind in _SECTIONS.items()}
_TYPES = {f.name: str(f.type) for kind in (*_SECTIONS.values(), TrainConfig) for f in dataclasses.fields(kind)
          if f.name not in _SECTIONS}


def _typed(hint: str, value):
    """A value read from JSON or YAML as its field's type: a path from a string, a tuple from a list."""
    if isinstance(value, str) and "Path" in hint:
        return Path(value)
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, int) and not isinstance(value, bool) and hint.startswith("float"):
        return float(value)
    return value
_all = [f for fields in _FIELDS_OF.values() for f in fields] + ["recipe", "seed", "deterministic_mode"]
assert len(_all) == len(set(_all)), "flag names must be unique across the configuration tree"


def uses_ray(cfg: TrainConfig) -> bool:
    """Whether the run is placed through Ray (engines or several trainer ranks as actors)."""
    return cfg.uses_ray()
