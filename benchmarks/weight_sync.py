"""Weight sync to an engine on the trainer's GPU: a colocated engine process fed by CUDA IPC buckets
(`diffrl train --colocate`) against the HTTP push to an engine behind `diffrl serve`'s app, for a LoRA
adapter and for full weights; what the colocated engine's sleep levels free; what optimizer offload frees.

    python benchmarks/weight_sync.py --checkpoint runs/sd35m-random --family sd3 --lora-rank 32 --out ws.json
    python benchmarks/weight_sync.py --device cpu     # the shipped demo model: the code path, no memory figures

The trainer's side holds what `diffrl train` holds: a LoRA adapter (fp32) over bf16 base weights, or a
full finetune's fp32 masters (which the colocated engine mirrors). For each mode and path: seconds
per sync (median of --repeats after one warm-up sync) and the peak extra device memory a sync takes,
on the trainer's side and on the engine's (max_memory_allocated above what was allocated before).
The HTTP engine runs in this process, on a loopback port: its extra memory is this process's (the
trainer's side of an HTTP push holds none on the device).

Sleep: the colocated engine samples one request (so the allocator has something cached), sleeps at
level 1 and then 2, wakes, and samples the request again; reported are the bytes it moved, its
allocated and reserved memory before and after, the device's free memory seen from this process
before and after (`cudaMemGetInfo`), seconds, and whether the samples after waking equal those before.

On a GPU the run fails (exit status 1, after the report is written) when a sleep did not give the device
what it should: at level 2 less free memory than the bytes moved to the host, or at either level less
than the cache the engine could release (reserved minus allocated before sleeping, plus what the sleep
freed, minus the free parts of segments that still hold a live block, which `empty_cache` keeps), each
with a tolerance of 64 MiB or 1% of the expected figure, whichever is larger.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import torch
from report import emit

from diffrl.serving.colocated import ColocatedEngineClient, EngineProcessSpec
from diffrl.engine.engine import Engine
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.models import resolve_family
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.models.lora import LoraSpec, add_lora
from diffrl.rollout import HttpEngineClient
from diffrl.utils.offload import OptimizerOffload, device_free_bytes, release_cached

GIB = 2**30
TOLERANCE = 64 * 2**20  # what the CUDA context, another process or rounding may move between two readings


def shortfall_allowed(expected: int) -> int:
    """How far below `expected` a sleep's device gain may fall: 64 MiB, or 1% of a large figure (the H200's
    healthy full-weights level 2 gained 13.29 GiB of 13.33 GiB releasable)."""
    return max(TOLERANCE, expected // 100)


def trainer_family(args, mode: str):
    """The trainer's model and the tensors it syncs: all transformer weights in fp32, or a LoRA adapter
    (B random, so the sync carries real values)."""
    family = resolve_family(args.family, args.checkpoint).load(args.checkpoint, device=args.device, dtype=args.dtype)
    if mode == "full":
        family.transformer.float()
        return family, None, dict(family.transformer.named_parameters())
    spec = LoraSpec(rank=args.lora_rank, alpha=2.0 * args.lora_rank,
                    target_modules=sorted(family.lora_target_modules))
    add_lora(family.transformer, spec)
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for name, param in family.transformer.named_parameters():
        if "lora_" in name:
            param.data.copy_(0.01 * torch.randn(param.shape, generator=gen))
            tensors[name] = param
    return family, spec, tensors


def timed_syncs(push, repeats: int, device: torch.device, engine_memory=None) -> dict:
    """One warm-up sync, then `repeats` timed ones: median seconds, the sender's and the engine's peak extra memory."""
    seconds, sender, engine = [], [], []
    for i in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        engine_before = engine_memory(True) if engine_memory else None
        start = time.perf_counter()
        buckets = push(i + 1)
        elapsed = time.perf_counter() - start
        if i == 0:
            continue
        seconds.append(elapsed)
        if device.type == "cuda":
            sender.append(torch.cuda.max_memory_allocated(device) - before)
        if engine_before and engine_before["allocated"] is not None:
            engine.append(engine_memory(False)["peak_allocated"] - engine_before["allocated"])
    return {"seconds": statistics.median(seconds), "all_seconds": seconds, "buckets": buckets,
            "sender_extra_bytes": max(sender) if sender else None, "engine_extra_bytes": max(engine) if engine else None}


def sample(client, request) -> list:
    return asyncio.run(client.generate(request))


def same(a, b) -> bool:
    return all(torch.equal(x.generated_output, y.generated_output) for x, y in zip(a, b, strict=True))


def colocated_path(args, mode: str, family, spec, tensors, request) -> dict:
    device = torch.device(args.device)
    client = ColocatedEngineClient(EngineProcessSpec(
        model_path=str(args.checkpoint), family=family.name, device=str(device), dtype=str(args.dtype).removeprefix("torch."),
        transformer_dtype="float32" if mode == "full" else None,
        autocast_dtype="bfloat16" if device.type == "cuda" else None))
    try:
        if spec is not None:
            client.add_lora_adapter(spec)
        results = {}
        for mib in args.buffer_mib:
            client.buffer_bytes = int(mib * 2**20)
            results[f"ipc_{mib:g}MiB"] = timed_syncs(lambda v: client.push_weights(tensors, v), args.repeats, device,
                                                     client.memory)
        results["sleep"] = sleep_and_wake(client, request, device)
        return results
    finally:
        client.close()


def sleep_and_wake(client, request, device: torch.device) -> list[dict]:
    rows = []
    for level in (1, 2, 2):  # level 2 twice: a trainer's engine sleeps every rollout, so the second is the steady cost
        first = sample(client, request)
        free_before = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        start = time.perf_counter()
        slept = client.sleep(level)
        sleep_s = time.perf_counter() - start
        free_asleep = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        start = time.perf_counter()
        woke = client.wake()
        wake_s = time.perf_counter() - start
        before, after = slept["before"], slept["after"]
        freed = None if before["allocated"] is None else before["allocated"] - after["allocated"]
        # What the allocator could give back: its cache before sleeping and what the sleep freed, less the
        # free parts of segments still holding a live block after it (empty_cache releases whole segments only).
        releasable = None if freed is None else (before["reserved"] - before["allocated"] + freed
                                                 - slept.get("stranded_bytes", 0))
        rows.append({
            "level": level, "moved_bytes": slept["moved_bytes"], "sleep_s": sleep_s, "wake_s": wake_s,
            "allocated_before": before["allocated"], "allocated_asleep": after["allocated"],
            "reserved_before": before["reserved"], "reserved_asleep": after["reserved"],
            "allocated_freed": freed, "device_free_gained": None if free_before is None else free_asleep - free_before,
            "engine_released_bytes": slept.get("released_bytes"), "stranded_bytes": slept.get("stranded_bytes"),
            "releasable_bytes": releasable,
            "frees_what_it_claims": None if freed is None else freed >= slept["moved_bytes"],
            "allocated_awake": woke["after"]["allocated"],
            "bit_identical_after_wake": same(first, sample(client, request)),
        })
    return rows


def sleep_failures(results: dict) -> list[str]:
    """Each sleep that gave the device less than it should (GPU rows only; CPU rows have no figures)."""
    failures = []
    for mode, entry in results["modes"].items():
        for i, r in enumerate(entry.get("sleep", [])):
            gained = r["device_free_gained"]
            if gained is None:
                continue
            where = f"{mode} sleep #{i + 1} (level {r['level']})"
            if r["level"] == 2 and gained < r["moved_bytes"] - shortfall_allowed(r["moved_bytes"]):
                failures.append(f"{where}: moved {r['moved_bytes'] / GIB:.2f} GiB to the host, but the device gained "
                                f"only {gained / GIB:.2f} GiB free (reserved {r['reserved_before'] / GIB:.2f} -> "
                                f"{r['reserved_asleep'] / GIB:.2f} GiB): the engine kept the weights' memory reserved")
            releasable = r["releasable_bytes"]
            if releasable is not None and gained < releasable - shortfall_allowed(releasable):
                failures.append(f"{where}: the engine could release {releasable / GIB:.2f} GiB (reserved "
                                f"{r['reserved_before'] / GIB:.2f} - allocated {r['allocated_before'] / GIB:.2f} GiB "
                                f"before, {r['allocated_freed'] / GIB:.2f} GiB freed, "
                                f"{(r['stranded_bytes'] or 0) / GIB:.2f} GiB held in segments with live blocks), but "
                                f"the device gained only {gained / GIB:.2f} GiB free")
    return failures


def http_path(args, mode: str, spec, tensors) -> dict:
    device = torch.device(args.device)
    served = resolve_family(args.family, args.checkpoint).load(args.checkpoint, device=device, dtype=args.dtype)
    if mode == "full":
        served.transformer.float()
    engine = Engine(served)
    if spec is not None:
        engine.add_lora_adapter(spec)
    with serving_in_thread(create_app(engine)) as url:
        client = HttpEngineClient(url)
        try:
            return {"http": timed_syncs(lambda v: client.push_weights(tensors, v) or 1, args.repeats, device)}
        finally:
            client.close()


def optimizer_offload(tensors: dict, device: torch.device) -> dict:
    """AdamW's state after one step over `tensors`, moved to the host and back."""
    params = [t for t in tensors.values() if t.is_floating_point()]
    optimizer = torch.optim.AdamW(params, lr=1e-6)
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    for p in params:
        p.grad = None
    offload = OptimizerOffload(optimizer)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else None
    rounds = []
    for _ in range(2):  # the second round is the steady cost (host buffers from the first may be reused)
        start = time.perf_counter()
        moved = offload.offload()
        offload_s = time.perf_counter() - start
        freed = before - torch.cuda.memory_allocated(device) if device.type == "cuda" else None
        free_before = device_free_bytes(device)
        release_cached(device)  # as the trainer does before a colocated engine wakes (Policy._sampling_memory)
        released = device_free_bytes(device) - free_before if device.type == "cuda" else None
        start = time.perf_counter()
        offload.restore()
        rounds.append({"moved_bytes": moved, "allocated_freed": freed, "device_free_gained": released,
                       "offload_s": offload_s, "restore_s": time.perf_counter() - start})
    return {**rounds[0], "again_offload_s": rounds[1]["offload_s"], "again_restore_s": rounds[1]["restore_s"]}


def run(args) -> dict:
    device = torch.device(args.device)
    results: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                     "checkpoint": str(args.checkpoint), "dtype": str(args.dtype), "modes": {}}
    for mode in args.modes:
        family, spec, tensors = trainer_family(args, mode)
        height, width = (args.resolution, args.resolution) if args.resolution else family.default_size()
        request = RolloutRequest(prompt="a red circle above a blue square", seed=7, num_outputs_per_prompt=args.n,
                                 num_inference_steps=args.steps, height=height, width=width)
        results["family"] = family.name
        entry = {"tensors": len(tensors), "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        entry.update(colocated_path(args, mode, family, spec, tensors, request))
        entry.update(http_path(args, mode, spec, tensors))
        if mode == "full":
            entry["optimizer_offload"] = optimizer_offload(tensors, device)
        results["modes"][mode] = entry
        del family, tensors
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def table(results: dict) -> str:
    def gib(x):
        return "-" if x is None else f"{x / GIB:.2f}"

    lines = [f"{results['family']} on {results['device']}",
             f"{'mode':5} {'path':12} {'GiB sent':>8} {'buckets':>7} {'s/sync':>8} {'sender +GiB':>11} {'engine +GiB':>11}"]
    for mode, entry in results["modes"].items():
        for path, r in entry.items():
            if isinstance(r, dict) and "seconds" in r:
                lines.append(f"{mode:5} {path:12} {gib(entry['bytes']):>8} {r['buckets']:>7} {r['seconds']:>8.3f} "
                             f"{gib(r['sender_extra_bytes']):>11} {gib(r['engine_extra_bytes']):>11}")
    lines.append(f"{'mode':5} {'sleep':>5} {'moved GiB':>9} {'freed GiB':>9} {'reserved GiB':>13} "
                 f"{'releasable GiB':>14} {'device free +GiB':>16} {'sleep s':>7} {'wake s':>6} {'same samples':>12}")
    for mode, entry in results["modes"].items():
        for r in entry.get("sleep", []):
            reserved = "-" if r["reserved_before"] is None else \
                f"{gib(r['reserved_before'])}->{gib(r['reserved_asleep'])}"
            lines.append(f"{mode:5} {r['level']:>5} {gib(r['moved_bytes']):>9} {gib(r['allocated_freed']):>9} "
                         f"{reserved:>13} {gib(r['releasable_bytes']):>14} {gib(r['device_free_gained']):>16} "
                         f"{r['sleep_s']:>7.3f} {r['wake_s']:>6.3f} {r['bit_identical_after_wake']!s:>12}")
        if "optimizer_offload" in entry:
            o = entry["optimizer_offload"]
            lines.append(f"{mode:5} optimizer offload: {gib(o['moved_bytes'])} GiB moved, {gib(o['allocated_freed'])} GiB "
                         f"freed, device free +{gib(o['device_free_gained'])} GiB once the cache is released, "
                         f"{o['offload_s']:.3f} s out, {o['restore_s']:.3f} s back; again "
                         f"{o['again_offload_s']:.3f} s out, {o['again_restore_s']:.3f} s back")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=SHIPPED_DEMO_MODEL)
    parser.add_argument("--family", default=None, help="default: from the checkpoint's folder name")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="the loaded components' dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    parser.add_argument("--modes", nargs="+", default=["lora", "full"], choices=["lora", "full"])
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--buffer-mib", type=float, nargs="+", default=[512.0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--resolution", type=int, default=None, help="of the sleep check's samples (default: the family's)")
    parser.add_argument("--n", type=int, default=4, help="samples of the sleep check's request")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    results = run(args)
    results["sleep_failures"] = sleep_failures(results)
    emit(results, args.out)
    print(table(results))
    if results["sleep_failures"]:
        sys.stdout.flush()
        print("FAIL: a colocated engine's sleep did not give the device its memory back:", file=sys.stderr)
        for line in results["sleep_failures"]:
            print(f"FAIL: {line}", file=sys.stderr)
        raise SystemExit(1)
    return results


if __name__ == "__main__":
    main()
