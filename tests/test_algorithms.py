"""Advantages, losses and the NFT EMA schedule against independent float64 hand computations."""

import math

import numpy as np
import pytest
import torch

from diffrl.algorithms.advantages import compute_advantages
from diffrl.algorithms.losses import ema_decay, flow_grpo_loss, nft_loss, nft_reward_weight, x_kl
from diffrl.train.ema import ParameterEMA


def per_prompt_stat_tracker(prompts, rewards, global_std=False):
    """flow_grpo's PerPromptStatTracker semantics, re-derived: pool rewards by prompt string,
    population std (+1e-4), optionally the whole batch's std."""
    prompts, rewards = np.array(prompts), np.array(rewards, dtype=np.float64)
    out = np.zeros_like(rewards)
    for p in np.unique(prompts):
        mask = prompts == p
        mean = rewards[mask].mean()
        std = (rewards.std() if global_std else rewards[mask].std()) + 1e-4
        out[mask] = (rewards[mask] - mean) / std
    return out


TABLE_PROMPTS = ["a", "a", "a", "b", "b", "b", "c", "c", "c", "a", "a", "a"]  # "a" appears in two groups: pooled
TABLE_REWARDS = [0.1, 0.5, 0.9, 0.3, 0.3, 0.3, 1.0, 0.0, 0.5, 0.2, 0.2, 0.8]


@pytest.mark.parametrize("global_std", [False, True])
def test_advantages_match_per_prompt_stat_tracker(global_std):
    ours = compute_advantages(TABLE_REWARDS, TABLE_PROMPTS, globalize_reward_std=global_std)
    expected = per_prompt_stat_tracker(TABLE_PROMPTS, TABLE_REWARDS, global_std=global_std)
    np.testing.assert_allclose(ours.values.numpy(), expected, rtol=0, atol=1e-12)
    assert ours.zero_std_ratio == pytest.approx(1 / 3)  # group "b" is all 0.3
    assert ours.keep.all()


def test_globalized_mean_and_zero_std_dropping():
    ours = compute_advantages(TABLE_REWARDS, TABLE_PROMPTS, globalize_reward_mean=True, globalize_reward_std=True,
                              drop_zero_std_groups=True)
    r = np.array(TABLE_REWARDS)
    np.testing.assert_allclose(ours.values.numpy(), (r - r.mean()) / (r.std() + 1e-4), atol=1e-12)
    assert ours.keep.tolist() == [p != "b" for p in TABLE_PROMPTS]


def test_single_sample_per_prompt_turns_std_off():
    ours = compute_advantages([0.2, 0.6, 1.0], ["x", "y", "z"], globalize_reward_mean=True)
    np.testing.assert_allclose(ours.values.numpy(), [-0.4, 0.0, 0.4], atol=1e-12)
    with pytest.raises(ValueError, match="3 rewards for 2 prompts"):
        compute_advantages([1.0, 2.0, 3.0], ["x", "y"])


def test_flow_grpo_loss_matches_hand_computation():
    logp = torch.tensor([0.0, 0.3, -0.4, 0.05], dtype=torch.float64)
    old = torch.tensor([0.0, 0.0, 0.0, 0.0], dtype=torch.float64)
    adv = torch.tensor([1.0, 2.0, -1.5, 9.0], dtype=torch.float64)  # 9 clamps to 5
    eps, cmax = 0.2, 5.0
    expected = []
    for lp, o, a in zip(logp.tolist(), old.tolist(), adv.tolist()):
        a = max(-cmax, min(cmax, a))
        rho = math.exp(lp - o)
        expected.append(max(-a * rho, -a * min(max(rho, 1 - eps), 1 + eps)))
    terms = flow_grpo_loss(logp, old, adv, clip_range=eps, adv_clip_max=cmax)
    assert terms.policy_loss.item() == pytest.approx(sum(expected) / 4, abs=1e-12)
    assert terms.approx_kl.item() == pytest.approx(0.5 * sum(d * d for d in logp.tolist()) / 4, abs=1e-12)
    assert terms.clipfrac.item() == pytest.approx(2 / 4)  # exp(0.3) and exp(-0.4) leave [0.8, 1.2]

    mean = torch.tensor([[1.0, 2.0], [0.0, 0.5], [1.0, 1.0], [2.0, 0.0]], dtype=torch.float64)
    ref = torch.tensor([[0.0, 2.0], [0.0, 0.0], [1.0, 3.0], [2.0, 1.0]], dtype=torch.float64)
    std = torch.tensor([0.5, 1.0, 2.0, 0.1], dtype=torch.float64)
    kl = [((m - r) ** 2).mean().item() / (2 * s**2) for m, r, s in zip(mean, ref, std.tolist())]
    with_kl = flow_grpo_loss(logp, old, adv, clip_range=eps, adv_clip_max=cmax, kl_beta=0.04, kl=x_kl(mean, ref, std))
    assert with_kl.kl_loss.item() == pytest.approx(sum(kl) / 4, abs=1e-12)
    assert with_kl.loss.item() == pytest.approx(sum(expected) / 4 + 0.04 * sum(kl) / 4, abs=1e-12)
    with pytest.raises(ValueError, match="per-sample KL"):
        flow_grpo_loss(logp, old, adv, clip_range=eps, adv_clip_max=cmax, kl_beta=0.1)


def test_on_policy_ratio_is_one_and_gradient_is_advantage_weighted():
    logp = torch.tensor([0.1, -0.2], dtype=torch.float64, requires_grad=True)
    terms = flow_grpo_loss(logp, logp.detach(), torch.tensor([1.0, -2.0], dtype=torch.float64),
                           clip_range=1e-4, adv_clip_max=5.0)
    assert torch.equal(terms.ratio, torch.ones(2, dtype=torch.float64))
    terms.loss.backward()
    assert logp.grad.tolist() == pytest.approx([-0.5, 1.0])  # −A/B


def test_nft_reward_mapping():
    a = torch.tensor([-10.0, -5.0, 0.0, 2.5, 5.0, 7.0])
    assert nft_reward_weight(a, 5.0).tolist() == pytest.approx([0.0, 0.0, 0.5, 0.75, 1.0, 1.0])


@pytest.mark.parametrize("adaptive", [True, False])
def test_nft_loss_matches_hand_computation(adaptive):
    g = torch.Generator().manual_seed(0)
    v_theta, v_old, x_t, x0 = (torch.randn(3, 4, 2, generator=g, dtype=torch.float64) for _ in range(4))
    t = torch.tensor([0.9, 0.5, 0.1], dtype=torch.float64)
    adv = torch.tensor([3.0, -1.0, 0.0], dtype=torch.float64)
    beta, c, kl_beta = 0.7, 2.0, 0.01
    v_ref = torch.randn(3, 4, 2, generator=g, dtype=torch.float64)
    terms = nft_loss(v_theta, v_old, x_t, x0, t, adv, beta=beta, adv_clip_max=c, adaptive_weighting=adaptive,
                     kl_beta=kl_beta, v_ref=v_ref)
    total = 0.0
    for i in range(3):
        r = min(max(max(-c, min(c, adv[i].item())) / (2 * c) + 0.5, 0.0), 1.0)
        losses = []
        for v in (beta * v_theta[i] + (1 - beta) * v_old[i], (1 + beta) * v_old[i] - beta * v_theta[i]):
            err = (x_t[i] - t[i].item() * v - x0[i]).flatten().tolist()
            sq = sum(e * e for e in err) / len(err)
            if adaptive:
                sq /= max(sum(abs(e) for e in err) / len(err), 1e-5)
            losses.append(sq)
        total += c * (r * losses[0] + (1 - r) * losses[1]) / beta
    kl = ((v_theta - v_ref) ** 2).mean().item()
    assert terms.loss.item() == pytest.approx(total / 3 + kl_beta * kl, rel=1e-12)


def test_nft_ema_schedule_and_update():
    assert [ema_decay(k) for k in (0, 1, 100, 499, 500, 5000)] == pytest.approx([0, 0.001, 0.1, 0.499, 0.5, 0.5])
    assert [ema_decay(k, flat=10, ramp=0.01, max_decay=0.9) for k in (5, 10, 20, 200)] == pytest.approx([0, 0, 0.1, 0.9])
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    ema = ParameterEMA([p])
    with torch.no_grad():
        p.copy_(torch.tensor([3.0, 6.0]))
    ema.update(0.25)  # shadow ← 0.25·shadow + 0.75·param
    assert ema.shadow[0].tolist() == pytest.approx([2.5, 5.0])
    with ema.swapped_in():
        assert p.tolist() == pytest.approx([2.5, 5.0])
    assert p.tolist() == [3.0, 6.0]
