"""A run folder is what evaluate, compare and train --resume take: its config.json supplies the settings."""

import json

import pytest

from diffrl.cli.main import main as cli_main
from diffrl.train.trainer import train
from test_trainer import tiny_config


@pytest.fixture
def tiny_run(module_tiny_model_dir, restorable_runs):
    """A one-rollout run of the tiny model (full finetune, CFG 2, 3 steps), evaluated before and after on
    2 held-out images per category: trained once for the module, each test gets its own copy."""
    return restorable_runs("run", lambda run: train(tiny_config(module_tiny_model_dir, run, eval_images_per_category=2,
                                                                    diffusion_num_steps=3)))


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_evaluate_a_run_folder_repeats_its_held_out_evaluation(tiny_run, tmp_path, capsys):
    """`diffrl evaluate RUN` needs no other flag: the run's base model, steps, CFG and held-out images (the last
    evaluation's figures come back exactly); a flag given wins over the run's value."""
    out = tmp_path / "eval"
    assert cli_main(["evaluate", str(tiny_run), "--device", "cpu", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["num_steps"] == "3" and report["config"]["guidance_scale"] == "2.0"
    assert report["config"]["checkpoint"].endswith("rollout-00001")
    last = [r for r in _records(tiny_run) if "eval/score" in r][-1]
    assert report["overall_strict"] == pytest.approx(last["eval/strict"], abs=1e-6)
    assert report["overall_score"] == pytest.approx(last["eval/score"], abs=1e-6)
    # A checkpoint inside the run reads the same settings; a flag overrides one of them.
    out2 = tmp_path / "eval2"
    assert cli_main(["evaluate", "--checkpoint", str(tiny_run / "checkpoints" / "rollout-00001"), "--num-steps", "2",
                     "--device", "cpu", "--output-dir", str(out2)]) == 0
    config = json.loads((out2 / "report.json").read_text())["config"]
    assert config["num_steps"] == "2" and config["guidance_scale"] == "2.0"


def test_a_checkpoint_outside_its_run_takes_explicit_flags(tiny_run, tiny_model_dir, tmp_path):
    import shutil

    loose = tmp_path / "loose"
    shutil.copytree(tiny_run / "checkpoints" / "rollout-00001", loose)
    out = tmp_path / "eval"
    assert cli_main(["evaluate", "--checkpoint", str(loose), "--model-path", str(tiny_model_dir), "--num-steps", "2",
                     "--num-seeds", "1", "--max-prompts-per-category", "1", "--device", "cpu",
                     "--output-dir", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["config"]["guidance_scale"] == "3.0"  # no run: the default


def test_compare_a_run_folder_uses_its_base_and_sampling(tiny_run, tmp_path):
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(tiny_run), "--num-prompts", "3", "--device", "cpu",
                     "--output-dir", str(out)]) == 0
    config = json.loads((out / "report.json").read_text())["config"]
    assert config["base"] == json.loads((tiny_run / "config.json").read_text())["flags"]["model_path"]
    assert config["num_steps"] == "3" and config["trained_guidance_scale"] == "2.0"


def test_a_prompt_set_runs_folder_gives_its_prompts_and_reward(tiny_model_dir, tmp_path):
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.txt").write_text("a red circle\na blue square\n")
    (tmp_path / "prompts" / "test.txt").write_text("a green circle\na red square\na blue circle\n")
    run = tmp_path / "run"
    train(tiny_config(tiny_model_dir, run, prompt_data=tmp_path / "prompts", eval_num_prompts=2,
                      diffusion_guidance_scale=1.0, val_images_per_category=0))
    out = tmp_path / "eval"
    assert cli_main(["evaluate", str(run), "--device", "cpu", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "report.json").read_text())
    last = [r for r in _records(run) if "eval/reward" in r][-1]
    assert summary["eval/reward"] == pytest.approx(last["eval/reward"], abs=1e-6)
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(run), "--guidance-scale", "2", "--device", "cpu", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["guidance_scales"]["trained"] == 1.0 and report["totals"]["prompts"] == 2


def test_resume_a_run_folder_with_no_other_flags(tiny_run, capsys):
    """`diffrl train --resume --output-dir RUN` continues with the run's own settings; a flag given overrides."""
    assert cli_main(["train", "--resume", "--output-dir", str(tiny_run), "--num-rollout", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out
    flags = json.loads((tiny_run / "config.json").read_text())["flags"]
    assert flags["num_rollout"] == 2 and flags["diffusion_num_steps"] == 3 and flags["eval_images_per_category"] == 2
    assert max(r["rollout"] for r in _records(tiny_run)) == 2


def test_config_file_and_print_config(tiny_run, tmp_path, capsys):
    """--config takes a run's config.json, or YAML of the same tree or flat names; --print-config prints the
    resolved configuration (the flags on top) and exits; an unknown setting is one line naming the file."""
    assert cli_main(["train", "--config", str(tiny_run / "config.json"), "--lr", "0.5", "--print-config"]) == 0
    printed = json.loads(capsys.readouterr().out)
    run_flags = json.loads((tiny_run / "config.json").read_text())["flags"]
    assert printed["flags"]["lr"] == 0.5 and printed["flags"]["model_path"] == run_flags["model_path"]
    assert printed["flags"]["output_dir"] is None  # another run's settings start a new folder
    (tmp_path / "c.yaml").write_text("rollout:\n  diffusion_num_steps: 7\nlr: 0.25\nlora_target_modules: [a, b]\n")
    assert cli_main(["train", "--config", str(tmp_path / "c.yaml"), "--print-config"]) == 0
    flags = json.loads(capsys.readouterr().out)["flags"]
    assert flags["diffusion_num_steps"] == 7 and flags["lr"] == 0.25 and flags["lora_target_modules"] == ["a", "b"]
    (tmp_path / "bad.json").write_text('{"learning_rate": 1}')
    assert cli_main(["train", "--config", str(tmp_path / "bad.json")]) == 2
    assert "unknown training setting(s) learning_rate" in capsys.readouterr().err


def test_compare_reports_counts_errors_and_a_verdict_only_beyond_them(tiny_run, tmp_path, capsys):
    """By default compare judges the run's held-out images (its CFG, steps, seeds): the figures match the run's
    first and last evaluation, every figure has its count and standard error, and the verdict is "no measurable
    difference" unless the difference exceeds two standard errors."""
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(tiny_run), "--device", "cpu", "--output-dir", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    strict = report["strict"]
    evals = [r for r in _records(tiny_run) if "eval/strict" in r]
    assert strict["category_mean"]["base"] == pytest.approx(evals[0]["eval/strict"], abs=1e-6)
    assert strict["category_mean"]["trained"] == pytest.approx(evals[-1]["eval/strict"], abs=1e-6)
    assert strict["per_sample"]["n"] == report["images"] == sum(c["n"] for c in strict["categories"].values())
    assert all({"n", "base_se", "trained_se", "difference_se", "verdict"} <= set(c) for c in strict["categories"].values())
    d = strict["per_sample"]
    expected = ("no measurable difference" if abs(d["difference"]) <= 2 * d["difference_se"]
                else "better" if d["difference"] > 0 else "worse")
    assert d["verdict"] == expected and f"verdict over {d['n']} images: {expected}" in printed
    assert f"on {report['images']} images" in printed


def test_verdict_rules():
    from diffrl.evaluation.compare import verdict

    assert verdict(0.05, 0.03, 100) == "no measurable difference"
    assert verdict(0.07, 0.03, 100) == "better" and verdict(-0.07, 0.03, 100) == "worse"
    assert verdict(1.0, 0.0, 1) == "no measurable difference"  # one pair: no error to judge by


def test_evaluate_and_compare_never_replace_results_silently(tiny_run, tmp_path, capsys, monkeypatch):
    """An --output-dir holding results is refused in one line naming --overwrite (before any sampling); --overwrite
    replaces them; without --output-dir each call writes a new runs/<kind>-<run>-<date-time> folder."""
    out = tmp_path / "eval"
    out.mkdir()
    (out / "report.json").write_text("{}")
    for command in ("evaluate", "compare"):
        assert cli_main([command, str(tiny_run), "--device", "cpu", "--output-dir", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --output-dir {out} already holds results; pass --overwrite to replace them, or " \
                      "another --output-dir"
        assert (out / "report.json").read_text() == "{}"
    assert cli_main(["evaluate", str(tiny_run), "--device", "cpu", "--output-dir", str(out), "--overwrite"]) == 0
    assert json.loads((out / "report.json").read_text())["n"] > 0
    monkeypatch.chdir(tmp_path)
    assert cli_main(["evaluate", str(tiny_run), "--device", "cpu"]) == 0
    made = list((tmp_path / "runs").iterdir())
    assert len(made) == 1 and made[0].name.startswith("eval-run-") and (made[0] / "report.json").is_file()
