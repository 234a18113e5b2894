"""What a run folder's config.json decides after training (issue 41, "the user's path after the demo"): the CFG,
family, size and LoRA that `diffrl evaluate RUN`, `diffrl compare RUN` and `diffrl train --resume` use are the run's,
checked on what the commands sampled rather than on a figure that could match by chance; and `train` / `pretrain`
leave a folder holding something else untouched."""

import json

import pytest
from PIL import Image

import diffrl.cli.compare as compare_cli
import diffrl.cli.evaluate as evaluate_cli
from diffrl.cli.main import main as cli_main
from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
from diffrl.models.sd3 import SD3Family
from diffrl.train.trainer import train
from test_trainer import tiny_config

RUN_SIZE = 16  # the tiny SD3 checkpoint's own size is 32: a run at 16 is told apart from the family's default


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _spy_loads(monkeypatch, module):
    """The models `module`'s commands load: (the family asked for, the family loaded, whether a LoRA adapter is on
    its transformer). The family asked for counts: the tiny SD3 checkpoint would be detected as sd3 anyway."""
    loaded, real = [], module.load_model

    def load_model(*args, **kwargs):
        model = real(*args, **kwargs)
        lora = any("lora_A" in name for name, _ in model.transformer.named_modules())
        loaded.append((kwargs.get("family"), model.name, lora))
        return model

    monkeypatch.setattr(module, "load_model", load_model)
    return loaded


def _image_sizes(folder):
    return {Image.open(p).size for p in folder.glob("*.png")}


@pytest.fixture
def no_cfg_run(module_tiny_model_dir, restorable_runs):
    """A one-rollout shapes run of the tiny demo model trained without CFG (guidance 1.0), evaluated on 2 held-out
    images per category."""
    return restorable_runs("no-cfg", lambda run: train(tiny_config(
        module_tiny_model_dir, run, eval_images_per_category=2, diffusion_guidance_scale=1.0)))


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    path = save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny")
    assert SD3Family.load(path).default_size() == (32, 32) != (RUN_SIZE, RUN_SIZE)
    return path


@pytest.fixture
def sd3_lora_run(sd3_dir, restorable_runs, tmp_path_factory):
    """A one-rollout LoRA run of a tiny SD3 checkpoint on a prompt set, at 16² (not the checkpoint's 32²), no CFG,
    with its family given by flag: every setting the commands must read back differs from what they would pick."""
    prompts = tmp_path_factory.getbasetemp() / "sd3-prompts"
    prompts.mkdir(exist_ok=True)
    (prompts / "train.txt").write_text("a red circle\na blue square\n")
    (prompts / "test.txt").write_text("a green circle\na red square\n")
    return restorable_runs("sd3-lora", lambda run: train(tiny_config(
        sd3_dir, run, prompt_data=prompts, eval_num_prompts=2, val_images_per_category=0, use_lora=True,
        resolution=RUN_SIZE, diffusion_model_family="sd3", diffusion_guidance_scale=1.0, diffusion_num_steps=2,
        diffusion_sde_window_range=(0, 2), diffusion_num_sde_steps=1, device="cpu")))


def test_a_run_trained_without_cfg_is_evaluated_and_compared_without_it(no_cfg_run, tmp_path, capsys, monkeypatch):
    """The shapes evaluation's own default is CFG 3: a run trained at 1.0 must be sampled at 1.0, both models."""
    assert evaluate_cli.SHAPES_GUIDANCE_SCALE != 1.0
    sampled = []
    real = evaluate_cli.evaluate_prompts

    def evaluate_prompts(*args, **kwargs):
        sampled.append(kwargs["guidance_scale"])
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_cli, "evaluate_prompts", evaluate_prompts)
    out = tmp_path / "eval"
    assert cli_main(["evaluate", str(no_cfg_run), "--device", "cpu", "--output-dir", str(out)]) == 0
    assert sampled == [1.0]
    assert "CFG 1.0," in capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["guidance_scale"] == "1.0"
    last = [r for r in _records(no_cfg_run) if "eval/strict" in r][-1]
    assert report["overall_strict"] == pytest.approx(last["eval/strict"], abs=1e-6)
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(no_cfg_run), "--images-per-category", "2", "--device", "cpu",
                     "--output-dir", str(out)]) == 0
    assert json.loads((out / "report.json").read_text())["guidance_scales"] == {"base": 1.0, "trained": 1.0}
    assert "CFG base 1 / trained 1" in capsys.readouterr().out
    # A flag still wins over the run's value.
    out = tmp_path / "eval-cfg"
    assert cli_main(["evaluate", str(no_cfg_run), "--guidance-scale", "2", "--device", "cpu",
                     "--output-dir", str(out)]) == 0
    assert sampled[-1] == 2.0


def test_evaluate_a_lora_run_uses_its_family_size_and_adapter(sd3_lora_run, tmp_path, capsys, monkeypatch):
    loaded = _spy_loads(monkeypatch, evaluate_cli)
    out = tmp_path / "eval"
    assert cli_main(["evaluate", str(sd3_lora_run), "--device", "cpu", "--output-dir", str(out)]) == 0
    assert loaded == [("sd3", "sd3", True)]  # the run's family, its checkpoint's adapter on it
    assert "CFG 1.0," in capsys.readouterr().out  # not the family's default CFG
    assert _image_sizes(out / "images") == {(RUN_SIZE, RUN_SIZE)}
    # The evaluation repeats the run's last held-out one (the adapter's weights, not the base's).
    last = [r for r in _records(sd3_lora_run) if "eval/reward" in r][-1]
    assert json.loads((out / "report.json").read_text())["eval/reward"] == pytest.approx(last["eval/reward"], abs=1e-6)
    # A size flag given overrides the run's.
    out = tmp_path / "eval-8"
    assert cli_main(["evaluate", str(sd3_lora_run), "--resolution", "8", "--device", "cpu",
                     "--output-dir", str(out)]) == 0
    assert _image_sizes(out / "images") == {(8, 8)}


def test_compare_a_lora_run_uses_its_family_size_and_adapter(sd3_lora_run, tmp_path, monkeypatch):
    loaded = _spy_loads(monkeypatch, compare_cli)
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(sd3_lora_run), "--device", "cpu", "--output-dir", str(out)]) == 0
    assert loaded == [("sd3", "sd3", False), ("sd3", "sd3", True)]  # the base, then the run's adapter on it
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["diffusion_model_family"] == "sd3" and report["config"]["resolution"] == str(RUN_SIZE)
    assert report["guidance_scales"]["trained"] == 1.0
    for column in ("base_cfg", "base_nocfg", "trained"):
        assert _image_sizes(out / column / "images") == {(RUN_SIZE, RUN_SIZE)}, column


def test_resume_a_lora_run_keeps_its_family_size_and_adapter(sd3_lora_run, capsys):
    before = json.loads((sd3_lora_run / "config.json").read_text())["flags"]
    assert cli_main(["train", "--resume", "--output-dir", str(sd3_lora_run), "--num-rollout", "2"]) == 0
    assert "resumed from" in capsys.readouterr().out
    flags = json.loads((sd3_lora_run / "config.json").read_text())["flags"]
    for name in ("model_path", "diffusion_model_family", "resolution", "use_lora", "diffusion_guidance_scale",
                 "prompt_data"):
        assert flags[name] == before[name], name
    assert flags["resolution"] == RUN_SIZE and flags["use_lora"] is True and flags["num_rollout"] == 2
    assert (sd3_lora_run / "checkpoints" / "rollout-00002" / "lora").is_dir()
    assert max(r["rollout"] for r in _records(sd3_lora_run)) == 2


def _snapshot(folder):
    """Every path under `folder` with its bytes and modification time, and the folder's own (a file added or
    removed changes it)."""
    files = {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
             for p in sorted(folder.rglob("*"))}
    return files, folder.stat().st_mtime_ns


@pytest.mark.parametrize("command", [
    ["train", "--recipe", "shapes-nft", "--device", "cpu", "--num-rollout", "1"],
    ["pretrain", "--steps", "1", "--device", "cpu"],
])
def test_train_and_pretrain_leave_a_folder_holding_files_untouched(tmp_path, capsys, command):
    """A non-empty --output-dir without --resume is refused in one line naming --resume and --output-dir, and
    nothing in it changes. (train and pretrain have no --overwrite: evaluate and compare do.)"""
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("mine\n")
    (out / "sub" / "metrics.jsonl").write_text('{"rollout": 1}\n')
    before = _snapshot(out)
    assert cli_main([*command, "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {out} is not empty; pass --resume to continue it or choose another --output-dir"
    assert _snapshot(out) == before
