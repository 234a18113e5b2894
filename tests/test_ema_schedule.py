"""`--use-ema` with `--ema-update-interval N` (an update every N optimizer steps) and `--ema-warmup W` (the u-th update
decays by min(--ema-decay, u / (W + u − 1)), diffusers' and timm's warm-up): checked against the formula by hand."""

import pytest
import torch

from diffrl.train.config import TrainConfig
from diffrl.train.ema import warmed_up_decay
from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


def test_the_warm_up_by_hand():
    assert [warmed_up_decay(0.9, u, 10) for u in (1, 2, 3)] == pytest.approx([1 / 10, 2 / 11, 3 / 12])
    assert warmed_up_decay(0.9, 1000, 10) == 0.9 and warmed_up_decay(0.9, 1, 0) == 0.9


def test_the_evaluation_ema_follows_the_interval_and_the_warm_up(tiny_model_dir, tmp_path, monkeypatch):
    """Four optimizer steps (two rollouts of two); the EMA is updated after steps 2 and 4 only, with the decays of its
    first and second updates; replayed here from the weights after each step."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", use_ema=True, ema_decay=0.9, ema_update_interval=2,
                      ema_warmup=3, num_rollout=2)
    trainer = Trainer(cfg)
    policy = trainer.policy
    expected = [p.detach().clone() for p in policy.params]
    real_step = type(policy.optimizer).step
    after = []

    def spy(self, *args, **kwargs):
        out = real_step(self, *args, **kwargs)
        after.append([p.detach().clone() for p in policy.params])
        return out

    monkeypatch.setattr(type(policy.optimizer), "step", spy)
    trainer.rollout_and_update(0)
    trainer.rollout_and_update(1)
    assert len(after) == 4 and policy.weight_version == 4
    for update, weights in ((1, after[1]), (2, after[3])):
        decay = min(0.9, update / (3 + update - 1))  # 1/3, then 2/4
        expected = [decay * e + (1 - decay) * w for e, w in zip(expected, weights, strict=True)]
    for shadow, value in zip(policy.eval_ema.shadow, expected, strict=True):
        torch.testing.assert_close(shadow, value, rtol=1e-6, atol=1e-7)


def test_the_schedule_flags_need_an_ema():
    with pytest.raises(ValueError, match="--ema-update-interval and --ema-warmup shape the evaluation EMA: pass --use-ema"):
        TrainConfig.flat(ema_warmup=10).check()
    with pytest.raises(ValueError, match="--ema-update-interval must be >= 1"):
        TrainConfig.flat(use_ema=True, ema_update_interval=0).check()
