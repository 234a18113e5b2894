"""The flags of `diffrl evaluate`, `compare`, `bench` and `bench-train`: one dataclass each, every field a flag.

They live here, apart from the commands that run them (`evaluate.py`, `compare.py`, `bench.py`, `bench_train.py`,
which import them from here), so that `diffrl SUBCOMMAND --help` builds its parser without importing torch, the
models or the rewards (tests/test_cli_help.py checks): this module imports nothing that does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import tyro

from diffrl.train.config import TrainConfig


@dataclass
class EvaluateConfig:
    run: tyro.conf.Positional[Path | None] = None
    """A run folder (its newest checkpoint) or a checkpoint inside one: the model, family, size, steps, CFG and
    held-out images are the run's (its config.json); any flag given overrides them. Same as --checkpoint."""
    model_path: Path | None = None
    """Local diffusers-format model directory (default: the run's base model, else the shipped demo model)."""
    checkpoint: Path | None = None
    """A run folder or a run checkpoint (…/checkpoints/rollout-N: model/, lora/ or transformer/) applied to
    --model-path; a checkpoint outside any run folder takes its settings from the flags alone."""
    diffusion_model_family: str | None = None
    """The model family (sd3, flux3_image, wan2_2, …); default: the run's, else detected from the model folder."""
    world: Literal["shapes", "shapes-edit"] | None = None
    """Without --prompt-data: the shapes world (text to image) or its editing world (shapes-edit: the task's
    held-out edits, --images-per-category of each kind at its fixed seeds, strict accuracy per edit kind;
    docs/editing-world.md). Default: the run's --world, else shapes-edit for a demo model that knows the edit verbs
    (diffrl/assets/demo-shapes-edit), else shapes."""
    prompt_data: Path | None = None
    """Evaluate on this prompt set (.txt, .jsonl, or a directory: its test split) scored by --reward,
    instead of the shapes world."""
    input_key: str = "prompt"
    """The prompt's key in a .jsonl prompt set; the other keys are metadata passed to the reward."""
    reward: str | None = None
    """With --prompt-data: the reward spec (ocr, pickscore@PATH, multi:A=W,B=W, module:function)."""
    eval_reward: str | None = None
    """With --prompt-data: a judge reward scoring the same images beside --reward (eval/judge); a run's own
    --eval-reward when evaluating a run folder."""
    num_prompts: int | None = None
    """With --prompt-data: the first K prompts (default: all)."""
    n_samples_per_eval_prompt: int = 1
    """With --prompt-data: images (seeds) per prompt; image k of the expanded list uses seed `seed + k`."""
    reward_device: str = "auto"
    """With --prompt-data: where model rewards load and score (auto: CUDA when present; cpu, cuda, cuda:N)."""
    negative_prompt: str = ""
    """With --prompt-data: the unconditional side of CFG."""
    num_frames: int | None = None
    """Video families: frames per sample (default: the family's)."""
    split: Literal["test", "train"] = "test"
    """Shapes world: which split's prompts."""
    max_prompts_per_category: int | None = None
    """Shapes world: at most this many prompts of each category."""
    num_seeds: int | None = None
    """Shapes world: images per prompt (default 4); image k of the expanded prompt list uses seed `seed + k`."""
    images_per_category: int | None = None
    """Shapes world, instead of --num-seeds: at least this many images per category, shared out over its prompts
    (the trainer's held-out protocol, --eval-images-per-category; with --seed 10000 the same images). Editing
    world: held-out edits of each kind (default: the run's --eval-images-per-category, else 16)."""
    seed: int | None = None
    """First seed (default: 0 for the shapes world, 10000 for --prompt-data, the trainer's held-out seeds)."""
    num_steps: int | None = None
    """ODE steps per sample (default: the run's held-out evaluation steps, else 10)."""
    guidance_scale: float | None = None
    """CFG scale (default: the run's held-out CFG, i.e. its rollouts' unless it set --eval-guidance-scale; without
    a run 3.0 for the shapes world, the family's default for --prompt-data)."""
    guidance_scale_2: float | None = None
    """With --prompt-data: the CFG scale of a second (low-noise) expert (Wan2.2, as a run's
    --diffusion-guidance-scale-2); default: --guidance-scale."""
    resolution: int | None = None
    """Side in pixels of the square images (default: the run's size, else the family's)."""
    height: int | None = None
    """With --width, instead of --resolution: a size that is not square (e.g. video at 512 × 768)."""
    width: int | None = None
    """With --height: the width in pixels."""
    flow_shift: float | None = None
    """A static schedule shift in place of the model's (as `diffrl train --flow-shift`); default: the run's."""
    condition_image_size: int | None = None
    """Image-conditioned models: each condition image sized to at most N × N pixels of area (as `diffrl train
    --condition-image-size`); default: the run's, else the pipeline's own sizing."""
    reward_frames: int | None = None
    """With --prompt-data, video: the reward sees this many evenly spaced frames of each video (as the trained
    run's --reward-frames); default every frame."""
    batch_size: int = 64
    """Images sampled per forward batch (memory, not results)."""
    device: str = "auto"
    """Where the model runs: auto (CUDA when present), cpu, cuda, cuda:N."""
    float8: bool = False
    """The transformer blocks' linear layers as FP8 matmuls (as `diffrl train --float8`): evaluates what a run
    trained with it samples, or how far FP8 moves a model trained without it."""
    output_dir: Path | None = None
    """Where the results go (default: runs/eval-<run name>-<date-time>, a new folder each time). A folder that
    already holds results is refused unless --overwrite is given."""
    overwrite: bool = False
    """Replace the results already in --output-dir."""
    save_images: bool = False
    """Shapes world: also write every image (images/00000.png, ...), named in its records.jsonl row (its prompt,
    seed and verdict: strict, score, reason), so the evaluation can be re-scored (--prompt-data always writes them)."""


@dataclass
class CompareConfig:
    run: tyro.conf.Positional[Path | None] = None
    """The trained run folder (its newest checkpoint) or a checkpoint inside one; same as --trained."""
    trained: Path | None = None
    """A run folder, a run checkpoint (…/checkpoints/rollout-N: model/, lora/ or transformer/) or a model
    directory. From a run folder (or a checkpoint in one) the base model, family, size, steps and CFG are the
    run's (its config.json); flags given override them."""
    base: Path | None = None
    """The base model (also what a LoRA or transformer-only checkpoint is applied to); default: the run's
    --model-path, else the shipped demo model."""
    base_checkpoint: Path | None = None
    """Compare two checkpoints: this one is applied to --base for the left column."""
    diffusion_model_family: str | None = None
    """The model family; default: the run's, else detected from the model folder."""
    world: Literal["shapes", "shapes-edit"] | None = None
    """Without --prompt-data: the shapes world (text to image) or its editing world (shapes-edit: the task's
    held-out edits, --images-per-category of each kind at its fixed seeds, strict accuracy per edit kind;
    docs/editing-world.md). Default: the run's --world, else shapes-edit for a demo model that knows the edit verbs
    (diffrl/assets/demo-shapes-edit), else shapes."""
    prompt_data: Path | None = None
    """Compare on this prompt set (.txt, .jsonl, or a directory: its test split) scored by --reward,
    instead of the shapes world."""
    input_key: str = "prompt"
    """The prompt's key in a .jsonl prompt set; the other keys are metadata passed to the reward."""
    reward: str | None = None
    """With --prompt-data: the reward spec (ocr, pickscore@PATH, multi:A=W,B=W, module:function)."""
    eval_reward: str | None = None
    """With --prompt-data: a judge reward scoring the same images beside --reward (each column's eval/judge in
    report.json's summaries); a run's own --eval-reward when comparing a run folder."""
    tie_margin: float = 0.01
    """With --prompt-data: a prompt is a tie when |trained − base| mean rewards (over its seeds) ≤ this."""
    n_samples_per_eval_prompt: int = 1
    """With --prompt-data: images (seeds) per prompt; image k of the expanded list uses seed `seed + k`."""
    reward_device: str = "auto"
    """With --prompt-data: where model rewards load and score (auto: CUDA when present; cpu, cuda, cuda:N)."""
    negative_prompt: str = ""
    """With --prompt-data: the unconditional side of CFG."""
    resolution: int | None = None
    """Side in pixels of the square images (default: the run's size, else the family's)."""
    height: int | None = None
    """With --width, instead of --resolution: a size that is not square."""
    width: int | None = None
    """With --height: the width in pixels."""
    reward_frames: int | None = None
    """With --prompt-data, video: the reward sees this many evenly spaced frames of each video (default: all)."""
    num_frames: int | None = None
    """With --prompt-data, video families: frames per sample (default: the family's)."""
    condition_image_size: int | None = None
    """With an editing --prompt-data: every column's condition images sized to at most N × N pixels of area (as
    `diffrl train --condition-image-size`); default: the run's held-out size, else the pipeline's own sizing. One
    size for all columns: the base is judged on the sources the trained model is."""
    batch_size: int = 16
    """With --prompt-data: images sampled, and scored by --reward (and --eval-reward), per batch (memory, not
    results); the shapes world samples 64 at a time."""
    num_prompts: int | None = None
    """The first N prompts (default: every prompt of --prompt-data; the shapes world: --images-per-category)."""
    num_seeds: int | None = None
    """Shapes world, with --num-prompts: images per prompt (default 1), instead of --images-per-category."""
    images_per_category: int | None = None
    """Shapes world: at least this many images of each category, shared out over its test prompts (the trainer's
    held-out protocol); default: the run's --eval-images-per-category, at least 8 (without a run, 16). Editing
    world: held-out edits of each kind, with the same default."""
    seed: int | None = None
    """First seed (default: 10000, the trainer's held-out seeds; 0 for the shapes world's --num-prompts)."""
    num_steps: int | None = None
    """ODE steps per sample (default: the run's held-out evaluation steps, else 10)."""
    guidance_scale: float | None = None
    """Shapes world: CFG for both models (default: the run's held-out CFG, else 1.0). --prompt-data: the base-with-CFG column's scale
    (default: the family's); the base-without-CFG column runs at 1."""
    guidance_scale_2: float | None = None
    """With --prompt-data: the CFG scale of a second (low-noise) expert (Wan2.2, as a run's
    --diffusion-guidance-scale-2) in the columns with CFG; default: their CFG scale."""
    base_guidance_scale: float | None = None
    """Shapes world: the base model's CFG, overriding --guidance-scale."""
    trained_guidance_scale: float | None = None
    """The trained model's CFG (default: the run's held-out CFG, so a run that samples without CFG, e.g.
    DiffusionNFT, is judged without it; else --guidance-scale)."""
    device: str = "auto"
    """Where the models run: auto (CUDA when present), cpu, cuda, cuda:N."""
    output_dir: Path | None = None
    """Where the results go (default: runs/compare-<run name>-<date-time>, a new folder each time). A folder that
    already holds results is refused unless --overwrite is given."""
    overwrite: bool = False
    """Replace the results already in --output-dir."""


@dataclass
class BenchConfig:
    model_path: Path | None = None
    """Local diffusers-format model directory (default: the shipped demo model)."""
    diffusion_model_family: str | None = None
    """The model family (sd3, flux3_image, wan2_2, …); default: detected from the model folder."""
    device: str = "auto"
    """Where the model runs: auto (CUDA when present), cpu, cuda, cuda:N."""
    dtype: str = "bfloat16"
    """Weights' dtype for the benchmark (float32 or bfloat16)."""
    resolution: int | None = None
    """Square image side; None: --height/--width, else the family's default size."""
    height: int | None = None
    """With --width, instead of --resolution: a size that is not square (e.g. video at 512 × 768)."""
    width: int | None = None
    """With --height: the width in pixels."""
    num_frames: int | None = None
    """Video families: frames per sample (None: the family's default); refused for image families."""
    n: int = 16
    """Samples in the timed group (and the transformer's larger batch)."""
    ms: tuple[int, ...] = (1, 8, 16)
    """Microgroup sizes to time the group at."""
    steps: int = 10
    """Denoising steps of each timed sample: the engine's requests and the reference pipeline's calls (the
    transformer-alone figures are per step, the VAE's per image)."""
    guidance_scale: float | None = None
    """None: the family's default."""
    repeats: int = 2
    """Timed groups per microgroup size (median), after one warm-up group."""
    peak_tflops: float = 790.0
    """Dense bf16 peak of the GPU for MFU (H200: 790)."""
    compile: bool = False
    """Regional torch.compile of the family's blocks (as `diffrl train --compile`)."""
    eager_numerics: bool = False
    """With --compile: keep eager's bf16 roundings (the trainer's default; costs a few percent)."""
    compile_mode: Literal["default", "reduce-overhead", "max-autotune-no-cudagraphs"] = "default"
    """With --compile: torch.compile's mode (as `diffrl train --compile-mode`; reduce-overhead is refused: CUDA
    graphs fail under per-block compilation, each block's replay overwriting the previous block's output)."""
    attention_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the transformer's forwards (as `diffrl train --attention-backend`)."""
    fuse_qkv: bool = False
    """SD3: q/k/v projections as one matmul per stream (as `diffrl train --fuse-qkv`)."""
    vae_decode_batch: int | None = None
    """Images per VAE decode call in the family's decode; 0: all at once (as `diffrl train --vae-decode-batch`)."""
    float8: bool = False
    """The blocks' linear layers as FP8 matmuls, in the engine and the pipeline alike (as `diffrl train
    --float8`)."""
    lora_rank: int = 0
    """Time the model as a LoRA training run's engine holds it: an adapter of this rank (α = 2·rank, fp32 factors, the
    family's LoRA targets) on the weights; 0: none. With --autocast, the LoRA loop's rollout forward."""
    fold_lora: bool = False
    """With --lora-rank: the adapter folded into the weights in the no-gradient forwards timed here, as a DiffusionNFT
    run samples (`diffrl train --fold-lora-without-grad`)."""
    autocast: bool = False
    """Run the forwards under bf16 autocast, as the training loop does on a GPU (`--mixed-precision`); with
    `--dtype float32` that is a full finetune's rollout forward over fp32 masters."""
    reference_pipeline: bool = True
    """Also time diffusers' pipeline on the same weights, when the family has one."""
    out: Path | None = None
    """Write the results as JSON here."""


# What `diffrl bench-train` changes in `train`'s defaults: a short run, no held-out evaluation.
BENCH_TRAIN_DEFAULTS = dict(num_rollout=3, eval_images_per_category=0, val_images_per_category=0, eval_num_prompts=0)


@dataclass
class BenchTrainConfig:
    """Time `diffrl train` with these flags for a few rollouts and print what the loop costs per sample."""

    train: TrainConfig = field(default_factory=TrainConfig)
    out: Path | None = None
    """Write the table, the FLOP estimate and the run's records as JSON here."""
    peak_tflops: float = 790.0
    """Dense bf16 peak of the GPU, for the MFU estimate (H200: 790)."""
    checkpoints: bool = False
    """Save checkpoints as `diffrl train` does (their time is outside the table either way)."""
