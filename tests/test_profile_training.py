"""benchmarks/profile_training.py on a tiny random SD3 checkpoint on CPU: a warm-up step, then a profiled step
whose report names every phase of the rollout and the training, with host times that fit in the step's wall."""

import gzip
import json
from pathlib import Path

import pytest
from benchmark_scripts import load_benchmark

from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint

# sd3-grpo cut to CPU size: 2 groups × 2 samples, 2 steps, both SDE and trained (2 pairs per sample), 32².
TINY = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2",
        "--diffusion-num-steps", "2", "--diffusion-sde-window-range", "0", "2", "--diffusion-num-sde-steps", "2",
        "--micro-batch-size", "2", "--resolution", "32", "--lora-rank", "2", "--device", "cpu",
        "--reward", "jpeg_compressibility"]
PHASES = {"rollout": {"encode", "transformer", "denoise", "decode", "engine batch", "weight sync", "reward",
                      "rollout manager"},
          "train": {"conditioning", "pairs", "transformer", "forward", "backward", "optimizer step", "zero grad",
                    "after update"}}


def _load_script(monkeypatch):
    return load_benchmark("profile_training", monkeypatch)


def test_cpu_profile_accounts_for_the_step(tmp_path, monkeypatch):
    script = _load_script(monkeypatch)
    monkeypatch.setenv("KINETO_CONFIG", str(tmp_path / "kineto.conf"))  # or the script sets it for the process
    checkpoint = save_random_checkpoint(tmp_path / "sd3-tiny", with_t5=False)
    out, traces = tmp_path / "profile.json", tmp_path / "traces"
    report = script.main(["--checkpoint", str(checkpoint), "--recipe", "sd3-grpo", "--work-dir", str(tmp_path / "work"),
                          "--out", str(out), "--trace-dir", str(traces), *TINY])

    assert json.loads(out.read_text())["train_pairs"] == report["train_pairs"] == 2 * 2 * 2
    for window in ("rollout", "train"):
        section = report[window]
        phases = section["phases"]
        assert set(phases) == PHASES[window]
        assert all(p["calls"] >= 1 and p["host_s"] > 0 for p in phases.values()), phases
        # The exclusive split never counts an instant twice: it fits in the profiled window and the
        # trainer's own wall time (clocks of two sources: a millisecond of slack).
        tracked = sum(p["exclusive_s"] for p in phases.values())
        assert 0 < tracked <= section["profiled_s"] + 1e-6
        assert tracked <= section["wall_s"] + 1e-3
        assert abs(tracked + section["untracked_host_s"] - section["profiled_s"]) < 1e-6
        # On the CPU there is no GPU activity, launch or sync to report.
        assert section["gpu_busy_s"] == 0 and section["gpu_idle_share"] is None
        assert section["kernel_launches"] == 0 and section["graph_launches"] == 0 and section["host_syncs"] == {}
        assert all(p["gpu_s"] == 0 and p["launches"] == 0 and p["sync_s"] == 0 for p in phases.values())
        assert section["kernels"]["seconds"] == 0 and section["kernels"]["top"] == []
    rollout, train = report["rollout"]["phases"], report["train"]["phases"]
    assert rollout["transformer"]["calls"] == 2 * rollout["denoise"]["calls"]  # one forward per step (CFG batched)
    assert train["forward"]["calls"] == train["backward"]["calls"] == 8 // 2  # one per micro-batch of 2 pairs
    assert train["transformer"]["calls"] == train["forward"]["calls"] and train["optimizer step"]["calls"] == 1
    assert report["step"]["profiled_s"] <= report["step"]["wall_s"] + 1e-3

    # The Chrome trace is kept, gzipped, with the ranges the report was made from.
    kept = Path(report["trace"]["kept"])
    assert kept.parent == traces
    names = {e.get("name") for e in json.loads(gzip.decompress(kept.read_bytes()))["traceEvents"]}
    assert {"phase:step", "phase:rollout", "phase:denoise", "phase:backward"} <= names


def test_gpu_activity_is_attributed_to_the_phase_that_launched_it(monkeypatch):
    """A hand-made CUDA trace (µs): kernels and copies count for the phases open on the thread that launched
    them, GPU busy time merges overlaps, syncs and launches are counted per window."""
    script = _load_script(monkeypatch)

    def x(cat, name, ts, dur, tid=1, correlation=None):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid,
                "args": {} if correlation is None else {"correlation": correlation}}

    def phase(name, ts, end, tid=1):
        return x("user_annotation", "phase:" + name, ts, end - ts, tid)

    events = [
        phase("step", 0, 100), phase("rollout", 1, 40), phase("weight sync", 1, 2), phase("rollout manager", 2, 39),
        phase("engine batch", 5, 30, tid=2), phase("denoise", 6, 25, tid=2), phase("transformer", 7, 15, tid=2),
        phase("reward", 31, 38),
        x("cuda_runtime", "cudaLaunchKernel", 8, 1, tid=2, correlation=1),
        x("kernel", "nvjet_hsh_gemm", 9, 11, correlation=1),
        x("cuda_runtime", "cudaLaunchKernel", 16, 1, tid=2, correlation=2),
        x("kernel", "vectorized_elementwise_kernel", 20, 4, correlation=2),
        x("cuda_runtime", "cudaMemcpyAsync", 26, 1, tid=2, correlation=3),
        x("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 26, 1, correlation=3),
        x("cuda_runtime", "cudaStreamSynchronize", 27, 2, tid=2),
        phase("forward", 45, 55), phase("transformer", 46, 54), phase("backward", 56, 80),
        phase("optimizer step", 81, 90),
        x("cuda_driver", "cuLaunchKernelEx", 47, 1, correlation=4), x("kernel", "nvjet_hsh_gemm", 47, 13, correlation=4),
        x("cuda_runtime", "cudaLaunchKernel", 57, 1, correlation=5),
        x("kernel", "flash_bwd_kernel", 60, 15, correlation=5),
        x("cuda_runtime", "cudaLaunchKernel", 82, 1, correlation=6),
        x("kernel", "multi_tensor_apply_kernel", 82, 1, correlation=6),
    ]
    report = script.analyze({"traceEvents": events}, {"rollout": 40e-6, "train": 60e-6, "step": 100e-6})
    us = lambda v: pytest.approx(v * 1e-6)

    rollout, train = report["rollout"], report["train"]
    assert rollout["gpu_busy_s"] == us(11 + 4 + 1) and rollout["gpu_idle_share"] == pytest.approx(1 - 16 / 39)
    assert rollout["kernel_launches"] == 2 and rollout["graph_launches"] == 0
    assert rollout["host_syncs"] == {"cudaMemcpy DtoH": {"calls": 1, "seconds": us(1)},
                                     "cudaStreamSynchronize": {"calls": 1, "seconds": us(2)}}
    p = rollout["phases"]
    assert (p["transformer"]["gpu_s"], p["denoise"]["gpu_s"], p["engine batch"]["gpu_s"]) == (us(11), us(15), us(16))
    assert (p["transformer"]["launches"], p["denoise"]["launches"], p["engine batch"]["launches"]) == (1, 2, 2)
    assert p["engine batch"]["sync_s"] == us(3) and p["reward"]["gpu_s"] == 0
    # Exclusive: each phase less what a phase listed before it covers, wherever it ran.
    exclusive = {name: v["exclusive_s"] for name, v in p.items()}
    assert exclusive == {"transformer": us(8), "denoise": us(11), "engine batch": us(6), "weight sync": us(1),
                         "reward": us(7), "rollout manager": us(37 - 25 - 7)}
    assert rollout["untracked_host_s"] == us(1)

    assert train["profiled_s"] == us(60) and train["gpu_busy_s"] == us(13 + 15 + 1)
    assert train["kernel_launches"] == 3
    t = train["phases"]
    assert (t["transformer"]["gpu_s"], t["forward"]["gpu_s"], t["backward"]["gpu_s"]) == (us(13), us(13), us(15))
    assert t["optimizer step"]["gpu_s"] == us(1)
    categories = train["kernels"]["by_category"]
    assert {c: v["calls"] for c, v in categories.items()} == {"attention": 1, "GEMM": 1, "elementwise & reductions": 1}
    assert train["kernels"]["top"][0] == {"name": "flash_bwd_kernel", "category": "attention", "seconds": us(15),
                                          "calls": 1}
    assert report["step"]["kernels"]["by_category"]["copies"]["calls"] == 1
