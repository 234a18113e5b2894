"""--reward-colocate: model rewards move to host memory while the trainer trains and score the same after."""

import asyncio

import pytest
import torch
from test_model_rewards import IMAGES, PROMPTS, _save_tiny_clip

from diffrl.rewards import colocate, get_reward, model_rewards_in
from diffrl.rewards.workers import ProcessRewardPool
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer, validate_config


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("colocate") / "clip"
    _save_tiny_clip(path)
    return path


def test_an_offload_round_trip_scores_the_same(clip_dir):
    score = get_reward(f"clipscore@{clip_dir}", device="cpu")
    before = score(IMAGES, PROMPTS)
    params = list(score.__wrapped__.modules[0].parameters())
    where = [p.data_ptr() for p in params]
    assert colocate.sleep() >= sum(p.numel() * p.element_size() for p in params)
    # Between the points every parameter lives in a host copy (on a CPU: a fresh one, not the original storage).
    assert colocate.asleep() and all(p.device.type == "cpu" for p in params)
    assert all(p.data_ptr() != ptr for p, ptr in zip(params, where, strict=True))
    colocate.wake()
    assert not colocate.asleep()
    assert score(IMAGES, PROMPTS) == before  # bit for bit


def test_reward_workers_offload_their_own_copies(clip_dir):
    pool = ProcessRewardPool(f"pickscore@{clip_dir}", workers=2, device="cpu")
    try:
        async def score():
            return await asyncio.gather(pool(IMAGES[:2], PROMPTS[:2]), pool(IMAGES[2:], PROMPTS[2:]))

        before = asyncio.run(score())
        assert pool.sleep() > 0  # each worker took one message; those that loaded the model moved it
        assert pool.sleep() == 0  # already asleep
        assert pool.wake() > 0
        assert asyncio.run(score()) == before
    finally:
        pool.close()


def test_the_trainer_offloads_the_reward_while_it_trains(tiny_model_dir, clip_dir, tmp_path, monkeypatch):
    seen = []
    real = Trainer.update

    def spy(self, pairs, env):
        seen.append(colocate.asleep())
        return real(self, pairs, env)

    monkeypatch.setattr(Trainer, "update", spy)
    cfg = TrainConfig.flat(model_path=tiny_model_dir, output_dir=tmp_path / "run", num_rollout=2, rollout_batch_size=1,
                           n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=2,
                           diffusion_num_steps=2, eval_images_per_category=0, use_lora=False,
                           reward=f"clipscore@{clip_dir}", reward_device="cpu", reward_colocate=True)
    with pytest.raises(ValueError, match="--reward-device cpu"):
        validate_config(cfg)
    trainer = Trainer(cfg.replace(reward_device=None))
    last = trainer.train()
    assert seen == [True, True]  # asleep in both training phases
    assert colocate.asleep()  # and after the run's last sampling block
    assert torch.isfinite(torch.tensor(last["rollout/reward/raw_mean"]))
    colocate.wake()


def test_reward_colocate_needs_a_model_reward(tmp_path):
    assert model_rewards_in("multi:shapes=1,pickscore@/m/p,processor=/m/c=0.5,hpsv2@/m/h") == ["pickscore", "hpsv2"]
    assert model_rewards_in("shapes") == []
    with pytest.raises(ValueError, match="--reward-colocate .* --reward shapes has none"):
        validate_config(TrainConfig.flat(reward_colocate=True))
    with pytest.raises(ValueError, match="--ray-reward-workers"):
        validate_config(TrainConfig.flat(reward="pickscore@/m/p", reward_colocate=True, ray_engines=1,
                                         ray_reward_workers=1))
