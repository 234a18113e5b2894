"""GDPO's advantages (arXiv 2601.05242): each term of a multi: reward normalized within its prompt group, then
combined by weight and standardized over the batch; the terms travel from the reward (inline or in worker
processes) to the trainer with each sample."""

import math

import pytest
import torch

from diffrl.algorithms.advantages import compute_advantages, gdpo_values
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer, reward_terms


def _gdpo_by_hand(terms, weights, prompts):
    """Float64 loops: per group and term (r − mean)/max(std, 1e-6), weighted sum, then (x − mean)/(std + 1e-4)."""
    n, k = len(terms), len(weights)
    combined = [0.0] * n
    for prompt in set(prompts):
        idx = [i for i in range(n) if prompts[i] == prompt]
        for j in range(k):
            values = [terms[i][j] for i in idx]
            mean = sum(values) / len(values)
            std = max(math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)), 1e-6)
            for i in idx:
                combined[i] += weights[j] * (terms[i][j] - mean) / std
    mean = sum(combined) / n
    std = math.sqrt(sum((c - mean) ** 2 for c in combined) / n)
    return [(c - mean) / (std + 1e-4) for c in combined]


def test_gdpo_normalizes_each_term_within_its_group():
    g = torch.Generator().manual_seed(0)
    prompts = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    terms = torch.cat([torch.rand(12, 1, generator=g, dtype=torch.float64) * 0.01,  # a narrow term
                       torch.rand(12, 1, generator=g, dtype=torch.float64) * 100], dim=1)  # and a wide one
    terms[8:, 1] = 7.0  # a group in which the wide term is constant: only the narrow one speaks there
    weights = [1.0, 0.5]
    ours = gdpo_values(terms, weights, prompts)
    assert ours.tolist() == pytest.approx(_gdpo_by_hand(terms.tolist(), weights, prompts), rel=1e-10, abs=1e-12)
    # The summed reward's advantages follow the wide term; GDPO's give the narrow one its weight back.
    summed = compute_advantages(terms @ torch.tensor(weights, dtype=torch.float64), prompts).values
    narrow = terms[:, 0]
    corr = lambda a, b: torch.corrcoef(torch.stack([a, b]))[0, 1].item()  # noqa: E731
    assert corr(ours[:8], narrow[:8]) > corr(summed[:8], narrow[:8])
    via = compute_advantages(terms @ torch.tensor(weights, dtype=torch.float64), prompts, reward_terms=terms,
                             term_weights=weights)
    assert torch.equal(via.values, ours)


def test_gdpo_needs_a_multi_reward_and_no_batch_wide_statistics():
    with pytest.raises(ValueError, match="--advantage-aggregation gdpo normalizes each term"):
        TrainConfig.flat(advantage_aggregation="gdpo", reward="shapes").check()
    with pytest.raises(ValueError, match="--advantage-aggregation gdpo normalizes each term"):
        TrainConfig.flat(advantage_aggregation="gdpo", reward="multi:shapes=1,white_background=1",
                         globalize_reward_std=True).check()


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_gdpo_run_trains_on_the_terms_the_reward_returned(tiny_model_dir, tmp_path, workers):
    from test_trainer import tiny_config

    reward = "multi:rewards_for_tests:darkness=1,rewards_for_tests:redness=0.5"
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", loss_type="nft", reward=reward, advantage_aggregation="gdpo",
                      reward_workers=workers)
    trainer = Trainer(cfg)
    seen = {}
    compute = trainer.objective.pairs

    def pairs(samples, advantages, env):
        seen["samples"], seen["advantages"] = samples, advantages
        return compute(samples, advantages, env)

    trainer.objective.pairs = pairs
    try:
        record = trainer.rollout_and_update(0)
    finally:
        trainer._close_workers()
    samples = seen["samples"]
    terms = reward_terms(samples, ["rewards_for_tests:darkness", "rewards_for_tests:redness"])
    assert all(s.reward == pytest.approx(t[0].item() + 0.5 * t[1].item()) for s, t in zip(samples, terms))
    expected = gdpo_values(terms, [1.0, 0.5], [s.prompt for s in samples]).float()
    assert torch.allclose(seen["advantages"], expected)
    assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0
