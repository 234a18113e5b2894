"""Shallow random checkpoints (benchmarks/family_rollout.py `shallow`, `--depth` of recipe_runs.py): each family's
block counts are the keywords its transformer class takes, and a checkpoint built with them has exactly that many
blocks of each kind and nothing else changed; recipe_runs names such a checkpoint apart from the full-depth one."""

import importlib
import json

import pytest
from benchmark_scripts import load_benchmark

FAST = {"sd3", "flux3_image", "cosmos3"}


@pytest.fixture
def family_rollout(monkeypatch):
    return load_benchmark("family_rollout", monkeypatch)


@pytest.mark.parametrize("family", [f if f in FAST else pytest.param(f, marks=pytest.mark.slow) for f in
                                    ["sd3", "flux3_image", "flux1", "flux2", "krea2", "qwen_image", "qwen_image21",
                                     "wan2_2", "ltx2", "cosmos3", "z_image"]])
def test_a_shallow_checkpoint_has_one_block_of_each_kind(family_rollout, tmp_path, family):
    module = importlib.import_module(f"diffrl.models.random_checkpoints.{family}")
    sizes = module.tiny()
    shallow = family_rollout.shallow(sizes, family, 1)
    keys = family_rollout.DEPTH_KEYS[family]
    assert {k: v for k, v in shallow.transformer.items() if k not in keys} == \
        {k: v for k, v in sizes.transformer.items() if k not in keys}
    module.save_random_checkpoint(tmp_path / "c", shallow)
    config = json.loads((tmp_path / "c" / "transformer" / "config.json").read_text())
    assert {k: config[k] for k in keys} == dict.fromkeys(keys, 1)


def test_every_real_size_family_can_be_made_shallow(family_rollout):
    assert set(family_rollout.REAL_SIZES) - set(family_rollout.DEPTH_KEYS) <= {"cogview4", "lumina2", "sana"}
    with pytest.raises(SystemExit, match="sana"):
        family_rollout.shallow(None, "sana", 2)


def test_a_shallow_checkpoint_is_named_apart(monkeypatch):
    recipe_runs = load_benchmark("recipe_runs", monkeypatch)
    assert recipe_runs.checkpoint_name("wan22-i2v-grpo-pickscore", 2) == "wan2_2-i2v-depth2-random"
    assert recipe_runs.checkpoint_name("cosmos3-grpo", 2) == "cosmos3-depth2-random"
    assert recipe_runs.checkpoint_name("cosmos3-grpo") == "cosmos3-random"
