"""Placement through Ray on this machine: two CPU engine actors and a trainer actor complete a run."""

import json

import pytest

from diffrl.launch.ray_placement import launch
from diffrl.train.trainer import Trainer, validate_config
from test_trainer import tiny_config

ray = pytest.importorskip("ray", reason="Ray is part of the test extras")


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_ray_places_two_engines_and_a_trainer_and_completes_a_step(tiny_model_dir, tmp_path, use_lora):
    """LoRA: each engine actor hosts the adapter and receives only its tensors. Full: two reward
    workers score the microgroups, and the run equals one without Ray (same seeds, same samples)."""
    out = tmp_path / "run"
    flags = dict(num_rollout=2, reward="shapes", rollout_microgroup_size=1, engine_concurrency=2,
                 use_lora=use_lora, lora_rank=2)
    workers = 0 if use_lora else 2
    cfg = tiny_config(tiny_model_dir, out, ray_engines=2, local_engine=False, ray_reward_workers=workers, **flags)
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        last = launch(cfg)
    finally:
        ray.shutdown()
    assert last["train/pairs"] == 2 * 3 * 2 and last["train/log_prob_mean_abs_diff"] == 0.0
    assert all(batches > 0 for batches in last["ray/engine_batches"])  # both engines served requests
    assert len(last["ray/reward_batches"]) == workers and all(b > 0 for b in last["ray/reward_batches"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in records] == [0, 1, 2] and (out / "checkpoints" / "rollout-00002").is_dir()
    if workers:
        Trainer(tiny_config(tiny_model_dir, tmp_path / "plain", **flags)).train()
        plain = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
        for a, b in zip(plain[1:], records[1:], strict=True):
            assert b["rollout/reward/raw_mean"] == pytest.approx(a["rollout/reward/raw_mean"], rel=1e-6)
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)


def test_reward_workers_need_ray_engines(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="--ray-reward-workers"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "run", ray_reward_workers=2))
