"""Where a training step's time goes: one `rollout_and_update` of `diffrl train --recipe NAME`, after a
warm-up step, under torch.profiler (CPU and CUDA activities, no shapes or stacks).

    python benchmarks/profile_training.py --checkpoint runs/sd35m-random --recipe sd3-grpo \
        --reward jpeg_compressibility --reward-workers 6 --rollout-batch-size 2 [--compile] \
        --out profile.json --trace-dir traces/

The trainer is built from the flags `diffrl train` would parse: the recipe, `--model-path CHECKPOINT`, then
every flag not listed in `--help` (e.g. `--reward-workers 6`, `--micro-batch-size 4`). A missing
`--checkpoint` is filled with the family's real-size random weights (`family_rollout.REAL_SIZES`).
`--rollout-batch-size` cuts the prompt groups per rollout; the optimizer steps keep their count.

The step's pieces are wrapped from outside (diffrl's code is not changed) in `record_function` ranges named
`phase:NAME`. Rollout: weight sync (entering and leaving `policy.engine_weights`), the rollout manager's
coroutine, and inside it each engine batch with its prompt encoding, denoising loop (and the transformer
forwards in it) and decode, and each reward call (awaited: it may score in worker processes). Training:
conditioning, pairs, the loss's forward (and its transformer forwards), backward, optimizer step,
zero_grad, after_update. For the rollout, the training and the whole step the report gives:

- wall: the trainer's own `rollout/seconds` and `train/seconds`, and the window the profile saw;
- GPU busy (the union of kernel, memcpy and memset intervals: overlap counts once) and the idle share of
  the window: much idle GPU time with the host busy means launch- or host-bound;
- GPU time by kernel category (attention, convolution, GEMM, norms, elementwise & reductions, copies,
  other) and the top kernels with their call counts;
- host syncs (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize, cudaMemcpy* that copy
  device to host: an `.item()` is one copy and one stream sync) with their host time, and kernel launches
  (runtime and driver API; CUDA graph launches apart);
- per phase: calls; host seconds (the union of its ranges, on whichever thread); exclusive seconds, the
  part no phase listed before it covers (nested phases come first, so "denoise" is the loop outside the
  transformer and "rollout manager" the waiting outside engine batches and rewards); GPU seconds of the
  kernels and copies launched inside it (matched to their launch by CUPTI correlation, on the launching
  thread); its launches; the host time of its syncs. Exclusive times sum to at most the window; what is
  left is "untracked" (e.g. asyncio.run starting and ending).

A phase's host time is when the host ran it: on a GPU the host may run ahead, so a phase can end before
its kernels do (their time is its "gpu_s") and the wait lands in the phase that syncs. The engine denoises
on a thread of its own, so every thread is recorded (torch >= 2.7). Profiling costs the host about a
microsecond per op: set the profiled wall beside an unprofiled run's.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import functools
import gzip
import inspect
import json
import os
import shutil
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import torch
from family_rollout import make_checkpoint
from report import emit
from torch.profiler import ProfilerActivity, profile, record_function

PREFIX = "phase:"
# Priority order for the exclusive split of each window (nested phases first, then what contains them).
PHASES = {
    "rollout": ["encode", "transformer", "denoise", "decode", "engine batch", "weight sync", "reward",
                "rollout manager"],
    "train": ["conditioning", "pairs", "transformer", "forward", "backward", "optimizer step", "zero grad",
              "after update"],
}
# CUPTI's activity buffers are capped at 128 MiB by default; an eager training step's kernel and runtime
# records overflow that, and kineto then drops the rest of the step. The cap is raised through the file
# named by KINETO_CONFIG, which kineto reads when a trace is prepared.
KINETO_BUFFER_MB = 4096
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Attention before GEMM and convolution: cuDNN's and CUTLASS's attention kernels carry "sm90"/"cutlass"/"fprop".
CATEGORIES = [
    ("attention", ("flash", "fmha", "sdpa", "attention", "attn")),
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "winograd", "nchw", "nhwc")),
    ("GEMM", ("gemm", "cutlass", "sm90", "xmma", "cublas", "nvjet", "triton_tem", "gemv", "splitk")),
    ("norms", ("norm", "rms")),
    ("elementwise & reductions", ("elementwise", "vectorized", "reduce", "triton_poi", "triton_red", "triton_per",
                                  "multi_tensor", "copy", "cat", "fill", "index")),
]


# ------------------------------------------------------------------ the phase ranges
def _timed(name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        with record_function(PREFIX + name):
            return fn(*args, **kwargs)
    return timed


def _timed_async(name: str, fn):
    """For what the rollout manager awaits (its rollout, the reward): the range spans the awaiting too."""
    async def timed(*args, **kwargs):
        with record_function(PREFIX + name):
            out = fn(*args, **kwargs)
            if inspect.isawaitable(out):
                out = await out
        return out
    return timed


def _timed_engine_weights(fn):
    """The trainer's rollout is the block inside `policy.engine_weights`: the range "rollout" is that
    window, and entering and leaving it (EMA swap, pushes to other engines) is the weight sync."""
    @contextlib.contextmanager
    def engine_weights(ema):
        with record_function(PREFIX + "rollout"):
            block = fn(ema)
            with record_function(PREFIX + "weight sync"):
                block.__enter__()
            try:
                yield
            finally:
                with record_function(PREFIX + "weight sync"):
                    block.__exit__(None, None, None)
    return engine_weights


def wrap_phases(trainer, stack: contextlib.ExitStack) -> None:
    """Put a named range around each public piece of a training step, undone when `stack` closes."""
    import diffrl.engine.engine as engine_module
    import diffrl.train.trainer as trainer_module

    policy, objective = trainer.policy, trainer.objective
    patch = lambda obj, attr, wrapper: stack.enter_context(mock.patch.object(obj, attr, wrapper))
    for family in {id(f): f for f in (policy.family, policy.engine_family)}.values():
        patch(family, "encode_prompts", _timed("encode", family.encode_prompts))
        patch(family, "velocity_and_uncond", _timed("transformer", family.velocity_and_uncond))
        patch(family, "decode", _timed("decode", family.decode))
    patch(engine_module, "denoise", _timed("denoise", engine_module.denoise))
    if trainer.engine is not None:
        patch(trainer.engine, "_generate", _timed("engine batch", trainer.engine._generate))
    if trainer.manager is not None:
        patch(trainer.manager, "rollout", _timed_async("rollout manager", trainer.manager.rollout))
        if trainer.manager.reward_fn is not None:
            patch(trainer.manager, "reward_fn", _timed_async("reward", trainer.manager.reward_fn))
    patch(policy, "engine_weights", _timed_engine_weights(policy.engine_weights))
    patch(trainer_module, "rollout_conditioning", _timed("conditioning", trainer_module.rollout_conditioning))
    patch(objective, "pairs", _timed("pairs", objective.pairs))
    patch(objective, "loss", _timed("forward", objective.loss))
    patch(torch.Tensor, "backward", _timed("backward", torch.Tensor.backward))
    patch(policy, "step", _timed("optimizer step", policy.step))
    patch(policy.optimizer, "zero_grad", _timed("zero grad", policy.optimizer.zero_grad))
    patch(objective, "after_update", _timed("after update", objective.after_update))
    patch(trainer, "rollout_and_update", _timed("step", trainer.rollout_and_update))


# ------------------------------------------------------------------ interval arithmetic (seconds)
def merged(intervals) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals) -> float:
    return sum(e - s for s, e in merged(intervals))


def clipped(intervals, lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def minus(intervals, taken) -> float:
    """Length of `intervals` not covered by `taken` (both merged here)."""
    free, taken = merged(intervals), merged(taken)
    total, j = 0.0, 0
    for s, e in free:
        total += e - s
        while j < len(taken) and taken[j][1] <= s:
            j += 1
        k = j
        while k < len(taken) and taken[k][0] < e:
            total -= min(e, taken[k][1]) - max(s, taken[k][0])
            k += 1
    return total


class ActivePhases:
    """Which phase ranges were open on a thread at a time: a sweep over the ranges' ends."""

    def __init__(self, ranges: list[tuple[float, float, str]]):
        points = sorted([(s, 1, name) for s, e, name in ranges] + [(e, -1, name) for s, e, name in ranges])
        self.times, self.active, open_ = [], [], defaultdict(int)
        for t, step, name in points:
            open_[name] += step
            self.times.append(t)
            self.active.append(frozenset(n for n, c in open_.items() if c > 0))

    def at(self, t: float) -> frozenset:
        i = bisect.bisect_right(self.times, t) - 1
        return self.active[i] if i >= 0 else frozenset()


def category(name: str, cat: str) -> str:
    lower = name.lower()
    if cat != "kernel" or "memcpy" in lower or "memset" in lower:
        return "copies"
    for label, keys in CATEGORIES:
        if any(k in lower for k in keys):
            return label
    return "other"


# ------------------------------------------------------------------ the report
def is_launch(name: str) -> bool:
    return "LaunchKernel" in name or name.startswith("cuLaunch") or name == "cudaLaunchCooperativeKernel"


def sync_kind(call: dict, copies: dict) -> str | None:
    """What a runtime call makes the host wait for: a sync call, or a cudaMemcpy* that copies device to host."""
    if call["name"] in SYNC_CALLS:
        return call["name"]
    if call["name"].startswith("cudaMemcpy"):
        copy = copies.get(call["args"].get("correlation"))
        if copy is not None and "DtoH" in copy["name"]:
            return "cudaMemcpy DtoH"
    return None


def analyze(trace: dict, walls: dict) -> dict:
    """The report of each window (rollout, train, the whole step) from the Chrome trace of one step."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    t0 = min(e["ts"] for e in events)
    for e in events:  # seconds from the trace's start
        e["start"], e["end"] = (e["ts"] - t0) / 1e6, (e["ts"] - t0 + e["dur"]) / 1e6
        e.setdefault("args", {})
    ranges = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(PREFIX)]
    for e in ranges:
        e["phase"] = e["name"][len(PREFIX):]
    calls = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    launcher = {e["args"]["correlation"]: e for e in calls if "correlation" in e["args"]}
    copies = {e["args"]["correlation"]: e for e in gpu if "correlation" in e["args"]}

    def whole(name):
        found = [e for e in ranges if e["phase"] == name]
        return (min(e["start"] for e in found), max(e["end"] for e in found)) if found else None

    step, rollout = whole("step"), whole("rollout")
    if step is None or rollout is None:
        raise RuntimeError("the trace holds no phase ranges: was the step profiled on every thread?")
    windows = {"rollout": rollout, "train": (rollout[1], step[1]), "step": step}
    # The last CUDA record should come at the step's end (its final syncs): earlier, kineto dropped records.
    cuda_end = max((e["end"] for e in calls + gpu), default=None)
    cuda_cover = None if cuda_end is None else (cuda_end - step[0]) / (step[1] - step[0])
    for e in ranges:  # a range belongs to the window it starts in
        w = "rollout" if rollout[0] <= e["start"] <= rollout[1] else "train" if e["start"] > rollout[1] else None
        e["key"] = f"{w}/{e['phase']}" if w is not None and e["phase"] in PHASES[w] else None

    # Per thread, the phases open at each runtime call; a kernel or copy belongs to its launching call's.
    per_thread = defaultdict(list)
    for e in ranges:
        if e["key"] is not None:
            per_thread[e["tid"]].append((e["start"], e["end"], e["key"]))
    open_on = {tid: ActivePhases(r) for tid, r in per_thread.items()}
    none = frozenset()
    for c in calls:
        c["phases"] = open_on[c["tid"]].at(c["start"]) if c["tid"] in open_on else none
    phase_gpu, launches, sync_s = defaultdict(list), defaultdict(int), defaultdict(float)
    for k in gpu:
        for p in launcher.get(k["args"].get("correlation"), {}).get("phases", none):
            phase_gpu[p].append((k["start"], k["end"]))
    for c in calls:
        launch, waits = is_launch(c["name"]), sync_kind(c, copies) is not None
        for p in c["phases"]:
            launches[p] += launch
            sync_s[p] += c["dur"] / 1e6 if waits else 0.0

    report = {"cuda_records_cover": cuda_cover}
    for w, (lo, hi) in windows.items():
        section = {"wall_s": walls.get(w), "profiled_s": hi - lo}
        busy = length(clipped([(k["start"], k["end"]) for k in gpu], lo, hi))
        section.update(gpu_busy_s=busy, gpu_idle_share=1 - busy / (hi - lo) if gpu else None)
        inside = [c for c in calls if lo <= c["start"] < hi]
        syncs: dict[str, dict] = {}
        for c in inside:
            if (kind := sync_kind(c, copies)) is not None:
                entry = syncs.setdefault(kind, {"calls": 0, "seconds": 0.0})
                entry["calls"] += 1
                entry["seconds"] += c["dur"] / 1e6
        section.update(kernel_launches=sum(is_launch(c["name"]) for c in inside),
                       graph_launches=sum(c["name"].startswith("cudaGraphLaunch") for c in inside), host_syncs=syncs)
        if w in PHASES:
            section["phases"], tracked = {}, []
            for name in PHASES[w]:
                key = f"{w}/{name}"
                mine = [(e["start"], e["end"]) for e in ranges if e["key"] == key]
                if mine:
                    section["phases"][name] = {
                        "calls": len(mine), "host_s": length(mine), "exclusive_s": minus(mine, tracked),
                        "gpu_s": length(phase_gpu[key]), "launches": launches[key], "sync_s": sync_s[key]}
                    tracked += mine
            section["untracked_host_s"] = (hi - lo) - length(clipped(tracked, lo, hi))
        section["kernels"] = kernel_table([k for k in gpu if lo <= k["start"] < hi])
        report[w] = section
    return report


def kernel_table(gpu: list, top: int = 15) -> dict:
    """GPU time (kernels and copies, summed) by category and the `top` kernels by time."""
    by_name: dict[str, list] = {}
    by_category: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "calls": 0})
    for k in gpu:
        entry = by_name.setdefault(k["name"], [0.0, 0, category(k["name"], k["cat"])])
        entry[0] += k["end"] - k["start"]
        entry[1] += 1
        by_category[entry[2]]["seconds"] += k["end"] - k["start"]
        by_category[entry[2]]["calls"] += 1
    total = sum(c["seconds"] for c in by_category.values())
    for c in by_category.values():
        c["share"] = c["seconds"] / total if total else 0.0
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"seconds": total, "by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1]["seconds"])),
            "top": [{"name": n[:160], "category": c, "seconds": s, "calls": k} for n, (s, k, c) in ranked]}


def print_report(report: dict) -> None:
    cover = report["cuda_records_cover"]
    if cover is not None and cover < 0.95:
        print(f"warning: CUDA records end at {cover:.0%} of the step: kineto dropped the rest (raise "
              "ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB in the file KINETO_CONFIG names); GPU figures are partial")
    for w in ("rollout", "train", "step"):
        r = report[w]
        wall = r.get("wall_s", r["profiled_s"])
        idle = ("" if r["gpu_idle_share"] is None
                else f", GPU busy {r['gpu_busy_s']:.3f} s, idle {r['gpu_idle_share']:.0%}")
        syncs = ", ".join(f"{k} {v['calls']} ({v['seconds']:.3f} s)" for k, v in r["host_syncs"].items()) or "none"
        print(f"== {w}: wall {wall:.3f} s (profiled window {r['profiled_s']:.3f} s){idle}; "
              f"{r['kernel_launches']} kernel launches, {r['graph_launches']} graph launches; host syncs: {syncs}")
        if "phases" in r:
            print(f"   {'phase':<16}{'calls':>7}{'host s':>10}{'excl s':>10}{'GPU s':>10}{'launches':>10}"
                  f"{'sync s':>9}")
            for name, p in r["phases"].items():
                print(f"   {name:<16}{p['calls']:>7}{p['host_s']:>10.3f}{p['exclusive_s']:>10.3f}{p['gpu_s']:>10.3f}"
                      f"{p['launches']:>10}{p['sync_s']:>9.3f}")
            print(f"   {'untracked':<16}{'':>7}{'':>10}{r['untracked_host_s']:>10.3f}")
        kernels = r["kernels"]
        if kernels["seconds"]:
            print("   kernels: " + ", ".join(f"{c} {v['seconds']:.3f} s ({v['share']:.0%}, {v['calls']} calls)"
                                          for c, v in kernels["by_category"].items()))
            if w == "step":
                for k in kernels["top"]:
                    print(f"   {k['seconds']:8.3f} s {k['calls']:>7} × {k['category']:<12} {k['name'][:100]}")


# ------------------------------------------------------------------ the run
def build_trainer(args, extra: list[str]):
    from diffrl.cli.main import parse
    from diffrl.recipes import recipe_overrides
    from diffrl.train.trainer import Trainer

    overrides = recipe_overrides(args.recipe, args.device or "auto")
    if not args.checkpoint.exists():
        make_checkpoint(overrides["diffusion_model_family"], args.checkpoint, torch.device(args.device or "cuda"))
    run_dir = args.work_dir / f"{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
    flags = ["train", "--recipe", args.recipe, "--model-path", str(args.checkpoint), "--output-dir", str(run_dir),
             "--num-rollout", "2"]
    for flag, value in (("--rollout-batch-size", args.rollout_batch_size), ("--reward", args.reward),
                        ("--device", args.device)):
        if value is not None:
            flags += [flag, str(value)]
    if args.compile:
        flags.append("--compile")
    cfg = parse(flags + extra)
    if args.rollout_batch_size is not None and not any(f.startswith("--global-batch-size") for f in extra):
        samples = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt  # the recipe's steps, smaller
        cfg = cfg.replace(global_batch_size=samples // cfg.optim.num_steps_per_rollout)
    return Trainer(cfg), run_dir


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Any other flag is passed to `diffrl train`.")
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--recipe", required=True, help="a name of diffrl/recipes.py")
    parser.add_argument("--rollout-batch-size", type=int, default=None, help="prompt groups (default: the recipe's)")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--reward", default=None, help="default: the recipe's")
    parser.add_argument("--device", default=None, help="default: CUDA when present")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/profile-training"))
    parser.add_argument("--out", default=None, help="the report as JSON")
    parser.add_argument("--trace-dir", type=Path, default=None, help="keep the Chrome trace here, gzipped")
    parser.add_argument("--trace-max-mib", type=float, default=15.0, help="drop a gzipped trace larger than this")
    args, extra = parser.parse_known_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if "KINETO_CONFIG" not in os.environ:  # before the first trace: see KINETO_BUFFER_MB
        conf = args.work_dir.resolve() / "kineto.conf"
        conf.write_text(f"ACTIVITIES_MAX_GPU_BUFFER_SIZE_MB={KINETO_BUFFER_MB}\n")
        os.environ["KINETO_CONFIG"] = str(conf)

    start = time.perf_counter()
    trainer, run_dir = build_trainer(args, extra)
    load_s = time.perf_counter() - start
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:  # the engine denoises on its own thread: record every thread's ops and ranges
        extra_config = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except TypeError:
        print("warning: this torch profiles only the calling thread; the engine's phases will be missing")
        extra_config = {}

    with contextlib.ExitStack() as stack:
        wrap_phases(trainer, stack)
        start = time.perf_counter()
        warmup = trainer.rollout_and_update(0)
        trainer.rollout_index = 1
        sync()
        warmup_s = time.perf_counter() - start
        print(f"warm-up step: {warmup_s:.1f} s (rollout {warmup['rollout/seconds']:.2f} s, "
              f"train {warmup.get('train/seconds', 0.0):.2f} s)", flush=True)
        with profile(activities=activities, record_shapes=False, with_stack=False, profile_memory=False,
                     **extra_config) as prof:
            start = time.perf_counter()
            record = trainer.rollout_and_update(1)
            sync()
            step_s = time.perf_counter() - start
        trainer.rollout_index = 2
    if hasattr(trainer.manager.reward_fn if trainer.manager else None, "close"):
        trainer.manager.reward_fn.close()  # a worker pool

    start = time.perf_counter()
    raw = run_dir / "trace.json"
    prof.export_chrome_trace(str(raw))
    trace_mib = raw.stat().st_size / 2**20
    trace = json.loads(raw.read_text())
    events = len(trace["traceEvents"])
    walls = {"rollout": record["rollout/seconds"], "train": record.get("train/seconds", 0.0), "step": step_s}
    report = analyze(trace, walls)
    del trace
    kept = None
    if args.trace_dir is not None:  # named after the report: profile.json's trace is profile.trace.json.gz
        name = Path(args.out).stem if args.out else f"profile_{args.recipe}_{'compiled' if args.compile else 'eager'}"
        kept = keep_trace(raw, args.trace_dir / f"{name}.trace.json.gz", args.trace_max_mib)
    raw.unlink()
    cfg = trainer.cfg
    results = {
        "recipe": args.recipe, "checkpoint": str(args.checkpoint), "compile": cfg.model.compile,
        "device": torch.cuda.get_device_name(trainer.device) if cuda else "cpu", "torch": torch.__version__,
        "host_cpus": os.cpu_count(), "flags": extra, "rollout_batch_size": cfg.rollout.rollout_batch_size,
        "samples": cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt,
        "train_pairs": record.get("train/pairs"), "peak_gib": record.get("memory/peak_gib"), "load_s": load_s,
        "warmup": {"step_s": warmup_s, "rollout_s": warmup["rollout/seconds"], "train_s": warmup.get("train/seconds")},
        "trace": {"events": events, "json_mib": trace_mib, "analysis_s": time.perf_counter() - start, "kept": kept},
        **report,
    }
    print_report(results)
    emit(results, args.out)
    return results


def keep_trace(raw: Path, path: Path, max_mib: float) -> str | None:
    """Gzip the trace to `path` unless it comes out larger than `max_mib` (traces compress ~10-20×)."""
    if raw.stat().st_size > 40 * max_mib * 2**20:  # surely too large: do not spend minutes compressing it
        print(f"trace not kept: {raw.stat().st_size / 2**20:.0f} MiB of JSON")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with raw.open("rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
        shutil.copyfileobj(src, dst, 1 << 22)
    if path.stat().st_size > max_mib * 2**20:
        print(f"trace not kept: {path.stat().st_size / 2**20:.1f} MiB gzipped (limit {max_mib} MiB)")
        path.unlink()
        return None
    return str(path)


if __name__ == "__main__":
    main()
