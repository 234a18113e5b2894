"""Group rewards (`rank:`, `pairwise:`, `diverse:`) against values computed by hand, grouped by prompt whatever the
order; and a held-out evaluation of a group reward scores the pointwise reward it wraps."""

import asyncio
import math

import pytest
import torch

from diffrl.rewards import get_reward
from diffrl.rewards.groups import colour_novelty, is_group_reward, mean_preference, pointwise_spec, ranks01
from diffrl.utils.colour import mean_ab, srgb_to_lab


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


def _painted(rgb, value=0.0):
    """Flat images of the colours `rgb` ([N, 3] in [0, 1]), with `value` planted in the first pixel's red (by_index)."""
    images = torch.tensor(rgb, dtype=torch.float32).view(-1, 3, 1, 1).expand(-1, 3, 8, 8).clone()
    images[:, 0, 0, 0] = value
    return images


def test_colour_novelty_by_hand():
    import numpy as np

    assert colour_novelty(np.array([[30.0, 40.0]])) == [0.0]  # alone
    assert colour_novelty(np.array([[30.0, 40.0]] * 4)) == pytest.approx([0.0] * 4, abs=1e-12)  # one hue
    # Two opposite hues of chroma 50 (weight 50/55 each): π apart, so each is 1 × (10/11)² from the other.
    assert colour_novelty(np.array([[50.0, 0.0], [-50.0, 0.0]])) == pytest.approx([(10 / 11) ** 2] * 2)
    # Three at 0°, 90° and 180°, chroma 45 (weight 0.9): the middle is ½ from both, the ends ½ and 1.
    ab = np.array([[45.0, 0.0], [0.0, 45.0], [-45.0, 0.0]])
    assert colour_novelty(ab) == pytest.approx([0.81 * 0.75, 0.81 * 0.5, 0.81 * 0.75])
    # A grey among reds earns little for its ill-defined hue: chroma 0.5 weighs 0.5/5.5.
    grey_first = colour_novelty(np.array([[0.5, 0.0], [0.0, 60.0], [0.0, 60.0]]))
    assert grey_first[0] < 0.05


def test_diverse_adds_the_weighted_novelty_to_the_pointwise_value_within_each_prompt():
    red, cyan = [0.8, 0.2, 0.2], [0.2, 0.8, 0.8]
    images = _painted([red, cyan, red, red], value=0.0)
    images[:, 0, 0, 0] = torch.tensor([0.1, 0.2, 0.3, 0.4])
    prompts = ["a", "a", "b", "b"]  # prompt b's two reds: nearly one hue (their planted pixels differ)
    got = asyncio.run(get_reward("diverse@0.5:rewards_for_tests:by_index")(images, prompts, None))
    novelty_a = colour_novelty(mean_ab(images[:2]))
    assert novelty_a[0] == pytest.approx(novelty_a[1]) and novelty_a[0] > 0.5
    novelty_b = colour_novelty(mean_ab(images[2:]))
    assert max(novelty_b) < 1e-3
    assert got == pytest.approx([0.1 + 0.5 * novelty_a[0], 0.2 + 0.5 * novelty_a[1], 0.3 + 0.5 * novelty_b[0],
                                 0.4 + 0.5 * novelty_b[1]], abs=1e-6)  # the planted values are float32
    default = asyncio.run(get_reward("diverse:rewards_for_tests:by_index")(images, prompts, None))
    assert default[0] == pytest.approx(0.1 + 4 * novelty_a[0], abs=1e-6)
    # The hue is CIELAB's: red's a*b* angle, not RGB's.
    lab = srgb_to_lab(torch.tensor(red, dtype=torch.float64).numpy())
    assert mean_ab(_painted([red], value=red[0]))[0] == pytest.approx(lab[1:], abs=1e-4)


def test_a_held_out_evaluation_scores_the_reward_a_group_reward_wraps():
    from diffrl.evaluation.reward_eval import reward_components

    assert pointwise_spec("rank:diverse@2:ocr") == "ocr" and pointwise_spec("multi:ocr=1") == "multi:ocr=1"
    images, prompts = planted([0.2, 0.9, 0.4]), ["p"] * 3
    for spec in ("rank:rewards_for_tests:by_index", "diverse@3:rewards_for_tests:by_index"):
        (component,) = reward_components(spec)
        assert component.spec == "rewards_for_tests:by_index"
        assert component.score(images, prompts, None) == pytest.approx([0.2, 0.9, 0.4])


def test_group_reward_specs():
    assert is_group_reward("rank:pickscore@/m") and is_group_reward("pairwise@2:shapes") and not is_group_reward("shapes")
    assert get_reward("rank:shapes").scores_groups
    with pytest.raises(ValueError, match="temperature in pairwise@T: must be > 0"):
        get_reward("pairwise@0:shapes")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("rank:nope")
    assert is_group_reward("diverse:shapes") and is_group_reward("diverse@0.1:shapes")
    with pytest.raises(ValueError, match="the weight in diverse@W: is a number"):
        get_reward("diverse@x:shapes")
    with pytest.raises(ValueError, match="the weight in diverse@W: must be > 0"):
        get_reward("diverse@-1:shapes")


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
