"""Which categories and prompts a rollout draws (uniform turns, or adaptive to training reward)."""

import pytest

from diffrl.tasks.prompt_sampler import CategorySampler

PROMPTS = {"easy": ["a red circle", "a blue square"], "hard": ["three triangles", "four diamonds"], "mid": ["two circles"]}


def test_uniform_categories_take_turns_and_draws_repeat():
    sampler = CategorySampler(PROMPTS, seed=3)
    prompts, cats = sampler.draw(k=1, batch=4)
    assert cats == ["hard", "mid", "easy", "hard"]  # group j of rollout k: category (k·B + j) mod C
    assert all(p in PROMPTS[c] for p, c in zip(prompts, cats, strict=True))
    assert sampler.draw(k=1, batch=4) == (prompts, cats)
    sampler.observe(["easy", "hard"], [[1.0], [0.0]])
    assert sampler.draw(k=1, batch=4) == (prompts, cats)  # uniform ignores rewards


def test_adaptive_gives_low_reward_categories_more_groups():
    sampler = CategorySampler(PROMPTS, mode="adaptive", floor=0.05, smoothing=0.5, seed=0)
    sampler.observe(["easy", "hard"], [[1.0, 1.0], [0.2, 0.2]])
    assert sampler.weights() == pytest.approx({c: 1 / 3 for c in PROMPTS})  # "mid" unseen: still uniform
    means = sampler.observe(["easy", "easy", "hard", "mid"], [[1.0], [0.8, 1.0], [0.4], [0.6]])
    assert means == pytest.approx({"easy": (1.0 + 0.8 + 1.0) / 3, "hard": 0.4, "mid": 0.6})  # over samples
    assert sampler.mean_reward == pytest.approx({"easy": (1 + 2.8 / 3) / 2, "hard": 0.3, "mid": 0.6})  # smoothed
    w = sampler.weights()
    assert w["hard"] > w["mid"] > w["easy"] > 0 and sum(w.values()) == pytest.approx(1)
    _, cats = sampler.draw(k=5, batch=32)
    counts = {c: cats.count(c) for c in PROMPTS}
    assert sum(counts.values()) == 32 and counts["hard"] > counts["mid"] > counts["easy"] >= 1
    assert all(abs(counts[c] - (1 + w[c] * 29)) < 1 for c in PROMPTS)  # one each, the rest proportional
    sampler.observe(["easy"] * 4, [[1.0]] * 4)  # solved: its share shrinks to the floor's
    _, cats = sampler.draw(k=6, batch=3)
    assert sorted(cats) == ["easy", "hard", "mid"]  # still one group each: its reward stays current


def test_unsolved_difficulty_follows_failures_not_mean_reward():
    # "hard" averages 0.9 but only 1 sample in 4 is exactly right; "mid" averages less (0.75) with 3 of
    # 4 right. By mean reward "mid" is the harder, by failures "hard" is.
    groups = {"easy": [1.0, 1.0, 1.0, 1.0], "hard": [1.0, 0.9, 0.85, 0.85], "mid": [1.0, 1.0, 1.0, 0.0]}
    by_reward = CategorySampler(PROMPTS, mode="adaptive", smoothing=0.0)
    by_failures = CategorySampler(PROMPTS, mode="adaptive", smoothing=0.0, difficulty="unsolved")
    for sampler in (by_reward, by_failures):
        sampler.observe(list(groups), list(groups.values()))
    assert by_failures.unsolved == pytest.approx({"easy": 0.0, "hard": 0.75, "mid": 0.25})
    w_reward, w_failures = by_reward.weights(), by_failures.weights()
    assert w_reward["mid"] > w_reward["hard"] > w_reward["easy"]
    assert w_failures["hard"] > w_failures["mid"] > w_failures["easy"]
    assert w_failures["hard"] == pytest.approx((0.05 + 0.75) / (0.05 * 3 + 0.75 + 0.25))
    # "solved" is a threshold: at 0.85 every "hard" sample counts as solved.
    lenient = CategorySampler(PROMPTS, mode="adaptive", smoothing=0.0, difficulty="unsolved", solved_reward=0.85)
    lenient.observe(list(groups), list(groups.values()))
    assert lenient.unsolved["hard"] == 0.0 and lenient.unsolved["mid"] == 0.25


def test_state_round_trip_and_bad_settings_are_named():
    a = CategorySampler(PROMPTS, mode="adaptive")
    a.observe(["easy", "hard", "mid"], [[1.0], [0.1], [0.5, 1.0]])
    b = CategorySampler(PROMPTS, mode="adaptive")
    b.load_state_dict(a.state_dict())
    assert b.draw(7, 12) == a.draw(7, 12)
    a = CategorySampler(PROMPTS, mode="adaptive", difficulty="unsolved")
    a.observe(["easy", "hard", "mid"], [[1.0], [0.1], [0.5, 1.0]])
    b = CategorySampler(PROMPTS, mode="adaptive", difficulty="unsolved")
    b.load_state_dict(a.state_dict())
    assert b.unsolved == a.unsolved and b.draw(7, 12) == a.draw(7, 12)
    older = CategorySampler(PROMPTS, mode="adaptive", difficulty="unsolved")
    older.load_state_dict({"mean_reward": a.mean_reward})  # saved before `unsolved` was tracked
    assert older.weights() == pytest.approx({c: 1 / 3 for c in PROMPTS})  # takes turns until it has seen all
    with pytest.raises(ValueError, match="--category-difficulty"):
        CategorySampler(PROMPTS, mode="adaptive", difficulty="strict")
    with pytest.raises(ValueError, match="--category-sampling-floor"):
        CategorySampler(PROMPTS, mode="adaptive", floor=0)
    with pytest.raises(ValueError, match="--category-reward-smoothing"):
        CategorySampler(PROMPTS, smoothing=1.0)
