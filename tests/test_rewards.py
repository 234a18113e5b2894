"""Built-in shapes rewards on rendered (exact) and blank images."""

import torch

from diffrl.data.shapes import render_prompt
from diffrl.rewards import get_reward


def _as_batch(*arrays):
    return torch.stack([torch.from_numpy(a).permute(2, 0, 1).float() / 255 for a in arrays])


def test_shapes_rewards_score_renders_and_blank_images():
    good = render_prompt("three squares", seed=1)
    wrong_count = render_prompt("two squares", seed=1)
    blank = good * 0 + 255
    images = _as_batch(good, wrong_count, blank)
    prompts = ["three squares"] * 3
    partial = get_reward("shapes")(images, prompts)
    strict = get_reward("shapes_strict")(images, prompts)
    assert partial[0] == 1.0 and 0.0 < partial[1] < 1.0 and partial[2] == 0.0
    assert strict == [1.0, 0.0, 0.0]


def test_multi_reward_is_the_weighted_sum_and_bad_specs_are_named():
    import asyncio

    import pytest

    images = _as_batch(render_prompt("three squares", seed=1), render_prompt("two squares", seed=1))
    prompts = ["three squares"] * 2
    partial = get_reward("shapes")(images, prompts)
    strict = get_reward("shapes_strict")(images, prompts)
    mixed = asyncio.run(get_reward("multi:shapes=0.25,shapes_strict=0.75")(images, prompts))
    assert mixed == pytest.approx([0.25 * p + 0.75 * s for p, s in zip(partial, strict)])
    with pytest.raises(ValueError, match="not a number"):
        get_reward("multi:shapes=heavy")
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("multi:nope=1")
