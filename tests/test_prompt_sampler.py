"""Which categories and prompts a rollout draws (uniform turns, or adaptive to training reward)."""

import pytest

from diffrl.train.prompt_sampler import CategorySampler

PROMPTS = {"easy": ["a red circle", "a blue square"], "hard": ["three triangles", "four diamonds"], "mid": ["two circles"]}


def test_uniform_categories_take_turns_and_draws_repeat():
    sampler = CategorySampler(PROMPTS, seed=3)
    prompts, cats = sampler.draw(k=1, batch=4)
    assert cats == ["hard", "mid", "easy", "hard"]  # group j of rollout k: category (k·B + j) mod C
    assert all(p in PROMPTS[c] for p, c in zip(prompts, cats, strict=True))
    assert sampler.draw(k=1, batch=4) == (prompts, cats)
    sampler.observe(["easy", "hard"], [1.0, 0.0])
    assert sampler.draw(k=1, batch=4) == (prompts, cats)  # uniform ignores rewards


def test_adaptive_gives_low_reward_categories_more_groups():
    sampler = CategorySampler(PROMPTS, mode="adaptive", floor=0.05, smoothing=0.5, seed=0)
    sampler.observe(["easy", "hard"], [1.0, 0.2])
    assert sampler.weights() == pytest.approx({c: 1 / 3 for c in PROMPTS})  # "mid" unseen: still uniform
    means = sampler.observe(["easy", "easy", "hard", "mid"], [1.0, 0.9, 0.4, 0.6])
    assert means == pytest.approx({"easy": 0.95, "hard": 0.4, "mid": 0.6})
    assert sampler.mean_reward == pytest.approx({"easy": 0.975, "hard": 0.3, "mid": 0.6})  # smoothed
    w = sampler.weights()
    assert w["hard"] > w["mid"] > w["easy"] > 0 and sum(w.values()) == pytest.approx(1)
    _, cats = sampler.draw(k=5, batch=32)
    counts = {c: cats.count(c) for c in PROMPTS}
    assert sum(counts.values()) == 32 and counts["hard"] > counts["mid"] > counts["easy"] >= 1
    assert all(abs(counts[c] - (1 + w[c] * 29)) < 1 for c in PROMPTS)  # one each, the rest proportional
    sampler.observe(["easy"] * 4, [1.0] * 4)  # solved: its share shrinks to the floor's
    _, cats = sampler.draw(k=6, batch=3)
    assert sorted(cats) == ["easy", "hard", "mid"]  # still one group each: its reward stays current


def test_state_round_trip_and_bad_settings_are_named():
    a = CategorySampler(PROMPTS, mode="adaptive")
    a.observe(["easy", "hard", "mid"], [1.0, 0.1, 0.5])
    b = CategorySampler(PROMPTS, mode="adaptive")
    b.load_state_dict(a.state_dict())
    assert b.draw(7, 12) == a.draw(7, 12)
    with pytest.raises(ValueError, match="--category-sampling-floor"):
        CategorySampler(PROMPTS, mode="adaptive", floor=0)
    with pytest.raises(ValueError, match="--category-reward-smoothing"):
        CategorySampler(PROMPTS, smoothing=1.0)
