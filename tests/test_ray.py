"""Placement through Ray on this machine: two CPU engine actors and a trainer actor complete a run;
two data-parallel trainer rank actors train as one process does."""

import json

import pytest

from diffrl.launch.ray_placement import launch
from diffrl.train.trainer import Trainer, validate_config
from test_trainer import tiny_config

ray = pytest.importorskip("ray", reason="Ray is part of the test extras")


# `lora-one-engine` is the default run's check of placement through Ray: every actor is a process importing diffrl,
# and on a loaded 2-core machine a second engine actor (with an evaluation at rollout 1) made the LoRA run ~1.7x as
# long. Spreading requests over engines is test_rollout_manager's (default run); two Ray engines are the slow variants'.
@pytest.mark.parametrize(("use_lora", "engines"), [pytest.param(False, 2, marks=pytest.mark.slow),
                                                   pytest.param(True, 2, marks=pytest.mark.slow), (True, 1)],
                         ids=["full", "lora", "lora-one-engine"])
def test_ray_places_two_engines_and_a_trainer_and_completes_a_step(tiny_model_dir, tmp_path, use_lora, engines):
    """LoRA: each engine actor hosts the adapter and receives only its tensors (rollout 2's exact log-probs:
    the update reached the engines). Full: two reward workers score the microgroups, and the run equals one
    without Ray (same seeds, same samples)."""
    out = tmp_path / "run"
    # Evaluated before training and after the last rollout; one at rollout 1 as well checked nothing more.
    flags = dict(num_rollout=2, reward="shapes", rollout_microgroup_size=1, engine_concurrency=2,
                 use_lora=use_lora, lora_rank=2, eval_interval=2)
    workers = 0 if use_lora else 2
    cfg = tiny_config(tiny_model_dir, out, ray_engines=engines, local_engine=False, ray_reward_workers=workers,
                      **flags)
    ray.init(num_cpus=6, include_dashboard=False, log_to_driver=False)
    try:
        last = launch(cfg)
    finally:
        ray.shutdown()
    assert last["train/pairs"] == 2 * 3 * 2 and last["train/log_prob_mean_abs_diff"] == 0.0
    assert len(last["ray/engine_batches"]) == engines
    assert all(batches > 0 for batches in last["ray/engine_batches"])  # every engine served requests
    assert len(last["ray/reward_batches"]) == workers and all(b > 0 for b in last["ray/reward_batches"])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in records] == [0, 1, 2] and (out / "checkpoints" / "rollout-00002").is_dir()
    if workers:
        Trainer(tiny_config(tiny_model_dir, tmp_path / "plain", **flags)).train()
        plain = [json.loads(line) for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines()]
        for a, b in zip(plain[1:], records[1:], strict=True):
            assert b["rollout/reward/raw_mean"] == pytest.approx(a["rollout/reward/raw_mean"], rel=1e-6)
            assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)


# Covered in the default run by test_ray_places_two_engines_and_a_trainer_and_completes_a_step[lora] (a run placed
# through Ray) and test_parallel.py::test_two_rank_training_run_matches_one_process[grpo] (two FSDP2 ranks equal one
# process); this is their costlier combination: two Ray actors each importing diffrl.
@pytest.mark.slow
def test_ray_places_two_data_parallel_trainer_ranks(tiny_model_dir, tmp_path):
    """Two trainer rank actors form a gloo process group and train with FSDP2, each rolling out its
    share on its own engine: the same samples, losses and gradient norms as one process."""
    flags = dict(num_rollout=2, reward="shapes", loss_type="nft", rollout_batch_size=2, n_samples_per_prompt=3,
                 global_batch_size=6, num_steps_per_rollout=1, micro_batch_size=64, diffusion_guidance_scale=1.0,
                 eval_interval=2, eval_images_per_category=1, checkpoint_interval=2)
    out = tmp_path / "ray"
    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        last = launch(tiny_config(tiny_model_dir, out, ray_trainer_ranks=2, **flags))
    finally:
        ray.shutdown()
    assert last["ray/world_size"] == 2
    Trainer(tiny_config(tiny_model_dir, tmp_path / "plain", **flags)).train()
    plain, ranks = ([json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                    for run in (tmp_path / "plain", out))
    assert len(plain) == len(ranks) == 3  # the evaluation before training, then two rollouts
    assert ranks[1]["rollout/reward/raw_mean"] == plain[1]["rollout/reward/raw_mean"]  # the same samples
    for a, b in zip(plain[1:], ranks[1:], strict=True):
        assert b["rollout/reward/raw_mean"] == pytest.approx(a["rollout/reward/raw_mean"], rel=1e-6)
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5)
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)


def test_ray_placement_flags_are_checked(tiny_model_dir, tmp_path):
    with pytest.raises(ValueError, match="--ray-reward-workers"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "run", ray_reward_workers=2))
    with pytest.raises(ValueError, match="--ray-trainer-ranks"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "run", ray_trainer_ranks=2, ray_engines=2))
    with pytest.raises(ValueError, match="--ray-trainer-ranks"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "run", ray_trainer_ranks=0))
    validate_config(tiny_config(tiny_model_dir, tmp_path / "run", ray_trainer_ranks=2, ray_reward_workers=1))


class _Handle:
    """A Ray actor handle's calling convention (`await handle.method.remote(...)`) over the plain object."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        import inspect
        import types

        async def call(*args):
            out = getattr(self.obj, name)(*args)
            return await out if inspect.isawaitable(out) else out

        return types.SimpleNamespace(remote=call)


@pytest.mark.parametrize("placed", ["in_process", pytest.param("ray", marks=pytest.mark.slow)])
def test_ray_reward_actors_score_a_video_as_in_process_scoring(placed):
    """--ray-reward-workers with --reward-frames K: the actors were shown K frames, temporal parts included, so a
    temporal reward compared K frames where in-process scoring and --reward-workers compare them all. The
    actors now apply K as the pool's workers do: the same scores; a frame-scoring reward alone gets K frames sent.
    `in_process`: the actor and pool code through a stand-in handle; `ray`: real actors."""
    import asyncio

    import torch

    from diffrl.launch.ray_placement import RayRewardPool, RewardActor
    from diffrl.rewards import get_reward
    from diffrl.rewards.frames import on_frames
    from test_temporal_reward import _panning

    spec = "multi:temporal_consistency=1,jpeg_compressibility=0.5"
    videos = torch.cat([_panning(n_frames=9, step=2), _panning(n_frames=9, step=5)])
    inline = asyncio.run(on_frames(get_reward(spec, device="cpu"), 3)(videos, ["a", "b"]))
    jpeg = on_frames(get_reward("jpeg_compressibility"), 3)(videos, ["a", "b"])
    if placed == "ray":
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        actor = ray.remote(RewardActor).remote
    else:
        def actor(*args):
            return _Handle(RewardActor(*args))
    try:
        pool = RayRewardPool([actor(spec, "cpu", 3)], frames=3)
        frame_pool = RayRewardPool([actor("jpeg_compressibility", "cpu", 3)], frames=3)
        assert asyncio.run(on_frames(pool, 3)(videos, ["a", "b"])) == pytest.approx(inline, abs=1e-6)
        assert asyncio.run(on_frames(frame_pool, 3)(videos, ["a", "b"])) == pytest.approx(jpeg, abs=1e-6)
        assert pool._whole_videos is True and frame_pool._whole_videos is False  # 9 frames sent, then 3
    finally:
        if placed == "ray":
            ray.shutdown()
