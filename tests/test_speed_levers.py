"""benchmarks/speed_levers.py, the Python side of scripts/device/speed_levers.sh: each configuration's flags,
the best combination from measured runs, and the tables read from real runs' metrics (tiny models, CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import speed_levers  # noqa: E402

from diffrl.train.config import TrainConfig  # noqa: E402


def test_every_configuration_has_flags_the_commands_accept(tmp_path):
    assert speed_levers.flags_of("train", "base", tmp_path) == []
    assert speed_levers.flags_of("train", "cudnn", tmp_path) == ["--attention-backend", "cudnn"]
    assert speed_levers.flags_of("engine", "base", tmp_path) == []
    assert speed_levers.flags_of("engine", "fuse-qkv", tmp_path) == ["--fuse-qkv", "--no-pipeline"]
    with pytest.raises(SystemExit, match="unknown train configuration 'fast'"):
        speed_levers.flags_of("train", "fast", tmp_path)
    from diffrl.cli.main import parse

    for name, lever in speed_levers.TRAIN.items():  # each parses as `diffrl bench-train` flags
        cfg = parse(["bench-train", "--recipe", "sd3-grpo", "--compile", *lever.flags]).train
        assert isinstance(cfg, TrainConfig), name
        cfg.check()


def _metrics(run: Path, rollouts: list[tuple[float, float, float]]) -> None:
    """A run folder whose metrics hold rollouts of 16 samples and 144 pairs: (rollout s, train s, |Δ log p|)."""
    run.mkdir(parents=True)
    records = [{"rollout": 0}]
    for k, (rollout_s, train_s, diff) in enumerate(rollouts, 1):
        records.append({"rollout": k, "rollout/seconds": rollout_s, "rollout/images_per_s": 16 / rollout_s,
                        "train/seconds": train_s, "train/pairs": 144, "memory/peak_gib": 30.0,
                        "train/log_prob_mean_abs_diff": diff, "train/first_pass_clipfrac": 0.1})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    run.with_name(run.name + ".rc").write_text("0\n")


def test_the_combination_takes_the_best_lever_of_each_group_that_keeps_exactness(tmp_path):
    first = (60.0, 80.0, 5e-5)  # compilation: never counted
    _metrics(tmp_path / "train-base", [first, (2.5, 5.0, 5e-5)])
    _metrics(tmp_path / "train-cudnn", [first, (2.3, 4.5, 6e-5)])  # -10%: in
    _metrics(tmp_path / "train-flash", [first, (2.4, 4.9, 5e-5)])  # -2.7%, beaten by cudnn in its group
    _metrics(tmp_path / "train-vae-all", [first, (2.49, 5.0, 5e-5)])  # -0.1%: out
    _metrics(tmp_path / "train-no-eager-numerics", [first, (2.2, 4.4, 2.2e-4)])  # faster, but 4x the drift: out
    _metrics(tmp_path / "train-fuse-qkv", [first, (2.0, 4.0, 5e-5)])  # -20%: in
    (tmp_path / "train-autotune.rc").write_text("124\n")  # timed out before any rollout
    flags, reasons = speed_levers.combination(tmp_path, "train")
    assert flags == ["--attention-backend", "cudnn", "--fuse-qkv"]
    assert any(r.startswith("no-eager-numerics:") and "left out" in r for r in reasons)
    assert "autotune: no result (rc 124)" in reasons
    table = speed_levers.report(tmp_path)
    base_row = next(line for line in table.splitlines() if line.startswith("| base |"))
    assert "| 0.156 | 34.7 | 0.469 |" in base_row  # 2.5 s / 16 images, 5 s / 144 pairs, 7.5 s / 16 samples
    assert "| 140 |" in base_row  # the first rollout with its compilation, seconds
    assert "| fuse-qkv | --fuse-qkv | 0.125 | 27.8 | 0.375 | -20.0% |" in table
    assert "| autotune | --compile-mode max-autotune-no-cudagraphs | – |" in table and "timed out" in table


def test_no_base_means_no_combination(tmp_path):
    assert speed_levers.combination(tmp_path, "train")[0] == []
    assert speed_levers.report(tmp_path) == f"no results under {tmp_path}"


def test_tables_read_real_runs(tiny_model_dir, tmp_path):
    """A real (tiny, CPU) `diffrl bench-train` run and a real `diffrl bench` run read back into the tables."""
    from diffrl.cli.bench import BenchConfig, bench
    from diffrl.cli.bench_train import BenchTrainConfig, bench_train
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
    from test_trainer import tiny_config

    directory = tmp_path / "levers"
    run = directory / "train-base"
    bench_train(BenchTrainConfig(train=tiny_config(tiny_model_dir, run, num_rollout=2, eval_images_per_category=0,
                                                   val_images_per_category=0)))
    (directory / "train-base.rc").write_text("0\n")
    result = speed_levers.train_result(run)
    assert result["rc"] == 0 and result["steady_rollouts"] == [2]
    assert result["steady"]["sample_s"] > 0 and result["steady"]["first_pass_log_prob_abs_diff"] == 0.0
    model = save_random_checkpoint(tmp_path / "sd3-tiny")
    bench(BenchConfig(model_path=model, device="cpu", dtype="float32", resolution=32, n=2, ms=(2,), steps=2, repeats=1,
                      guidance_scale=4.5, out=directory / "engine-base.json"))
    bench(BenchConfig(model_path=model, device="cpu", dtype="float32", resolution=32, n=2, ms=(2,), steps=2, repeats=1,
                      guidance_scale=4.5, fuse_qkv=True, vae_decode_batch=0, reference_pipeline=False,
                      out=directory / "engine-fuse-qkv.json"))
    assert json.loads((directory / "engine-fuse-qkv.json").read_text())["fuse_qkv"] is True
    table = speed_levers.report(directory)
    base = next(line for line in table.splitlines() if line.startswith("| base |") and "2: " in line)
    assert base.count("| – |") <= 2  # engine, vs, step, decode, pipeline filled (peak: CPU; vs: base itself)
    assert "| fuse-qkv | --fuse-qkv | 2: " in table
    assert speed_levers.main(["table", "--dir", str(directory), "--out", str(tmp_path / "t.md")]) == 0
    assert (tmp_path / "t.md").read_text().strip() == table.strip()


def test_sdpa_choice_names_the_kernels():
    choice = speed_levers.sdpa_choice(batch=1, tokens=16, heads=2, head_dim=8)
    assert choice["auto_picks"] in choice["usable"] and choice["usable"]["MATH"]


def test_the_device_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(ROOT / "scripts/device/speed_levers.sh")], check=True)


def test_a_combo_row_shows_the_flags_its_run_had(tmp_path):
    _metrics(tmp_path / "train-base", [(60.0, 80.0, 5e-5), (2.5, 5.0, 5e-5)])
    _metrics(tmp_path / "train-combo", [(60.0, 80.0, 5e-5), (2.0, 4.0, 5e-5)])
    (tmp_path / "train-combo.flags").write_text("--attention-backend\ncudnn\n")
    table = speed_levers.report(tmp_path)
    assert "| combo | --attention-backend cudnn | 0.125 |" in table and "the combo run had: --attention-backend cudnn" in table
