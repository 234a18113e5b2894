"""FP8 matmuls for the transformer's repeated blocks (`--float8`).

Each `nn.Linear` inside a block that qualifies becomes a `Float8Linear`: its input is scaled per row (one token
of one sample) and its weight per output channel into e4m3, multiplied by `torch._scaled_mm` with fp32
accumulation, and returned in bf16. In training the input's gradient runs the same way (the gradient scaled per
row, the weight per input channel); the weight's own gradient, which only a full finetune needs, is computed in
bf16 from the unquantized operands, as the high-precision variant of the published FP8 recipes does. Why:
- rowwise scales, never one per tensor: a tensor's scale is the amax of the whole batch, so a sample's rounding
  would depend on its batchmates and sample k of a group would change with the microgroup size
  (docs/architecture.md, "Rollout contract").
  A row's scale depends on that row alone.
- inside the repeated blocks only: they hold nearly all of the FLOPs; the embedders, the final projection and
  the modulation (AdaLN) layers, which see one row per sample, keep the model's precision.
- sizes divisible by 16 only: what `_scaled_mm` needs of the inner and output dimensions.
- LoRA's low-rank factors stay as they are; the frozen base layer under them is converted.
- `Float8Linear` is an `nn.Linear` with the same `weight` and `bias`, so checkpoints, weight sync, FSDP2 and LoRA
  see the model they would without it; the FP8 copy of a weight is made per call, so updates need nothing.

Written over `torch._scaled_mm` rather than with torchao: importing torchao beside transformers prints warnings
in every process on a CPU build of torch, and the little used here needs none of its machinery.

It is a speed option like `--compile`: the engine and the trainer convert the same layers, so rollout and
training still run one forward and the first-pass ratio stays exact up to kernel rounding. What it changes is
the model's numerics against the bf16 forward, which `benchmarks/float8_drift.py` measures.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from diffrl.models.blocks import repeated_blocks

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
# Layer names never converted: LoRA's low-rank factors, and norms' modulation layers (one row per sample).
SKIPPED_NAME_PARTS = ("lora_", "norm")
MATMUL_MULTIPLE = 16


def quantize_rows(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` [R, K] as e4m3 values and one fp32 scale per row ([R, 1]): `t ≈ values · scale`."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / E4M3_MAX
    return (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def float8_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b.T` for `a` [M, K] and `b` [N, K], each scaled per row into e4m3; the product in bf16."""
    qa, sa = quantize_rows(a)
    qb, sb = quantize_rows(b)
    return torch._scaled_mm(qa, qb.t(), scale_a=sa, scale_b=sb.t(), out_dtype=torch.bfloat16)


class _Float8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x if weight.requires_grad else None, weight)
        ctx.input_dtype = x.dtype
        return float8_matmul(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = float8_matmul(grad_out, weight.t().contiguous()).to(ctx.input_dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (grad_out.to(torch.bfloat16).t() @ x.to(torch.bfloat16)).to(weight.dtype)
        return grad_x, grad_w


class Float8Linear(torch.nn.Linear):
    """An `nn.Linear` whose matmul runs in FP8 with rowwise scales (see the module's docstring). The result has
    the input's dtype, or the autocast dtype under autocast."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        with torch.autocast(x.device.type, enabled=False):
            rows = x.reshape(-1, self.in_features).to(dtype)
            out = _Float8Linear.apply(rows, self.weight).to(dtype)
            if self.bias is not None:
                out = out + self.bias.to(dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Float8Linear:
        """The same layer, converted in place: its parameters are kept (not copied)."""
        linear.__class__ = cls
        return linear


def check_float8_device(device: torch.device) -> None:
    """Refuse a GPU without FP8 tensor cores (compute capability below 8.9: Ada, Hopper and later have them);
    the CPU runs FP8 matmuls too, slowly, which is what the tests use."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"--float8: {torch.cuda.get_device_name(device)} (compute capability {major}.{minor}) "
                             "has no FP8 tensor cores; they need 8.9 or later")


def convertible(name: str, module: torch.nn.Module) -> bool:
    """Whether the layer at `name` (relative to its block) becomes a `Float8Linear`."""
    return (type(module) is torch.nn.Linear and not any(part in name for part in SKIPPED_NAME_PARTS)
            and module.in_features % MATMUL_MULTIPLE == 0 and module.out_features % MATMUL_MULTIPLE == 0)


def convert_blocks_to_float8(transformer: torch.nn.Module, block_lists: Sequence[str]) -> int:
    """Convert the qualifying linear layers of every block named by `block_lists` in place; returns how many.
    Apply after LoRA is added and before compilation and FSDP2, as `compile_blocks`."""
    count = 0
    for block in repeated_blocks(transformer, block_lists):
        for name, module in block.named_modules():
            if convertible(name, module):
                Float8Linear.from_linear(module)
                count += 1
    return count
