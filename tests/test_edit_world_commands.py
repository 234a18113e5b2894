"""`diffrl evaluate` and `diffrl compare` of an editing-world run (`--world shapes-edit`): the task's own held-out
evaluation, at the run's sampling settings, per edit kind."""

import json

import pytest
import torch

from diffrl.cli.edit_world import folder_world
from diffrl.cli.main import main as cli_main
from diffrl.data.shapes import EDIT_KINDS
from diffrl.models.demo import SHIPPED_DEMO_MODEL, SHIPPED_EDIT_MODEL
from diffrl.models.random_checkpoints import demo as random_demo
from diffrl.train.trainer import train
from test_trainer import tiny_config


@pytest.fixture(scope="module")
def edit_model_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("edit-model") / "tiny-edit"
    random_demo.random_family(random_demo.tiny(), world="shapes-edit", seed=0).save(path)
    return path


@pytest.fixture
def edit_run(edit_model_dir, restorable_runs):
    """One rollout of a tiny random editing model on the editing world (CFG 2, 3 steps), evaluated before and
    after on 2 held-out edits of each kind."""
    return restorable_runs("edit-run", lambda run: train(tiny_config(
        edit_model_dir, run, world="shapes-edit", reward="shapes_edit", eval_images_per_category=2,
        diffusion_num_steps=3, resolution=64)))


def _jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evaluate_an_editing_run_repeats_its_held_out_evaluation(edit_run, tmp_path):
    out = tmp_path / "eval"
    assert cli_main(["evaluate", str(edit_run), "--device", "cpu", "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["world"] == "shapes-edit" and report["n_images"] == 2 * len(EDIT_KINDS)
    assert report["config"]["num_steps"] == "3" and report["config"]["guidance_scale"] == "2.0"
    assert report["config"]["checkpoint"].endswith("rollout-00001")
    last = [r for r in _jsonl(edit_run / "metrics.jsonl") if "eval/strict" in r][-1]
    for key in ["eval/strict", "eval/score"] + [f"eval/strict/{kind}" for kind in EDIT_KINDS]:
        assert report[key] == pytest.approx(last[key], abs=1e-9), key
    assert {kind: k["n"] for kind, k in report["kinds"].items()} == dict.fromkeys(EDIT_KINDS, 2)
    # The same edits at the same seeds, scored alike, image by image.
    mine, runs = _jsonl(out / "records.jsonl"), _jsonl(edit_run / "eval" / "rollout-00001" / "records.jsonl")
    assert [(r["prompt"], r["seed"], r["rewards"]) for r in mine] == [(r["prompt"], r["seed"], r["rewards"])
                                                                        for r in runs]
    assert (out / "grid.png").is_file() and (out / "images" / "00000.png").is_file()


def test_compare_an_editing_run_reports_each_kind(edit_run, tmp_path):
    out = tmp_path / "cmp"
    assert cli_main(["compare", str(edit_run), "--images-per-category", "2", "--device", "cpu",
                     "--output-dir", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["world"] == "shapes-edit" and report["guidance_scales"] == {"base": 2.0, "trained": 2.0}
    assert report["config"]["base"] == json.loads((edit_run / "config.json").read_text())["flags"]["model_path"]
    kinds = report["strict"]["categories"]
    assert list(kinds) == list(EDIT_KINDS)
    for row in kinds.values():
        assert row["n"] == 2 and {"base", "base_se", "trained", "trained_se", "difference", "difference_se",
                                  "verdict"} <= set(row)
    assert report["strict"]["per_sample"]["n"] == 8
    # The trained column is the run's own last held-out evaluation.
    last = [r for r in _jsonl(edit_run / "metrics.jsonl") if "eval/strict" in r][-1]
    assert report["trained"]["eval/score"] == pytest.approx(last["eval/score"], abs=1e-9)
    for name in ("report.md", "side_by_side.png", "base/records.jsonl", "trained/records.jsonl"):
        assert (out / name).is_file(), name
    assert "kind mean" in (out / "report.md").read_text()


def test_the_world_comes_from_the_model_and_text_to_image_flags_are_refused(edit_run, tmp_path, capsys):
    assert folder_world(SHIPPED_EDIT_MODEL, None) == "shapes-edit"
    assert folder_world(SHIPPED_DEMO_MODEL, None) == "shapes"
    assert cli_main(["evaluate", str(edit_run), "--num-seeds", "2", "--device", "cpu",
                     "--output-dir", str(tmp_path / "e")]) != 0
    assert "--num-seeds is for the shapes world" in capsys.readouterr().err
    assert cli_main(["evaluate", "--world", "shapes-edit", "--prompt-data", str(tmp_path), "--reward", "x",
                     "--device", "cpu", "--output-dir", str(tmp_path / "e2")]) != 0
    assert "--world shapes-edit is the world evaluated without --prompt-data" in capsys.readouterr().err
