"""Rollout cost of a real-size model family on random weights: our engine against the transformer alone
and against diffusers' own pipeline on the same weights in the same run.

    python benchmarks/family_rollout.py --family sd3 --checkpoint /tmp/sd35m --resolution 512 --guidance-scale 4.5
    python benchmarks/family_rollout.py --family flux3_image --checkpoint /tmp/flux3 --resolution 1024 --guidance-scale 1

A missing `--checkpoint` folder is first filled with random weights at the family's real size, built in
code (no download; `REAL_SIZES` below: SD3.5-Medium, FLUX 3 Klein's class defaults, FLUX.2 [klein] 4B, Krea-2,
Qwen-Image, Wan2.2 A14B, LTX-2.3, Cosmos3, Z-Image, Lumina-Image 2.0, SANA 1600M, CogView4-6B), with shallow text
encoders where the family's builder makes them (a prompt is encoded once per request). Video families take
`--num-frames` and `--height/--width`.

What it measures is `diffrl bench` (`diffrl/cli/bench.py` says what; the baseline is diffusers' own
pipeline on the same weights, in the same run, for families with a `reference_pipeline()`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from report import emit

from diffrl.cli.bench import BenchConfig, bench


@dataclass
class RealSize:
    real: dict  # keywords of the family's `diffrl.models.random_checkpoints` module's real()
    save: dict  # keywords of its save_random_checkpoint
    disk_gb: float | None = None  # what it writes in bf16 (checked against the free space before building)


REAL_SIZES = {
    "sd3": RealSize({}, {"with_t5": False}),  # SD3.5-Medium, 2.24 B
    "flux3_image": RealSize({}, {}),  # 5.54 B
    "flux1": RealSize({}, {}, 26),  # FLUX.1 [dev]: the 11.9 B transformer, shallow CLIP-L and T5-XXL, the VAE
    # FLUX.2 [klein] 4B: the 3.88 B transformer, a 3-layer Qwen3 of Qwen3-4B's width, the VAE (real("klein-9b"): 9.08 B;
    # real("dev"): 32.2 B)
    "flux2": RealSize({"model": "klein-4b"}, {}, 9),
    "krea2": RealSize({}, {}, 26),  # 12.8 B
    "qwen_image": RealSize({}, {}, 41),  # 20.4 B
    # Qwen-Image 2.1: the class defaults' 7.12 B transformer, a 2-layer Qwen3-VL of its 4,096 text width, the 0.34 B VAE.
    "qwen_image21": RealSize({}, {}, 17),
    # Wan2.2 A14B: two 14.3 B experts, the second a link to the first's files (58 GB would be written otherwise),
    # UMT5-XXL's width in 2 layers (0.39 B), the VAE (0.13 B).
    "wan2_2": RealSize({}, {"shared_experts": True}, 30),
    # LTX-2.3: the 19.0 B transformer, its 2.1 B connectors, a 2-layer Gemma 3 of Gemma-3-12B's width (0.45 B), the
    # video and audio VAEs and the vocoder (0.84 B): 22.4 B.
    "ltx2": RealSize({"text_layers": 2}, {}, 45),
    "cosmos3": RealSize({}, {}, 32),  # Cosmos3OmniTransformer's defaults (15.2 B) and a 48-channel Wan VAE (0.70 B)
    "z_image": RealSize({}, {}, 14),  # the 6.15 B transformer, a 2-layer text encoder of Qwen3-4B's width, the VAE
    "cogview4": RealSize({}, {}, 14),  # the 6.37 B transformer, a 2-layer GLM of GLM-4-9B's width (0.41 B), the VAE
    # Lumina-Image 2.0: the 2.61 B transformer, a 2-layer Gemma2 of Gemma-2-2B's width (0.16 B), the VAE (0.08 B).
    "lumina2": RealSize({}, {}, 6),
    # SANA 1600M: the 1.60 B transformer, a 2-layer Gemma2 of Gemma-2-2B's width (0.16 B), the f32c32 DC-AE (0.31 B),
    # the published DPM-Solver flow scheduler.
    "sana": RealSize({}, {"scheduler": "dpm"}, 5),
}


# Each family's transformer keywords that count its blocks (one per kind of block), for a shallow checkpoint.
DEPTH_KEYS = {
    "sd3": ("num_layers",), "flux3_image": ("num_layers", "num_single_layers"),
    "flux1": ("num_layers", "num_single_layers"), "flux2": ("num_layers", "num_single_layers"),
    "krea2": ("num_layers",), "qwen_image": ("num_layers",), "qwen_image21": ("num_layers",), "wan2_2": ("num_layers",),
    "ltx2": ("num_layers",), "cosmos3": ("num_hidden_layers",), "z_image": ("n_layers",),
}


def shallow(sizes, family: str, depth: int):
    """`sizes` (a random_checkpoints module's sizes, real widths) with `depth` blocks of each kind: every block and
    every shape a block sees stays the real model's, so the compiled graphs are the real model's graphs (what a
    first-pass exactness check needs) at a fraction of the time to build, load and run."""
    if family not in DEPTH_KEYS:
        raise SystemExit(f"--depth: no block counts known for {family} (DEPTH_KEYS)")
    return dataclasses.replace(sizes, transformer={**sizes.transformer, **dict.fromkeys(DEPTH_KEYS[family], depth)})


def real_block_counts(sizes, family: str, folder: Path) -> dict[str, int]:
    """The real model's block counts (`DEPTH_KEYS`) for the transformer saved in `folder`: the sizes' own, else its
    class's defaults (a `real()` that leaves a count to the class)."""
    import inspect

    import diffusers

    cls = getattr(diffusers, json.loads((folder / "config.json").read_text())["_class_name"])
    defaults = inspect.signature(cls.__init__).parameters
    return {key: sizes.transformer.get(key, defaults[key].default) for key in DEPTH_KEYS[family]}


def save_weightless(module, family: str, sizes, path: Path, **keywords) -> None:
    """`module.save_random_checkpoint(path, sizes, **keywords)` with the transformer's weights drawn at load: built and
    saved with one block of each kind, then its config given `sizes`' block counts back and its weights removed
    (`make_weightless`)."""
    from diffrl.models.random_checkpoints import make_weightless

    module.save_random_checkpoint(path, shallow(sizes, family, 1), **keywords)
    for folder in ("transformer", "transformer_2"):  # a linked expert shares the first's folder
        if (path / folder / "config.json").is_file() and not (path / folder).is_symlink():
            make_weightless(path / folder, real_block_counts(sizes, family, path / folder))


def make_checkpoint(family: str, path: Path, device: torch.device, tiny: bool = False,
                    size: RealSize | None = None, depth: int | None = None, weightless: bool = False) -> None:
    """A random checkpoint at the family's real size in bf16, built on `device` (the GPU: a minute, not the CPU's
    many); `tiny`: the module's `tiny()` sizes in fp32 instead (CPU tests of the benchmark scripts). `size`: in
    place of `REAL_SIZES[family]` (another variant of the family: an image-conditioned one). `depth`: real widths
    with that many blocks of each kind (`shallow`). `weightless`: the transformer's weights are drawn when the
    checkpoint loads instead of stored (`random_checkpoints.make_weightless`: its default initialization, where a
    stored one may have had some tables redrawn), so that it costs no disk: for cost measurements of models whose
    checkpoint would not fit the disk, never for exactness checks."""
    import gc
    import importlib
    import shutil

    if family not in REAL_SIZES:
        raise SystemExit(f"--family {family}: this benchmark makes random checkpoints for {', '.join(REAL_SIZES)}")
    size = size or REAL_SIZES[family]
    module = importlib.import_module(f"diffrl.models.random_checkpoints.{family}")
    start = time.perf_counter()
    # Written beside, then renamed: a run stopped while writing leaves no checkpoint that looks whole.
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    if weightless and depth is not None:
        raise SystemExit("a weightless checkpoint is the model at its full depth (not --depth)")
    if tiny:
        sizes, keywords = module.tiny(), dict(size.save)
    else:
        free = shutil.disk_usage(path.parent).free / 1e9
        stored = depth is None and not weightless  # shallow or weightless: a few GB
        if size.disk_gb is not None and stored and free < size.disk_gb + 2:
            raise SystemExit(f"a random {family} checkpoint needs about {size.disk_gb:.0f} GB; {free:.0f} GB are free "
                             f"under {path.parent} (--weightless keeps the transformer off the disk)")
        sizes = module.real(**size.real)
        if depth is not None:
            sizes = shallow(sizes, family, depth)
        keywords = dict(size.save, device=device, dtype=torch.bfloat16)
    if weightless:
        save_weightless(module, family, sizes, partial, **keywords)
    else:
        module.save_random_checkpoint(partial, sizes, **keywords)
    partial.rename(path)
    gc.collect()  # the built modules, off the device before the run loads the checkpoint
    if device.type == "cuda":
        torch.cuda.empty_cache()
    print(f"wrote a random {family} checkpoint to {path} in {time.perf_counter() - start:.0f} s", flush=True)


def add_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The family, its checkpoint (random real-size weights when missing: `make_checkpoint`), where and in which
    dtype it runs, and its square size: the arguments of every benchmark of one family's engine."""
    parser.add_argument("--family", choices=sorted(REAL_SIZES), required=True)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--resolution", type=int, default=None, help="default: the family's")


def main() -> None:
    parser = argparse.ArgumentParser()
    add_checkpoint_arguments(parser)
    parser.add_argument("--height", type=int, default=None, help="with --width, instead of --resolution")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num-frames", type=int, default=None, help="video families (default: the family's)")
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--ms", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--guidance-scale", type=float, default=None, help="default: the family's")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="dense bf16 peak (H200: 790)")
    parser.add_argument("--compile", action="store_true", help="regional torch.compile of the family's blocks")
    parser.add_argument("--eager-numerics", action="store_true",
                        help="with --compile: inductor's emulate_precision_casts (the trainer's default)")
    parser.add_argument("--compile-mode", default="default",
                        choices=["default", "max-autotune-no-cudagraphs"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "flash", "cudnn", "efficient", "math"])
    parser.add_argument("--fuse-qkv", action="store_true", help="SD3: q/k/v projections as one matmul per stream")
    parser.add_argument("--vae-decode-batch", type=int, default=None, help="images per VAE decode call; 0: all")
    parser.add_argument("--float8", action="store_true", help="the blocks' linear layers as FP8 matmuls")
    parser.add_argument("--no-pipeline", action="store_true", help="skip diffusers' pipeline (the baseline)")
    parser.add_argument("--lora-rank", type=int, default=0, help="an adapter of this rank, as a LoRA run holds the model")
    parser.add_argument("--fold-lora", action="store_true", help="with --lora-rank: folded in no-grad forwards (NFT)")
    parser.add_argument("--autocast", action="store_true", help="bf16 autocast, as the training loop's forwards")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if not args.checkpoint.exists():
        make_checkpoint(args.family, args.checkpoint, torch.device(args.device))
    results = bench(BenchConfig(
        model_path=args.checkpoint, diffusion_model_family=args.family, device=args.device, dtype=args.dtype,
        resolution=args.resolution, height=args.height, width=args.width, num_frames=args.num_frames, n=args.n,
        ms=tuple(args.ms), steps=args.steps, guidance_scale=args.guidance_scale, repeats=args.repeats, peak_tflops=args.peak_tflops, compile=args.compile, eager_numerics=args.eager_numerics,
        compile_mode=args.compile_mode, attention_backend=args.attention_backend, fuse_qkv=args.fuse_qkv,
        vae_decode_batch=args.vae_decode_batch, float8=args.float8, reference_pipeline=not args.no_pipeline,
        lora_rank=args.lora_rank, fold_lora=args.fold_lora, autocast=args.autocast))
    emit(results, args.out)


if __name__ == "__main__":
    main()
