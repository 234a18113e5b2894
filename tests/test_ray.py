"""Placement through Ray on this machine: two CPU engine actors and a trainer actor complete a run."""

import json

import pytest

from diffrl.launch.ray_placement import launch
from test_trainer import tiny_config

ray = pytest.importorskip("ray", reason="Ray is part of the test extras")


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_ray_places_two_engines_and_a_trainer_and_completes_a_step(tiny_model_dir, tmp_path, use_lora):
    """LoRA: each engine actor hosts the adapter and receives only its tensors."""
    out = tmp_path / "run"
    cfg = tiny_config(tiny_model_dir, out, ray_engines=2, local_engine=False, num_rollout=2, reward="shapes",
                      rollout_microgroup_size=1, engine_concurrency=2, use_lora=use_lora, lora_rank=2)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        last = launch(cfg)
    finally:
        ray.shutdown()
    assert last["train/pairs"] == 2 * 3 * 2 and last["train/log_prob_mean_abs_diff"] == 0.0
    assert all(batches > 0 for batches in last["ray/engine_batches"])  # both engines served requests
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in records] == [0, 1, 2] and (out / "checkpoints" / "rollout-00002").is_dir()
