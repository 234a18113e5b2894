"""Deterministic mode (`--deterministic-mode`): two runs of one command on one machine give bit-identical
metrics (wall-clock fields aside) and weights. Everything it takes is here; `enable` applies it in each
process that computes (the trainer, a colocated engine, reward workers):

- cuBLAS gets a fixed workspace (`CUBLAS_WORKSPACE_CONFIG=:4096:8`): with the default one its kernels may
  split reductions differently from call to call. cuBLAS reads the variable once, when it first makes its
  workspace, so it is set before CUDA is initialized; a process whose CUDA is already up with another value
  (or none) is refused: export the variable before starting it.
- `torch.use_deterministic_algorithms(True, warn_only=False)`: deterministic kernels for scatter, index_add, index_put
  and the like, and an error for an op that has none (never a silent non-deterministic fallback).
- cuDNN: deterministic algorithms, no benchmark autotuning (which times candidates and may pick another
  algorithm in another run).
- Attention (SDPA) on CUDA: the memory-efficient kernel and the math one only. torch runs the efficient
  kernel's backward without split keys in deterministic mode (and raises if it cannot), keeps cuDNN
  attention out (it has no deterministic backward) and passes FA2's `deterministic` flag to flash
  attention's backward; we keep flash off too, so that determinism rests on the one kernel whose
  deterministic path torch checks, whatever its version. Forward passes are deterministic in every kernel.
- Compiled blocks (`--compile`): Inductor's own deterministic mode (`torch._inductor.config.deterministic`), which
  skips the on-device timing that picks among kernel configurations where the choice changes the numerics (a
  reduction's block size and warps): two processes could otherwise time their way to different kernels. The
  max-autotune compile mode, which times GEMM candidates, is refused with deterministic mode (`speed.py`).
- Engines denoise each request alone (`engine_batch_outputs`): merging requests that wait together depends
  on when they arrive, and on a GPU a sample's bits depend on the batch it sits in.
- CPU reductions split by the intra-op thread count: it is fixed for a process (torch's default, the cores,
  or OMP_NUM_THREADS), a colocated engine takes the trainer's and each reward worker uses one. `enable`
  reports it, so two runs can be checked to have had the same.
- Data order is seeded everywhere (prompts, pairs, optimizer chunks, noise: each from its own generator), and
  rewards come back per microgroup, in order, whichever worker scored them.

`compare_runs` is the check: two run folders, their metrics and final weights bit for bit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from diffrl.utils.compile_settings import compile_setting, require_compile_settings

CUBLAS_WORKSPACE = ":4096:8"
_DETERMINISTIC_WORKSPACES = (":4096:8", ":16:8")  # the two cuBLAS documents as reproducible
# metrics.jsonl fields that measure wall-clock time: the only ones allowed to differ between two runs.
WALL_CLOCK_KEYS = frozenset({"rollout/seconds", "rollout/images_per_s", "train/seconds", "train/pairs_per_s",
                             "time/elapsed_s"})


def enable(device: torch.device | str) -> dict:
    """Apply deterministic mode in this process for work on `device`; returns what it set."""
    device = torch.device(device)
    _fix_cublas_workspace()
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    require_compile_settings(inductor={"deterministic": True})  # in every thread that runs compiled blocks
    attention = "any"
    if device.type == "cuda":  # on a CPU these switches would change which CPU kernel runs, for nothing
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
        torch.backends.cuda.enable_math_sdp(True)
        attention = "efficient, math"
    return {"cublas_workspace_config": os.environ["CUBLAS_WORKSPACE_CONFIG"], "cpu_threads": torch.get_num_threads(),
            "sdpa_backends": attention, "inductor_deterministic": compile_setting("inductor", "deterministic")}


def _fix_cublas_workspace() -> None:
    value = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if value in _DETERMINISTIC_WORKSPACES:
        return
    if value is not None:
        raise ValueError(f"--deterministic-mode: CUBLAS_WORKSPACE_CONFIG={value} is not reproducible; unset it or "
                         f"set it to {' or '.join(_DETERMINISTIC_WORKSPACES)}")
    if torch.cuda.is_initialized():
        raise ValueError("--deterministic-mode: CUDA was initialized before CUBLAS_WORKSPACE_CONFIG could be set "
                         f"(cuBLAS reads it once); export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE} before starting")
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE  # spawned processes inherit it


def engine_batch_outputs(max_batch_outputs: int, deterministic: bool) -> int:
    """An engine's `max_batch_outputs`: 1 (each request alone) in deterministic mode."""
    return 1 if deterministic else max_batch_outputs


# ---------------------------------------------------------------------------------------------- the check
def compare_runs(a: Path, b: Path) -> dict:
    """Where two run folders differ: metrics.jsonl records (wall-clock fields aside) and the tensors of their
    last checkpoints (model files and train state: parameters, optimizer, EMAs), compared bit for bit."""
    metrics = _metric_differences(_records(a), _records(b))
    tensors_a, tensors_b = _checkpoint_tensors(a), _checkpoint_tensors(b)
    weights = sorted(name for name in tensors_a.keys() | tensors_b.keys()
                     if name not in tensors_a or name not in tensors_b or not _same_bits(tensors_a[name], tensors_b[name]))
    return {"metrics_identical": not metrics, "weights_identical": not weights and bool(tensors_a),
            "metric_differences": metrics, "tensor_differences": weights, "tensors_compared": len(tensors_a)}


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _metric_differences(a: list[dict], b: list[dict]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} records against {len(b)}"]
    found = []
    for ra, rb in zip(a, b, strict=True):
        for key in sorted((ra.keys() | rb.keys()) - WALL_CLOCK_KEYS):
            if json.dumps(ra.get(key)) != json.dumps(rb.get(key)):  # repr of floats: exact, NaN included
                found.append(f"rollout {ra.get('rollout')}: {key} {ra.get(key)!r} != {rb.get(key)!r}")
    return found


def _checkpoint_tensors(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    folders = sorted((run / "checkpoints").glob("rollout-*"))
    if not folders:
        return {}
    last, tensors = folders[-1], {}
    for file in sorted(last.rglob("*.safetensors")):
        for key, value in load_file(str(file)).items():
            tensors[f"{file.relative_to(last)}:{key}"] = value
    for file in sorted(last.rglob("*.pt")):
        _collect(torch.load(file, map_location="cpu", weights_only=True), str(file.relative_to(last)), tensors)
    return tensors


def _collect(value, prefix: str, out: dict) -> None:
    if isinstance(value, torch.Tensor):
        out[prefix] = value
    elif isinstance(value, dict):
        for key, item in value.items():
            _collect(item, f"{prefix}.{key}", out)
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _collect(item, f"{prefix}.{i}", out)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
