"""`diffrl bench`: what a rollout costs on this machine for a checkpoint, before a run is launched.

For one model (any family) at the settings given, measured in `--dtype` weights:
- the transformer alone: ms per sample of one denoising step (both CFG halves when CFG is on) at batch
  1 and batch n, GFLOP counted by torch's FlopCounterMode, MFU against `--peak-tflops` (GPU);
- the VAE decode: ms per image one image per call and through the family's `decode`;
- the engine: one group of n samples as a Flow-GRPO rollout request (SDE with log-probs on two steps,
  trajectories and conditioning returned) in microgroups of M, in-process: seconds per image, and the
  share of it the batch-n transformer alone would take (the rest is the engine's and the decode's);
- for families whose `reference_pipeline()` is diffusers' own pipeline on the same components (not None):
  that pipeline at 1 and n images per call (ODE, images only), as the baseline in the same run, and the
  engine on the same work (the group as one plain ODE request returning images only). A pipeline that makes
  one sample a call (Cosmos3's) makes the n as n calls of one, and the bench says so; so it does for a family
  whose transformer forward takes one sample (Cosmos3's), whose batch n is n forwards of one.
`benchmarks/family_rollout.py` runs this on random weights of a family's real size.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict

import torch

from diffrl.cli.configs import BenchConfig
from diffrl.engine.spec import EngineSpec, build_engine
from diffrl.models import resolve_family
from diffrl.models.compile import uncompiled_block_kinds
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.models.lora import LoraSpec, add_lora, lora_unfolded
from diffrl.models.speed import SpeedOptions
from diffrl.rollout import InProcessEngineClient, RolloutManager, RolloutSettings
from diffrl.sampling import make_generators
from diffrl.utils.device import resolve_device
from diffrl.utils.flops import flop_counter
from diffrl.utils.size import sample_size

PROMPT = "a blue square to the left of a yellow circle"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms_per_call(run, device: torch.device, reps: int) -> float:
    """ms per call of `run` over `reps` calls, after one warm-up call."""
    run()
    _sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        run()
    _sync(device)
    return 1000 * (time.perf_counter() - start) / reps


def _frames(family, num_frames: int | None) -> dict:
    """The `num_frames` keyword of a video family's calls; nothing for an image family."""
    return {"num_frames": num_frames} if family.generates_video else {}


def _step_inputs(family, batch: int, size: tuple[int, int], guidance: float, num_frames: int | None = None):
    device = family.device
    latents = family.prepare_latents(make_generators(range(batch), device=device), *size,
                                     **_frames(family, num_frames))
    with family.text_encoders_on_device():  # an offloaded encoder (--offload-text-encoder) visits for the encode
        cond = family.encode_prompts([PROMPT]).repeat(batch)
        uncond = family.encode_prompts([""]).repeat(batch) if guidance > 1 else None
    return latents, torch.full((batch,), 0.5, device=device), cond, uncond


@torch.no_grad()
def transformer_gflop(family, batch: int, size: tuple[int, int], guidance: float, num_frames: int | None = None) -> float:
    """GFLOP per sample of one denoising step's transformer work (cond + uncond when CFG is on), counted
    eagerly (before any compilation: the counter does not see inside compiled graphs)."""
    latents, sigma, cond, uncond = _step_inputs(family, batch, size, guidance, num_frames)
    with flop_counter() as counter, lora_unfolded(family.transformer):
        family.velocity(family.transformer, latents, sigma, cond, uncond, guidance)
    return counter.get_total_flops() / batch / 1e9


@torch.no_grad()
def transformer_step_ms(family, batch: int, size: tuple[int, int], guidance: float, reps: int,
                        num_frames: int | None = None) -> float:
    """ms per sample of one denoising step's transformer work, after two warm-up calls."""
    latents, sigma, cond, uncond = _step_inputs(family, batch, size, guidance, num_frames)

    def run():
        return family.velocity(family.transformer, latents, sigma, cond, uncond, guidance)

    run()  # two warm-up calls: the first may compile
    return _ms_per_call(run, family.device, reps) / batch


@torch.no_grad()
def decode_ms_per_image(family, batch: int, size: tuple[int, int], reps: int, num_frames: int | None = None) -> dict[str, float]:
    """ms per image (or video) of the VAE decode: one per call (what the engine does on CPU) and the
    family's own `decode` (in chunks on a GPU)."""
    frames = _frames(family, num_frames)
    latents = family.prepare_latents(make_generators(range(batch), device=family.device), *size, **frames).tokens
    ways = {"one_per_call": lambda: torch.cat([family.decode(row[None], *size, **frames) for row in latents]),
            "family_decode": lambda: family.decode(latents, *size, **frames)}
    return {name: _ms_per_call(run, family.device, reps) / batch for name, run in ways.items()}


async def time_group(client, n: int, m: int, request: dict, repeats: int, prompt: str = PROMPT):
    """Seconds for one group of n samples in microgroups of m (median of `repeats`, after a warm-up),
    and the group's outputs (to measure how much the batch size changes sample k)."""
    settings = RolloutSettings(n_samples_per_prompt=n, rollout_microgroup_size=m)
    manager = RolloutManager([client], settings, engine_concurrency=n)
    await manager.rollout([prompt], request)  # warm-up: kernels (and compiled graphs) for this batch size
    times = []
    for _ in range(repeats):
        group = (await manager.rollout([prompt], request))[0]
        times.append(manager.last_stats.seconds)
    return sorted(times)[len(times) // 2], torch.stack([s.output.generated_output for s in group])


def pipeline_count_argument(pipe) -> str | None:
    """The keyword by which a diffusers pipeline makes several samples a call, or None for a pipeline that makes
    one a call (Cosmos3's)."""
    import inspect

    accepted = inspect.signature(pipe.__call__).parameters
    return next((k for k in ("num_videos_per_prompt", "num_images_per_prompt") if k in accepted), None)


def pipeline_label(name: str, batch: int, count: str | None, unit: str) -> str:
    """How the bench names a pipeline timing: `batch` samples in one call, or `batch` calls of one sample."""
    if count is None:
        return f"{name}, {batch:>2} call{'s' if batch > 1 else ''} of one {unit}"
    return f"{name}, {batch:>2} {unit}{'s' if batch > 1 else ''} per call"


@torch.no_grad()
def pipeline_s_per_image(pipe, device, batch: int, size: tuple[int, int], steps: int, guidance: float, repeats: int,
                         num_frames: int | None = None, inputs: dict | None = None) -> float:
    """Seconds per image (or video) of a diffusers pipeline making `batch` per call (median of `repeats`), or of
    `batch` calls of one for a pipeline that makes one a call (Cosmos3's); `inputs`: the family's
    `reference_pipeline_kwargs()`."""
    import inspect

    from diffusers.modular_pipelines import ModularPipeline

    generator = torch.Generator(device).manual_seed(0)
    accepted = inspect.signature(pipe.__call__).parameters
    count = pipeline_count_argument(pipe)
    extra = {**(inputs or {}), **({"num_frames": num_frames} if num_frames is not None else {})}
    # The CFG scale in the pipeline's own terms: a modular pipeline's guider (FLUX 3); Qwen-Image's
    # `true_cfg_scale`, on only with a negative prompt (its `guidance_scale` is the guidance-distilled
    # variant's); else `guidance_scale`.
    if isinstance(pipe, ModularPipeline):
        pipe.update_components(guider=pipe.guider.new(guidance_scale=guidance, enabled=guidance > 1))
    elif "true_cfg_scale" in accepted:
        extra.update(true_cfg_scale=guidance, negative_prompt="" if guidance > 1 else None)
    else:
        extra["guidance_scale"] = guidance

    def run():
        for _ in range(1 if count else batch):
            pipe(prompt=PROMPT, num_inference_steps=steps, height=size[0], width=size[1], generator=generator,
                 output_type="pt", **({count: batch} if count else {}), **extra)

    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] / batch


def bench(cfg: BenchConfig) -> dict:
    if cfg.dtype not in ("float32", "bfloat16"):
        raise ValueError(f"--dtype must be float32 or bfloat16, got {cfg.dtype!r}")
    if cfg.lora_rank < 0:
        raise ValueError(f"--lora-rank must be >= 0, got {cfg.lora_rank}")
    if cfg.fold_lora and not cfg.lora_rank:
        raise ValueError("--fold-lora folds an adapter: pass --lora-rank N too")
    if cfg.n < 1 or not cfg.ms or any(not 1 <= m <= cfg.n for m in cfg.ms) or cfg.repeats < 1:
        raise ValueError(f"--ms must lie in 1..--n ({cfg.n}) and --repeats be >= 1; got --ms {list(cfg.ms)}, "
                         f"--repeats {cfg.repeats}")
    speed = SpeedOptions(attention_backend=cfg.attention_backend, fuse_qkv=cfg.fuse_qkv,
                         vae_decode_batch=cfg.vae_decode_batch, float8=cfg.float8, compile=cfg.compile, compile_mode=cfg.compile_mode,
                         compile_eager_numerics=cfg.eager_numerics)
    speed.check()
    device = resolve_device(cfg.device)
    model_path = cfg.model_path or SHIPPED_DEMO_MODEL
    family = resolve_family(cfg.diffusion_model_family, model_path).load(
        model_path, device=device, dtype=getattr(torch, cfg.dtype))
    if cfg.lora_rank:  # before the speed options, as the policy adds it (FP8 and compilation see the adapter)
        add_lora(family.transformer, LoraSpec(rank=cfg.lora_rank, alpha=2.0 * cfg.lora_rank,
                                              target_modules=list(family.lora_target_modules),
                                              fold_without_grad=cfg.fold_lora))
    if cfg.autocast:
        family.autocast_dtype = torch.bfloat16
    speed.apply(family)  # the engine's and the pipeline's transformer alike (the pipeline skips the SDPA choice)
    size = sample_size(cfg.resolution, cfg.height, cfg.width) or family.default_size()
    if cfg.num_frames is not None and not family.generates_video:
        raise ValueError(f"--num-frames {cfg.num_frames}: the {family.name} family generates images, not video")
    frames = family.default_num_frames if family.generates_video and cfg.num_frames is None else cfg.num_frames
    family.check_size(*size, **_frames(family, frames))
    guidance = family.default_guidance_scale if cfg.guidance_scale is None else cfg.guidance_scale
    on_gpu = device.type == "cuda"
    unit = "video" if family.generates_video else "image"
    one_per_forward = family.one_sample_per_forward
    results = {"family": family.name, "model_path": str(model_path),
               "device": torch.cuda.get_device_name(device) if on_gpu else "cpu", "dtype": cfg.dtype,
               "transformer_params": sum(p.numel() for p in family.transformer.parameters()),
               "resolution": size[0] if size[0] == size[1] else None, "height": size[0], "width": size[1],
               "num_frames": frames if family.generates_video else None, "n": cfg.n, "steps": cfg.steps,
               "guidance_scale": guidance, "compile": cfg.compile,
               "eager_numerics": cfg.compile and cfg.eager_numerics,
               "compile_mode": cfg.compile_mode if cfg.compile else None, "attention_backend": cfg.attention_backend,
               "fuse_qkv": cfg.fuse_qkv, "vae_decode_batch": cfg.vae_decode_batch, "float8": cfg.float8,
               "lora_rank": cfg.lora_rank, "fold_lora": cfg.fold_lora, "autocast": cfg.autocast,
               "transformer_one_sample_per_forward": one_per_forward, "transformer": {}, "engine": {}}
    reps = 5 if on_gpu else 1
    batches = sorted({1, cfg.n})
    gflops = {batch: transformer_gflop(family, batch, size, guidance, frames) for batch in batches}
    if cfg.compile:
        start = time.perf_counter()
        speed.compile_family(family)
        transformer_step_ms(family, cfg.n, size, guidance, 1, frames)
        results["compile_s"] = time.perf_counter() - start
        print(f"compiled the blocks and ran batch {cfg.n}: {results['compile_s']:.0f} s", flush=True)

        results["uncompiled_block_kinds"] = uncompiled_block_kinds(family)
        if results["uncompiled_block_kinds"]:
            print(f"warning: --compile: {', '.join(results['uncompiled_block_kinds'])} ran eager (torch.compile "
                  "skipped them): the figures below are eager", flush=True)
    for batch in batches:
        ms, gflop = transformer_step_ms(family, batch, size, guidance, reps, frames), gflops[batch]
        results["transformer"][batch] = {"ms_per_sample_step": ms, "gflop_per_sample_step": gflop,
                                         "mfu": gflop / ms / cfg.peak_tflops if on_gpu else None}
        # A family whose forward takes one sample runs a batch as that many forwards, one after another.
        how = f" ({batch} forwards of one sample)" if one_per_forward and batch > 1 else ""
        print(f"transformer batch {batch:>2}{how}: {ms:8.2f} ms per sample-step, {gflop:,.0f} GFLOP", flush=True)
    results["decode_ms_per_image"] = decode_ms_per_image(family, cfg.n, size, 2 if on_gpu else 1, frames)
    print(f"VAE decode, ms per {unit}: " + ", ".join(f"{k} {v:.1f}" for k, v in results["decode_ms_per_image"].items()),
          flush=True)
    floor_ms = results["transformer"][cfg.n]["ms_per_sample_step"] * cfg.steps
    # The engine around the model loaded and set up above (LoRA first, then the speed options, as the policy does).
    spec = EngineSpec(model_path=str(model_path), family=family.name, device=str(device), dtype=cfg.dtype,
                      autocast_dtype="bfloat16" if cfg.autocast else None, **asdict(speed),
                      max_outputs_per_request=cfg.n, max_batch_outputs=cfg.n)
    engine = build_engine(spec, family=family)
    request = dict(num_inference_steps=cfg.steps, guidance_scale=guidance, rollout=True, rollout_sde_type="sde",
                   rollout_noise_level=0.7, rollout_sde_step_indices=[1, 2] if cfg.steps > 2 else [0],
                   rollout_return_dit_trajectory=True, rollout_return_denoising_env=True, height=size[0], width=size[1],
                   **_frames(family, frames))
    client = InProcessEngineClient(engine)
    for m in cfg.ms:
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(device)
        seconds, _ = asyncio.run(time_group(client, cfg.n, m, request, cfg.repeats))
        per_image = seconds / cfg.n
        results["engine"][m] = {"s_per_image": per_image, "images_per_s": 1 / per_image,
                                "transformer_share": floor_ms / 1000 / per_image,
                                "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if on_gpu else None}
        print(f"engine M={m:<2}: {per_image:.3f} s per {unit} ({1 / per_image:.2f} {unit}s/s; the batch-{cfg.n} "
              f"transformer alone: {floor_ms / 1000:.3f} s)", flush=True)
    pipe = family.reference_pipeline() if cfg.reference_pipeline else None
    if pipe is not None:
        # Like for like with the pipeline, which makes images only: the same group as one plain ODE request
        # (no SDE step, log-probs, trajectory or conditioning returned), one batch of n.
        plain = {k: v for k, v in request.items() if not k.startswith("rollout")}
        seconds, _ = asyncio.run(time_group(client, cfg.n, cfg.n, plain, cfg.repeats))
        results["engine_plain"] = {"s_per_image": seconds / cfg.n, "images_per_s": cfg.n / seconds}
        print(f"engine, one plain ODE request of {cfg.n} ({unit}s only, as the pipeline): {seconds / cfg.n:.3f} s "
              f"per {unit}", flush=True)
        name = type(pipe).__name__
        count = pipeline_count_argument(pipe)
        results["pipeline"] = {"class": name}
        for batch in batches:
            per_image = pipeline_s_per_image(pipe, device, batch, size, cfg.steps,
                                             family.reference_guidance_scale(guidance), cfg.repeats,
                                             frames if family.generates_video else None,
                                             family.reference_pipeline_kwargs())
            results["pipeline"][batch] = {"s_per_image": per_image, "samples_per_call": batch if count else 1,
                                          "calls": 1 if count else batch}
            print(f"{pipeline_label(name, batch, count, unit)}: {per_image:.3f} s per {unit}", flush=True)
        best_engine = min(r["s_per_image"] for r in results["engine"].values())
        for batch in batches:
            results[f"pipeline_batch{batch}_over_engine"] = results["pipeline"][batch]["s_per_image"] / best_engine
        results["pipeline_over_engine_plain"] = (results["pipeline"][cfg.n]["s_per_image"]
                                                 / results["engine_plain"]["s_per_image"])
    if cfg.out:
        cfg.out.write_text(json.dumps(results, indent=2) + "\n")
    return results
