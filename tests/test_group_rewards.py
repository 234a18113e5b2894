"""Group rewards (`rank:`, `pairwise:`) against values computed by hand, grouped by prompt whatever the order."""

import asyncio
import math

import pytest
import torch

from diffrl.rewards import get_reward
from diffrl.rewards.groups import is_group_reward, mean_preference, ranks01


def planted(values):
    """Images whose first pixel holds each value: `rewards_for_tests:by_index` reads it back."""
    images = torch.zeros(len(values), 3, 2, 2)
    images[:, 0, 0, 0] = torch.tensor(values)
    return images


def score(spec, values, prompts):
    return asyncio.run(get_reward(spec)(planted(values), prompts, None))


def test_ranks_by_hand_with_ties_and_groups_split_by_prompt():
    assert ranks01([0.3, 0.1, 0.2]) == [1.0, 0.0, 0.5]
    assert ranks01([0.5, 0.2, 0.5, 0.9]) == [pytest.approx(1.5 / 3), 0.0, pytest.approx(1.5 / 3), 1.0]
    assert ranks01([7.0]) == [0.5]
    # Two prompts interleaved: each ranked within its own group.
    values, prompts = [0.9, 0.1, 0.5, 0.2, 0.4], ["a", "b", "a", "b", "a"]
    assert score("rank:rewards_for_tests:by_index", values, prompts) == [1.0, 0.0, 0.5, 1.0, 0.0]


def test_pairwise_preference_by_hand():
    s = [0.0, 1.0, 3.0]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    by_hand = [(sig(-1) + sig(-3)) / 2, (sig(1) + sig(-2)) / 2, (sig(3) + sig(2)) / 2]
    assert mean_preference(s, 1.0) == pytest.approx(by_hand, abs=1e-15)
    halved = [(sig(-2) + sig(-6)) / 2, (sig(2) + sig(-4)) / 2, (sig(6) + sig(4)) / 2]
    assert score("pairwise@0.5:rewards_for_tests:by_index", s, ["p"] * 3) == pytest.approx(halved, abs=1e-6)
    assert mean_preference([2.0, 2.0], 1.0) == [0.5, 0.5] and mean_preference([1.0], 1.0) == [0.5]
    assert sum(mean_preference([0.3, 0.9, 0.1, 0.4], 0.2)) == pytest.approx(2.0)  # preferences of a pair sum to 1


def test_group_reward_specs():
    assert is_group_reward("rank:pickscore@/m") and is_group_reward("pairwise@2:shapes") and not is_group_reward("shapes")
    assert get_reward("rank:shapes").scores_groups
    with pytest.raises(ValueError, match="temperature in pairwise@T: must be > 0"):
        get_reward("pairwise@0:shapes")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("rank:nope")


def test_a_rollout_scores_each_prompts_whole_group_whatever_its_microgroups(tiny_model_dir, tmp_path):
    """Microgroups of 2 in groups of 4: a rank reward still ranks among all 4 samples of a prompt (scored when the
    group's last microgroup lands), and equals ranking the in-process darkness by hand."""
    from diffrl.cli.main import parse
    from diffrl.train.trainer import Trainer

    cfg = parse(["train", "--reward", "rank:rewards_for_tests:darkness", "--rollout-batch-size", "2",
                 "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "2", "--global-batch-size", "8",
                 "--num-steps-per-rollout", "1", "--diffusion-num-steps", "3", "--eval-images-per-category", "0",
                 "--val-images-per-category", "0", "--device", "cpu", "--model-path", str(tiny_model_dir),
                 "--output-dir", str(tmp_path / "run"), "--loss-type", "nft"])
    trainer = Trainer(cfg)
    groups = asyncio.run(trainer.manager.rollout(["a red circle", "two squares"], trainer.objective.request(0)))
    from rewards_for_tests import darkness

    for group in groups:
        images = torch.stack([s.output.generated_output for s in group])
        assert [s.reward for s in group] == ranks01(darkness(images, [group[0].prompt] * 4))
        assert sorted(s.reward for s in group) == pytest.approx([0, 1 / 3, 2 / 3, 1])


def test_group_rewards_are_refused_on_ray_reward_actors_and_flagged_for_worker_pools():
    from diffrl.cli.main import parse
    from diffrl.rewards.workers import ProcessRewardPool

    with pytest.raises(ValueError, match="scores a prompt's whole group at once"):
        parse(["train", "--reward", "rank:shapes", "--ray-reward-workers", "1", "--ray-trainer-ranks", "2"]).check()
    pool = ProcessRewardPool("rank:shapes", 1)
    try:
        assert pool.scores_groups
    finally:
        pool.close()
