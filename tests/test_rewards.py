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
