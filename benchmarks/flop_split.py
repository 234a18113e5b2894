"""How a real-size transformer's forward FLOPs split between its linear layers and attention, counted by torch's
FlopCounterMode on meta tensors (no weights are made, so it runs on any CPU in seconds).

    python benchmarks/flop_split.py --family sd3 --resolution 512
    python benchmarks/flop_split.py --family flux3_image --resolution 1024

Set beside a profile's GPU time per kernel category (benchmarks/profile_training.py), the split says how fast each
kind of kernel runs against the peak (BENCHMARKS.md, "Where the compiled loop's time goes"). One sample, the
family's real size (`diffrl.models.random_checkpoints.<family>.real()`).
"""

from __future__ import annotations

import argparse

import torch
from report import emit
from torch.utils.flop_counter import FlopCounterMode


def sd3_forward(resolution: int):
    """SD3.5-Medium's transformer and one sample's inputs: 16 latent channels at 1/8 of the image, 333 text
    tokens (77 CLIP + 256 T5) of width 4096, pooled text of width 2048."""
    from diffusers import SD3Transformer2DModel

    from diffrl.models.random_checkpoints.sd3 import real

    with torch.device("meta"):
        model = SD3Transformer2DModel(**real().transformer).to(torch.bfloat16)
        side = resolution // 8
        inputs = dict(hidden_states=torch.empty(1, 16, side, side, dtype=torch.bfloat16),
                      encoder_hidden_states=torch.empty(1, 333, 4096, dtype=torch.bfloat16),
                      pooled_projections=torch.empty(1, 2048, dtype=torch.bfloat16), timestep=torch.ones(1))
    return model, inputs


def flux3_image_forward(resolution: int):
    """FLUX 3 Klein's transformer at the class defaults (the family's real size) and one sample's inputs: 2×2
    patches of the 1/8-size latent, and one 80-token text window (the family pads text to multiples of 80)."""
    from diffusers import Flux3Transformer2DModel

    from diffrl.models.random_checkpoints.flux3_image import real

    with torch.device("meta"):
        model = Flux3Transformer2DModel(**real().transformer).to(torch.bfloat16)
        tokens, text = (resolution // 16) ** 2, 80
        inputs = dict(hidden_states=torch.empty(1, tokens, model.config.in_channels, dtype=torch.bfloat16),
                      encoder_hidden_states=torch.empty(1, text, model.config.joint_attention_dim, dtype=torch.bfloat16),
                      timestep=torch.ones(1), img_ids=torch.zeros(tokens, 4), txt_ids=torch.zeros(text, 4))
    return model, inputs


FORWARDS = {"sd3": sd3_forward, "flux3_image": flux3_image_forward}
# Linear layers count as addmm/mm; attention on meta tensors runs as batched matmuls (bmm) or as SDPA's own op.
KINDS = {"linear": ("addmm", "mm", "linear"), "attention": ("bmm", "scaled_dot_product", "attention")}


def split(family: str, resolution: int) -> dict:
    model, inputs = FORWARDS[family](resolution)
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(**inputs)
    total = counter.get_total_flops()
    by_op = {str(op).removeprefix("aten."): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    kinds = {kind: sum(f for op, f in by_op.items() if op.split(".")[0] in names) for kind, names in KINDS.items()}
    kinds["other"] = total - sum(kinds.values())
    return {"family": family, "resolution": resolution, "gflop_per_forward": total / 1e9,
            "gflop_by_op": {op: f / 1e9 for op, f in by_op.items()},
            "share": {kind: f / total for kind, f in kinds.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--family", choices=sorted(FORWARDS), default="sd3")
    parser.add_argument("--resolution", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    results = split(args.family, args.resolution)
    emit(results, args.out)
    return results


if __name__ == "__main__":
    main()
