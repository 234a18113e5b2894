"""Built-in shapes rewards on rendered (exact) and blank images."""

import sys

import pytest
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
    balanced = get_reward("shapes_balanced")(images, prompts)
    exact_count = get_reward("shapes_exact_count")(images, prompts)
    assert partial[0] == 1.0 and 0.0 < partial[1] < 1.0 and partial[2] == 0.0
    assert strict == [1.0, 0.0, 0.0]
    # Two squares for three: count 2/3, two of three shapes found; the count is half of the balanced credit.
    assert partial[1] == pytest.approx((2 / 3 + 2) / 4)
    assert balanced == pytest.approx([1.0, (2 / 3 + 2 / 3) / 2, 0.0])
    assert exact_count == pytest.approx([1.0, 0.5 * 2 / 3, 0.0])  # count wrong: only the shapes' half


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
    # A part named twice kept its last weight only (shapes at 0.5, not 1.5), silently.
    with pytest.raises(ValueError, match="'shapes' is named twice"):
        get_reward("multi:shapes=1,shapes_strict=1,shapes=0.5")


def test_a_multi_sum_of_shapes_rewards_verifies_each_image_once(monkeypatch):
    """`multi:shapes=…,white_background=…` reads two fields of one verdict: the verifier runs once per image, and
    again for other images, other prompts or images changed in place."""
    import asyncio

    import pytest

    import diffrl.data.shapes as shapes

    calls = []
    real_verify = shapes.verify  # the package's `verify` is the function the rewards import

    def counting(image, prompt):
        calls.append(prompt)
        return real_verify(image, prompt)

    monkeypatch.setattr(shapes, "verify", counting)
    images = _as_batch(render_prompt("three squares", seed=1), render_prompt("two squares", seed=1))
    prompts = ["three squares"] * 2
    mixed = asyncio.run(get_reward("multi:shapes=0.8,white_background=0.2")(images, prompts))
    assert len(calls) == 2
    partial, white = get_reward("shapes")(images.clone(), prompts), get_reward("white_background")(images.clone(), prompts)
    assert mixed == pytest.approx([0.8 * p + 0.2 * w for p, w in zip(partial, white)])
    calls.clear()
    get_reward("shapes")(images, ["two squares"] * 2)  # other prompts
    images[0].fill_(1.0)  # the same tensor changed in place: a blank image
    assert get_reward("shapes")(images, ["two squares"] * 2)[0] == 0.0
    assert len(calls) == 4


def test_worker_pool_scores_like_the_inline_reward():
    """`--reward-workers`: spawned processes, images as safetensors bytes, the same rewards."""
    import asyncio

    from diffrl.rewards.workers import ProcessRewardPool

    prompts = ["a red circle", "two squares", "a blue triangle to the left of a green circle", "three diamonds"]
    images = torch.stack([torch.from_numpy(render_prompt(p, i)).permute(2, 0, 1) for i, p in enumerate(prompts)]) / 255
    images[1] = 0.5  # a grey image: low reward
    pool = ProcessRewardPool("shapes", workers=2, device="cpu")  # device: where model rewards would load
    try:
        async def both_halves():
            return await asyncio.gather(pool(images[:2], prompts[:2]), pool(images[2:], prompts[2:], [{}, {}]))

        first, second = asyncio.run(both_halves())
    finally:
        pool.close()
    assert first + second == get_reward("shapes")(images, prompts)
    assert first[1] < 1.0 == first[0]
    with pytest.raises(ValueError, match="--reward-workers"):
        ProcessRewardPool("shapes", workers=0)


def test_pool_workers_score_on_one_thread_each(monkeypatch):
    """Each worker is one of the pool's parallel lanes: its torch ops stay on one thread, whatever
    OMP_NUM_THREADS the parent runs with (oversubscribed workers were 2-3x slower)."""
    import asyncio

    from diffrl.rewards.workers import ProcessRewardPool

    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    pool = ProcessRewardPool("rewards_for_tests:torch_threads", workers=1)
    try:
        threads = asyncio.run(pool(torch.zeros(2, 3, 8, 8), ["a", "b"]))
    finally:
        pool.close()
    assert threads == [1.0, 1.0]


def test_crisp_shapes_reward_grades_shapes_that_barely_pass():
    """`shapes_crisp` is the partial credit with a passing shape graded by its lead over the next template:
    a round circle keeps full credit, a squircle that still passes as a circle gets a little less (the
    signal the plain partial credit does not give), a failing one the same as the partial credit."""
    import numpy as np

    def superellipse(p: float) -> np.ndarray:  # |x|^p + |y|^p <= 1: p = 2 a circle, larger p towards a square
        y, x = np.mgrid[0:64, 0:64].astype(float)
        image = np.full((64, 64, 3), 255, np.uint8)
        image[np.abs((x - 32) / 12) ** p + np.abs((y - 32) / 12) ** p <= 1] = (220, 40, 40)
        return image

    # p = 2.45 still passes as a circle, with less lead than a render; from p = 2.5 the outline has corners
    # enough for the verifier to fail it (a cornered shape), as p = 3.2 fails.
    images = _as_batch(superellipse(2.0), superellipse(2.45), superellipse(3.2))
    prompts = ["a red circle"] * 3
    partial = get_reward("shapes")(images, prompts)
    strict = get_reward("shapes_strict")(images, prompts)
    crisp = get_reward("shapes_crisp")(images, prompts)
    assert strict == [1.0, 1.0, 0.0]
    assert partial[0] == partial[1] == 1.0 and crisp[0] == 1.0
    assert 0.95 < crisp[1] < 1.0
    assert crisp[2] == partial[2] < 0.7


def test_a_custom_reward_is_found_in_the_current_directory(tmp_path, monkeypatch):
    """`diffrl train --reward myreward:score` run beside myreward.py: the console script's sys.path lacks
    the current directory (`python -m` would have it), yet the module is found there."""
    (tmp_path / "diffrl_user_reward_in_cwd.py").write_text(
        "def score(images, prompts, metadata):\n    return [float(m['value']) for m in metadata]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    reward = get_reward("diffrl_user_reward_in_cwd:score")
    assert reward(torch.zeros(2, 3, 8, 8), ["a", "b"], [{"value": 1}, {"value": 2}]) == [1.0, 2.0]
    with pytest.raises(ValueError, match="cannot be imported: No module named 'no_such_reward_module'"):
        get_reward("no_such_reward_module:score")


def test_a_custom_reward_that_cannot_take_metadata_is_refused_when_named(tmp_path, monkeypatch):
    """Rewards are called as fn(images, prompts, metadata): one that takes two arguments (or is no function)
    is refused by get_reward, before any model loads; it was a TypeError traceback after the first rollout."""
    (tmp_path / "diffrl_user_reward_two_args.py").write_text(
        "def two(images, prompts):\n    return [0.0] * len(prompts)\n"
        "def three(images, prompts, metadata=None):\n    return [0.0] * len(prompts)\n"
        "def anything(*args):\n    return [0.0] * len(args[1])\n"
        "LIMIT = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=r"custom reward 'diffrl_user_reward_two_args:two' is called as "
                                         r"fn\(images, prompts, metadata\)"):
        get_reward("diffrl_user_reward_two_args:two")
    with pytest.raises(ValueError, match="'diffrl_user_reward_two_args:LIMIT' is not a function"):
        get_reward("diffrl_user_reward_two_args:LIMIT")
    assert get_reward("diffrl_user_reward_two_args:three") and get_reward("diffrl_user_reward_two_args:anything")
