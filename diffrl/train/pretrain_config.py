"""The flags of `diffrl pretrain` (run by `pretrain.py`): apart from it, and importing nothing that imports torch,
so that `diffrl pretrain --help` builds its parser without loading torch (tests/test_cli_help.py checks)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from diffrl.models.demo import DemoConfig


@dataclass
class PretrainConfig:
    output_dir: Path = Path("runs/pretrain")
    """Run folder (created; an existing one is resumed only with --resume)."""
    world: str = "shapes"
    """What the model learns to draw: shapes (the shipped demo model's world), ocr (one-line renders of
    quoted texts at 48×256, the OCR world's model: docs/ocr-world.md) or shapes-edit (edits of a rendered source
    scene given as the condition image, the editing demo model: docs/editing-world.md)."""
    steps: int | None = None
    """Optimizer steps: 2,000 by default; with --max-minutes and no --steps, as many as the time allows
    (the step budget would otherwise end a time-boxed run early)."""
    batch_size: int = 64
    """Rendered (prompt, image) pairs per optimizer step."""
    lr: float = 3e-4
    """AdamW's peak learning rate (transformer and text encoder): reached after --warmup-steps, then cosine-decayed
    to 0.1 × lr by the end of the run (its steps or, with --max-minutes, its time, whichever is further along)."""
    warmup_steps: int = 200
    """Optimizer steps of linear learning-rate warm-up from lr / warmup-steps to --lr (0: none)."""
    weight_decay: float = 0.0
    """AdamW's decoupled weight decay."""
    grad_clip: float = 1.0
    """Largest global L2 norm of the gradients (transformer and text encoder together); larger ones are scaled
    down to it."""
    ema_decay: float = 0.999
    """Decay of the weights' EMA, per step (early steps use less: min(decay, (1 + step) / (10 + step))). The EMA is
    what is saved (checkpoints' model/, final/) and what draws the sample grids."""
    cfg_dropout: float = 0.1
    """Fraction of prompts replaced by "" (trains the unconditional branch for CFG)."""
    seed: int = 0
    """Seeds the random initial weights (without --init-from or --resume), the rendered training scenes, and the
    timesteps, noise and CFG dropout drawn each step."""
    device: str = "auto"
    """Where the model trains: auto (CUDA when present), cpu, cuda, cuda:N."""
    bf16: bool = True
    """bf16 autocast on CUDA; fp32 master weights."""
    num_workers: int = -1
    """Render workers; -1 = one per CPU core minus one."""
    log_every: int = 50
    """Every N optimizer steps: a metrics.jsonl row (loss, gradient norm, learning rate, samples per second)."""
    checkpoint_every: int = 1000
    """Every N optimizer steps: a checkpoint (checkpoints/step-N: the EMA model/ and train_state.pt) and its sample
    grid (samples/step-N.png); the run's end writes one more."""
    profile_steps: int = 0
    """Profile this many optimizer steps after the first 20 (compilation and the render workers' start) with
    torch.profiler and write profile.txt to --output-dir: operators and kernels by device and host time. 0: off."""
    max_minutes: float | None = None
    """Stop (and checkpoint) after this much wall-clock training time."""
    resume: bool = False
    """Continue --output-dir from its newest checkpoint (weights, optimizer, EMA, step); the model's size is the
    checkpoint's. Without it, an --output-dir that is not empty is refused."""
    init_from: Path | None = None
    """Start from a saved demo model directory (its weights and size) instead of random weights."""
    compile: bool = False
    """torch.compile the transformer (CUDA; falls back to eager where dynamo cannot compile)."""
    # Model size (the shipped demo model uses these defaults).
    # With --resume or --init-from the size is the loaded model's: a size flag that differs is refused.
    num_attention_heads: int = 4
    """Attention heads of the transformer (its width: heads × --attention-head-dim)."""
    attention_head_dim: int = 32
    """Width of each attention head; a multiple of 4 (the four RoPE axes share it)."""
    num_layers: int = 2
    """Per-mode transformer blocks: a stack for each kind of token (text, image, condition image), each attending
    within its own tokens (0: none)."""
    num_single_layers: int = 6
    """Joint transformer blocks after the per-mode ones, over the text and image tokens together."""
    rope_theta: int = 10000
    """Base of the transformer's rotary position frequencies. Each RoPE axis of a head (a quarter of
    --attention-head-dim) turns at theta^(-2i/axis) radians per position id: with 8 dims and 10,000 (diffusers'
    default, the shipped model's) at 1, 0.1, 0.01 and 0.001, so along a 256-px OCR image the fastest turn repeats
    every 6.3 patches, under every third 16-px glyph cell at 8×8 patches; 100 gives 1, 0.32, 0.1 and 0.03."""
    text_d_model: int = 128
    """Width of the text encoder (a small T5; its feed-forward is twice this)."""
    patch_size: int | None = None
    """Pixels per side of an image token; None: 4, the shipped model's (the OCR world at 8: 192 tokens instead of 768,
    about 4× cheaper a step, and a patch of 192 values needs at least 192 transformer channels, e.g. 6 heads × 32)."""
    shift: float | None = None
    """The model's timestep shift (σ = shift·t / (1 + (shift − 1)·t)), saved with it: where pretraining draws its
    noise levels (logit-normal t, shifted) and where its sampler puts its steps. None: 3, the shipped model's. A
    shift above 1 spends both on high noise, right for flat shapes; fine detail such as 1-2 px letter strokes is
    settled at low noise, which at 3 gets about 1.4% of the training draws below σ = 0.25 and the last of 10
    sampling steps jumps from σ = 0.25 to the image (at 1: 14%, from 0.1)."""
    prediction: Literal["velocity", "image"] | None = None
    """What the transformer learns to output: velocity (ε − x0, the shipped models') or image (the clean image,
    turned into the velocity for sampling and RL: pixel-space patches of many values, such as the OCR world's 8×8
    of 192, are easier to predict as the image than as noise; docs/ocr-world.md). None: velocity."""
    glyph_grid: bool = False
    """--world ocr: the glyph-grid layout (docs/ocr-world.md): each character of the quoted text drawn centred in a
    16-pixel cell of three rows, and the model conditioned on one token per cell at the cell's place in the image,
    so its attention starts out relating each patch to the character drawn over it."""
    # Sample grid after each checkpoint.
    sample_steps: int = 10
    """ODE steps of each sample in the checkpoints' sample grids."""
    sample_guidance_scale: float = 3.0
    """CFG scale of the checkpoints' sample grids (and of the shapes-edit scores in metrics.jsonl)."""
    sample_edits_per_kind: int = 6
    """--world shapes-edit: held-out edits of each kind in each checkpoint's grid (strictly verified; the scores
    go to metrics.jsonl)."""

    def check(self) -> None:
        """Values that would fail later or loop forever, refused naming the flag (--steps 0 trained without end,
        --checkpoint-every 0 divided by zero, --batch-size 0 and --lr -1 stopped in torch with messages naming
        neither flag)."""
        # deferred: the demo model's module imports torch; `diffrl pretrain --help` builds its parser without it
        from diffrl.models.demo import PREDICTIONS
        from diffrl.models.random_checkpoints.demo import WORLDS

        for name in ("steps", "batch_size", "checkpoint_every", "log_every", "sample_steps", "sample_edits_per_kind",
                     "num_attention_heads", "attention_head_dim", "num_single_layers", "text_d_model"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.shift is not None and self.shift <= 0:
            raise ValueError(f"--shift must be > 0, got {self.shift}")
        if self.prediction is not None and self.prediction not in PREDICTIONS:
            raise ValueError(f"--prediction must be one of {', '.join(PREDICTIONS)}, got {self.prediction}")
        if self.rope_theta <= 1:
            raise ValueError(f"--rope-theta must be > 1, got {self.rope_theta}")
        for name, lo, hi in (("lr", 0, None), ("weight_decay", 0, None), ("warmup_steps", 0, None), ("profile_steps", 0, None),
                             ("num_layers", 0, None), ("cfg_dropout", 0, 1), ("ema_decay", 0, 1)):
            value = getattr(self, name)
            if value < lo or (hi is not None and value > hi):
                bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
                raise ValueError(f"--{name.replace('_', '-')} must be {bounds}, got {value}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"--max-minutes must be > 0, got {self.max_minutes}")
        if self.world not in WORLDS:
            raise ValueError(f"--world {self.world}: known worlds are {', '.join(WORLDS)}")
        if self.patch_size is not None and (self.patch_size < 1 or 48 % self.patch_size or 64 % self.patch_size):
            raise ValueError(f"--patch-size must divide the image's sides (shapes 64, ocr 48x256), got {self.patch_size}")
        width = self.num_attention_heads * self.attention_head_dim
        if self.patch_size is not None and 3 * self.patch_size ** 2 > width:
            # The output layer maps each token's `width` channels to its patch's pixels: with fewer channels than
            # values it can reach only part of the noise it must predict (a --patch-size 8 run at width 128 on the
            # GPU plateaued at loss 0.44 and sampled noise).
            raise ValueError(f"--patch-size {self.patch_size}: a patch holds 3 x {self.patch_size}^2 = "
                             f"{3 * self.patch_size ** 2} pixel values, more than the transformer's {width} channels "
                             f"(--num-attention-heads x --attention-head-dim); widen it or lower --patch-size")
        if self.glyph_grid and self.world != "ocr":
            raise ValueError(f"--glyph-grid lays out the OCR world's quoted texts; --world {self.world} has none")
        if self.attention_head_dim % 4:
            raise ValueError(f"--attention-head-dim must be a multiple of 4 (its 4 RoPE axes share it), got "
                             f"{self.attention_head_dim}")

    def demo_config(self) -> DemoConfig:
        # deferred: the demo model's modules import torch; `diffrl pretrain --help` builds its parser without them
        from diffrl.models.demo import DemoConfig
        from diffrl.models.random_checkpoints.demo import ocr

        config = DemoConfig()
        config.transformer.update(
            num_attention_heads=self.num_attention_heads, attention_head_dim=self.attention_head_dim,
            num_layers=self.num_layers, num_single_layers=self.num_single_layers,
            axes_dims_rope=(self.attention_head_dim // 4,) * 4, rope_theta=self.rope_theta,
        )
        config.text_encoder.update(d_model=self.text_d_model, d_ff=2 * self.text_d_model)
        config = ocr(config) if self.world == "ocr" else config
        config.patch_size = self.patch_size or config.patch_size
        config.shift = config.shift if self.shift is None else self.shift
        config.glyph_grid = self.glyph_grid
        config.prediction = self.prediction or config.prediction
        return config
