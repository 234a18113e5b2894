"""Checkpoints whose transformer is drawn at load (`--weightless` of recipe_runs.py, WEIGHTLESS=1 of bench_recipes.sh): a
real-size model costs no disk. The transformer folder keeps its config (with the full depth) and a seed file; the
load builds the model with its default initialization from that seed, the same weights each time; a folder with both
weights and a seed file, or a corrupt seed, is a one-line load error."""

import dataclasses
import json

import pytest
import torch
from benchmark_scripts import load_benchmark

from diffrl.cli.bench import transformer_gflop
from diffrl.errors import ModelLoadError
from diffrl.models.checkpoint import load_model
from diffrl.models.components import RANDOM_INIT_FILE
from diffrl.models.random_checkpoints import flux3_image, make_weightless, wan2_2


@pytest.fixture
def family_rollout(monkeypatch):
    return load_benchmark("family_rollout", monkeypatch)


def _weights(family) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in family.transformer.named_parameters()}


def test_a_weightless_checkpoint_loads_the_full_depth_with_seeded_weights_and_samples(family_rollout, tmp_path):
    tiny = flux3_image.tiny()
    sizes = dataclasses.replace(tiny, transformer={**tiny.transformer, "num_layers": 2, "num_single_layers": 3})
    family_rollout.save_weightless(flux3_image, "flux3_image", sizes, tmp_path / "c")
    folder = tmp_path / "c" / "transformer"
    assert not [p for p in folder.iterdir() if p.suffix == ".safetensors"]
    assert json.loads((folder / RANDOM_INIT_FILE).read_text()) == {"seed": 0}
    config = json.loads((folder / "config.json").read_text())
    keys = family_rollout.DEPTH_KEYS["flux3_image"]
    assert {k: config[k] for k in keys} == {k: sizes.transformer[k] for k in keys} and all(config[k] > 1 for k in keys)
    rng = torch.get_rng_state()
    first, second = load_model(tmp_path / "c"), load_model(tmp_path / "c")
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's generator is left as it was
    assert len(first.transformer.single_transformer_blocks) == sizes.transformer["num_single_layers"] == 3
    a, b = _weights(first), _weights(second)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert any(t.abs().sum() > 0 for n, t in a.items() if n.endswith("weight"))
    stored = _weights(load_model(flux3_image.save_random_checkpoint(tmp_path / "stored", sizes)))
    assert stored.keys() == a.keys() and all(stored[n].shape == a[n].shape for n in a)  # the same model, unstored
    assert transformer_gflop(first, 1, first.default_size(), 1.0) > 0  # it runs a forward


def test_a_linked_expert_shares_the_first_experts_drawn_weights(family_rollout, tmp_path):
    family_rollout.save_weightless(wan2_2, "wan2_2", wan2_2.tiny(), tmp_path / "w", shared_experts=True)
    assert (tmp_path / "w" / "transformer_2").is_symlink()
    experts = load_model(tmp_path / "w").transformer
    a, b = (dict(m.named_parameters()) for m in (experts.transformer, experts.transformer_2))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_weights_beside_a_seed_file_or_a_corrupt_seed_are_refused_in_one_line(tmp_path):
    path = flux3_image.save_random_checkpoint(tmp_path / "c")
    folder = path / "transformer"
    (folder / RANDOM_INIT_FILE).write_text(json.dumps({"seed": 0}))
    with pytest.raises(ModelLoadError, match=f"{folder} holds {RANDOM_INIT_FILE} .* and weight files "
                                             r"\(diffusion_pytorch_model.safetensors\): remove one of them"):
        load_model(path)
    make_weightless(folder, {})
    for seed in ("0", -1, True, None):
        (folder / RANDOM_INIT_FILE).write_text(json.dumps({"seed": seed}))
        with pytest.raises(ModelLoadError, match="corrupt file: .*its seed must be an integer"):
            load_model(path)


def test_a_weightless_checkpoint_is_named_apart_and_refuses_a_depth(family_rollout, monkeypatch, tmp_path):
    recipe_runs = load_benchmark("recipe_runs", monkeypatch)
    assert recipe_runs.checkpoint_name("flux2-dev-edit-grpo-pickscore", weightless=True) == \
        "flux2-dev-weightless-random"
    with pytest.raises(SystemExit, match="full depth"):
        family_rollout.make_checkpoint("sd3", tmp_path / "x", torch.device("cpu"), depth=2, weightless=True)


def test_recipe_runs_builds_and_trains_on_a_weightless_checkpoint(monkeypatch, tmp_path):
    """The benchmark end to end at tiny size on the CPU: one rollout and its update, the JSON saying the weights were
    drawn at load."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    recipe_runs = load_benchmark("recipe_runs", monkeypatch)
    out = tmp_path / "run.json"
    try:
        recipe_runs.main(["--recipe", "cosmos3-grpo", "--checkpoint", str(tmp_path / "checkpoint"), "--tiny",
                          "--weightless", "--device", "cpu", "--work-dir", str(tmp_path / "work"),
                          "--rollout-batch-size", "1", "--num-rollout", "1", "--height", "16", "--width", "32",
                          "--num-frames", "5", "--out", str(out), "--flags",
                          json.dumps({"diffusion_num_steps": 4, "diffusion_sde_window_range": [0, 4],
                                      "n_samples_per_prompt": 2})])
    finally:
        torch.use_deterministic_algorithms(False)  # the recipe runs in deterministic mode
    report = json.loads(out.read_text())
    assert report["weightless"] and (tmp_path / "checkpoint" / "transformer" / RANDOM_INIT_FILE).is_file()
    assert report["rollouts"][0]["train_pairs"] > 0 and report["seconds_per_sample"] > 0
