"""--deterministic-mode: two runs of one command give bit-identical metrics (timings aside) and weights."""

import json
import math
import os

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.utils import determinism


@pytest.fixture
def restore_determinism(monkeypatch):
    """Deterministic mode is process-wide: the other tests get torch's defaults back."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    from diffrl.utils import compile_settings

    monkeypatch.setattr(compile_settings, "_SETTINGS", {k: dict(v) for k, v in compile_settings._SETTINGS.items()})
    cudnn = torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(False)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn


def test_two_deterministic_runs_are_bit_identical(tiny_model_dir, tmp_path, restore_determinism):
    """The tiny demo model: GRPO with CFG and an EMA, 2 rollouts, rewards scored by 2 worker processes
    (microgroups land and are scored in whatever order the workers finish)."""
    flags = ["train", "--deterministic-mode", "--model-path", str(tiny_model_dir), "--reward-workers", "2",
             "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
             "--rollout-microgroup-size", "2", "--global-batch-size", "4", "--num-steps-per-rollout", "2",
             "--micro-batch-size", "2", "--diffusion-num-steps", "3", "--diffusion-guidance-scale", "2",
             "--use-ema", "--no-use-lora", "--lr", "1e-3", "--eval-images-per-category", "1", "--eval-interval", "2",
             "--checkpoint-interval", "2"]
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        assert cli_main([*flags, "--output-dir", str(run)]) == 0
    diff = determinism.compare_runs(*runs)
    assert diff["metric_differences"] == [] and diff["tensor_differences"] == []
    assert diff["metrics_identical"] and diff["weights_identical"] and diff["tensors_compared"] > 10

    records = [json.loads(line) for line in (runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert {"train/loss", "rollout/reward/raw_mean", "eval/strict"} <= records[-1].keys()
    timed = {key for record in records for key in record} & determinism.WALL_CLOCK_KEYS
    assert timed == determinism.WALL_CLOCK_KEYS  # every excluded key is one the trainer writes
    settings = json.loads((runs[0] / "config.json").read_text())["determinism"]
    assert settings == {"cublas_workspace_config": ":4096:8", "cpu_threads": torch.get_num_threads(),
                        "sdpa_backends": "any", "inductor_deterministic": True}
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark


def test_the_comparison_sees_one_changed_metric_and_one_changed_bit(tiny_model_dir, tmp_path, restore_determinism):
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    assert cli_main(["train", "--model-path", str(tiny_model_dir), "--output-dir", str(a), "--num-rollout", "1",
                     "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2",
                     "--global-batch-size", "2", "--diffusion-num-steps", "2", "--eval-images-per-category", "0",
                     "--no-use-lora"]) == 0
    shutil.copytree(a, b)
    assert determinism.compare_runs(a, b)["weights_identical"]
    lines = (b / "metrics.jsonl").read_text().splitlines()
    record = json.loads(lines[-1])
    record["rollout/seconds"] += 1.0  # a wall-clock field: allowed to differ
    (b / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
    assert determinism.compare_runs(a, b)["metrics_identical"]
    record["train/loss"] = math.nextafter(record["train/loss"], math.inf)
    (b / "metrics.jsonl").write_text("\n".join([*lines[:-1], json.dumps(record)]) + "\n")
    state_file = next((b / "checkpoints").glob("rollout-*/train_state.pt"))
    state = torch.load(state_file, weights_only=True)
    state["params"][0].view(-1).view(torch.int32)[0] ^= 1  # the last bit of one weight
    torch.save(state, state_file)
    diff = determinism.compare_runs(a, b)
    assert diff["metric_differences"] == [f"rollout 1: train/loss {json.loads(lines[-1])['train/loss']!r} != "
                                          f"{record['train/loss']!r}"]
    assert diff["tensor_differences"] == ["train_state.pt.params.0"]


def test_cublas_workspace_is_set_or_refused(monkeypatch, restore_determinism):
    assert determinism.enable("cpu")["cublas_workspace_config"] == os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert determinism.enable("cpu")["cublas_workspace_config"] == ":16:8"  # a reproducible one is kept
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG=:0:0 is not reproducible"):
        determinism.enable("cpu")
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="CUDA was initialized before"):
        determinism.enable("cpu")
    assert determinism.engine_batch_outputs(64, True) == 1 and determinism.engine_batch_outputs(64, False) == 64


def test_compiled_blocks_are_deterministic_too(restore_determinism):
    """Inductor's deterministic mode (no timing-picked kernel configurations) comes with --deterministic-mode, in
    every thread that runs compiled blocks, and the compile mode that times GEMM candidates is refused with it,
    naming both flags."""
    import threading

    import torch._inductor.config as inductor

    from diffrl.utils.compile_settings import compile_settings

    assert determinism.enable("cpu")["inductor_deterministic"]
    seen = []

    def forward_thread():
        with compile_settings():  # what every transformer call enters (FamilyAdapter.forward_precision)
            seen.append(inductor.deterministic)
        seen.append(inductor.deterministic)

    worker = threading.Thread(target=forward_thread)
    worker.start()
    worker.join()
    assert seen == [True, False]  # set inside, and the thread's own setting restored after
    from diffrl.cli.main import parse

    with pytest.raises(ValueError, match="--compile-mode max-autotune-no-cudagraphs with --deterministic-mode"):
        parse(["train", "--deterministic-mode", "--compile", "--compile-mode", "max-autotune-no-cudagraphs"]).check()
    parse(["train", "--compile", "--compile-mode", "max-autotune-no-cudagraphs"]).check()
