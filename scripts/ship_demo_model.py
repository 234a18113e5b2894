"""Copy a pretrained demo model (a checkpoint's `model/`) to where it ships, its weights stored in bf16: half the
bytes in the repository and on every device call's way (a call carries at most 64 MiB). Loading casts the weights
back to fp32; a shipped model's figures are measured on what ships.

    .venv/bin/python scripts/ship_demo_model.py model diffrl/assets/demo-ocr
"""

import argparse
from pathlib import Path

import torch

from diffrl.models.demo import DemoFamily

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("source", type=Path)
parser.add_argument("destination", type=Path)
parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
args = parser.parse_args()
if args.destination.exists():
    raise SystemExit(f"{args.destination} exists; remove it first")
family = DemoFamily.load(args.source, batch_invariant=False)
family.save(args.destination, weights_dtype=getattr(torch, args.dtype))
size = sum(f.stat().st_size for f in args.destination.rglob("*") if f.is_file())
print(f"{args.destination}: {size / 2**20:.1f} MiB, weights in {args.dtype}")
