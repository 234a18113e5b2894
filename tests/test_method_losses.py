"""Each RL method's loss (`diffrl/algorithms/losses.py`) and two sampling steps (`diffrl/sampling/steps.py`)
against an independent float64 transcription of the paper's equation.

The references below are written from the equations with plain Python floats and `math` (loops over
`tensor.tolist()`); none of them calls a helper of `diffrl.algorithms.losses`. Gradients are checked with
torch.autograd against a hand-derived gradient or a central finite difference of the reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffrl.algorithms import losses as L
from diffrl.sampling.steps import dance_step, sde_step

F64 = torch.float64
LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


# ---------------------------------------------------------------- plain-Python helpers


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(g: torch.Generator, *shape, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=g, dtype=F64) * scale


def rows(t: torch.Tensor) -> list[list[float]]:
    """A `[B, …]` tensor as B flat lists of Python floats."""
    return [[float(v) for v in row] for row in t.detach().reshape(t.shape[0], -1).tolist()]


def vals(t: torch.Tensor) -> list[float]:
    return [float(v) for v in t.detach().reshape(-1).tolist()]


def mean(xs) -> float:
    xs = list(xs)
    return math.fsum(xs) / len(xs)


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def clampf(x: float, lo: float, hi: float) -> float:
    return min(max(x, lo), hi)


def close(got, want, rel: float = 1e-10, abs_: float = 1e-12):
    """Element-wise |got − want| ≤ abs_ + rel·|want|, with the worst offender in the message."""
    got_l = vals(got) if isinstance(got, torch.Tensor) else [float(x) for x in (got if isinstance(got, list) else [got])]
    want_l = [float(x) for x in (want if isinstance(want, list) else [want])]
    assert len(got_l) == len(want_l), (len(got_l), len(want_l))
    for i, (a, b) in enumerate(zip(got_l, want_l)):
        assert abs(a - b) <= abs_ + rel * abs(b), f"element {i}: got {a!r}, want {b!r} (diff {a - b:.3e})"


def finite_diff(f, xs: list[float], h: float = 1e-6) -> list[float]:
    """Central finite difference of a scalar function of a flat list of floats."""
    out = []
    for k in range(len(xs)):
        up, down = list(xs), list(xs)
        up[k] += h
        down[k] -= h
        out.append((f(up) - f(down)) / (2 * h))
    return out


def ppo_reference(deltas, advs, eps, c):
    """Per-sample PPO terms max(−A·ρ, −A·clip(ρ, 1 − ε, 1 + ε)), A clamped to ±c, ρ = exp(Δ)."""
    out = []
    for d, a in zip(deltas, advs):
        a = clampf(a, -c, c)
        rho = math.exp(d)
        out.append(max(-a * rho, -a * clampf(rho, 1 - eps, 1 + eps)))
    return out


# ---------------------------------------------------------------- Flow-GRPO


def test_x_kl_and_v_kl():
    """Flow-GRPO (arXiv 2505.05470) KL to the reference: x-based mean((μ_θ − μ_ref)²)/(2s²), v-based mean((v_θ − v_ref)²)."""
    g = gen(0)
    mu, mu_ref, v, v_ref = (randn(g, 4, 4, 2) for _ in range(4))
    s = torch.rand(4, generator=g, dtype=F64) * 0.5 + 0.1
    want_x = [mean((a - b) ** 2 for a, b in zip(r1, r2)) / (2 * si**2) for r1, r2, si in zip(rows(mu), rows(mu_ref), vals(s))]
    want_v = [mean((a - b) ** 2 for a, b in zip(r1, r2)) for r1, r2 in zip(rows(v), rows(v_ref))]
    got_x, got_v = L.x_kl(mu, mu_ref, s), L.v_kl(v, v_ref)
    assert got_x.shape == (4,) and got_v.shape == (4,)
    assert got_x.dtype == F64 and got_v.dtype == F64
    close(got_x, want_x)
    close(got_v, want_v)


def test_flow_grpo_loss_value_and_gradient():
    """Flow-GRPO (arXiv 2505.05470, eq. 8): mean max(−Aρ, −A·clip(ρ, 1±ε)) + β·mean KL, A clamped to ±c."""
    g = gen(1)
    B, eps, c, beta = 8, 0.2, 1.5, 0.04
    old = randn(g, B)
    delta = randn(g, B, scale=0.3)
    logp = (old + delta).requires_grad_(True)
    adv = randn(g, B, scale=2.0)
    kl = torch.rand(B, generator=g, dtype=F64)
    out = L.flow_grpo_loss(logp, old, adv, clip_range=eps, adv_clip_max=c, kl_beta=beta, kl=kl)

    d_list, a_list, kl_list = vals(logp - old), vals(adv), vals(kl)
    # the data must exercise both clips, or the test could not tell them apart
    assert any(abs(a) > c for a in a_list)
    assert any(abs(math.exp(d) - 1) > eps for d in d_list) and any(abs(math.exp(d) - 1) < eps for d in d_list)
    policy = mean(ppo_reference(d_list, a_list, eps, c))
    close(out.policy_loss, policy)
    close(out.kl_loss, mean(kl_list))
    close(out.loss, policy + beta * mean(kl_list))
    close(out.ratio, [math.exp(d) for d in d_list])
    close(out.clipfrac, mean(1.0 if abs(math.exp(d) - 1) > eps else 0.0 for d in d_list), rel=1e-7)  # float32
    close(out.approx_kl, 0.5 * mean(d * d for d in d_list))

    # gradient wrt log_prob against a finite difference of the reference
    out.loss.backward()
    old_l = vals(old)
    fd = finite_diff(lambda lp: mean(ppo_reference([x - o for x, o in zip(lp, old_l)], a_list, eps, c)), vals(logp))
    close(logp.grad, fd, rel=1e-7, abs_=1e-9)


def test_flow_grpo_on_policy_gradient_is_minus_advantage_over_batch():
    """Flow-GRPO (arXiv 2505.05470, eq. 8) on policy (logp = logp_old): ∂L/∂logp_i = −clamp(A_i, ±c)/B."""
    g = gen(2)
    B, c = 5, 1.0
    logp = randn(g, B).requires_grad_(True)
    adv = randn(g, B, scale=1.5)
    out = L.flow_grpo_loss(logp, logp.detach(), adv, clip_range=1e-4, adv_clip_max=c)
    out.loss.backward()
    close(out.loss, mean(-clampf(a, -c, c) for a in vals(adv)))
    close(logp.grad, [-clampf(a, -c, c) / B for a in vals(adv)])
    assert float(out.clipfrac) == 0.0


def test_flow_grpo_kl_needs_kl():
    """Flow-GRPO (arXiv 2505.05470, eq. 8): β > 0 without a per-sample KL is refused."""
    x = torch.zeros(3, dtype=F64)
    with pytest.raises(ValueError):
        L.flow_grpo_loss(x, x, x, clip_range=0.2, adv_clip_max=1.0, kl_beta=0.1)


# ---------------------------------------------------------------- GRPO-Guard


def gaussian_step_log_prob(x_next: list[float], mu: list[float], s: float) -> float:
    return mean(-((x - m) ** 2) / (2 * s * s) - math.log(s) - LOG_SQRT_2PI for x, m in zip(x_next, mu))


def guard_setup(seed: int):
    g = gen(seed)
    B = 4
    mu_old = randn(g, B, 4, 2)
    mu_theta = mu_old + randn(g, B, 4, 2, scale=0.05)
    s = torch.rand(B, generator=g, dtype=F64) * 0.4 + 0.05
    noise = randn(g, B, 4, 2)
    x_next = mu_old + s.reshape(-1, 1, 1) * noise
    lp_theta = [gaussian_step_log_prob(xr, mr, si) for xr, mr, si in zip(rows(x_next), rows(mu_theta), vals(s))]
    lp_old = [gaussian_step_log_prob(xr, mr, si) for xr, mr, si in zip(rows(x_next), rows(mu_old), vals(s))]
    return mu_old, mu_theta, s, noise, lp_theta, lp_old


def test_guard_log_ratio_is_centered_noise_projection():
    """GRPO-Guard (arXiv 2510.22319, regulated ratio): s·(logp − logp_old) + mean(Δμ²)/(2s) == mean(ε·(μ_θ − μ_old))."""
    mu_old, mu_theta, s, noise, lp_theta, lp_old = guard_setup(3)
    got = L.guard_log_ratio(torch.tensor(lp_theta, dtype=F64), torch.tensor(lp_old, dtype=F64), s, mu_theta, mu_old,
                            ratio_norm=True)
    want = [mean(e * (a - b) for e, a, b in zip(er, tr, orow))
            for er, tr, orow in zip(rows(noise), rows(mu_theta), rows(mu_old))]
    assert max(abs(w) for w in want) > 1e-3  # not trivially zero
    close(got, want, rel=1e-8, abs_=1e-12)
    # the unnormalized one: TempFlow-GRPO's (arXiv 2508.04324) noise-aware weighting s·(logp − logp_old),
    # which is biased by −mean(Δμ²)/(2s)
    got_plain = L.guard_log_ratio(torch.tensor(lp_theta, dtype=F64), torch.tensor(lp_old, dtype=F64), s, mu_theta,
                                  mu_old, ratio_norm=False)
    want_plain = [si * (a - b) for si, a, b in zip(vals(s), lp_theta, lp_old)]
    close(got_plain, want_plain)
    bias = [w - p for w, p in zip(want, want_plain)]
    want_bias = [mean((a - b) ** 2 for a, b in zip(tr, orow)) / (2 * si)
                 for tr, orow, si in zip(rows(mu_theta), rows(mu_old), vals(s))]
    close(bias, want_bias, rel=1e-7, abs_=1e-12)


def test_flow_grpo_loss_with_guard_ratio():
    """GRPO-Guard (arXiv 2510.22319) in Flow-GRPO's eq. 8: ρ = exp(log ρ̃) in the clip, approx_kl still from logp − logp_old."""
    mu_old, mu_theta, s, noise, lp_theta, lp_old = guard_setup(4)
    g = gen(40)
    adv = randn(g, 4)
    lp_t, lp_o = torch.tensor(lp_theta, dtype=F64), torch.tensor(lp_old, dtype=F64)
    log_ratio = L.guard_log_ratio(lp_t, lp_o, s, mu_theta, mu_old)
    out = L.flow_grpo_loss(lp_t, lp_o, adv, clip_range=0.01, adv_clip_max=5.0, log_ratio=log_ratio)
    guard = [mean(e * (a - b) for e, a, b in zip(er, tr, orow))
             for er, tr, orow in zip(rows(noise), rows(mu_theta), rows(mu_old))]
    close(out.policy_loss, mean(ppo_reference(guard, vals(adv), 0.01, 5.0)), rel=1e-8)
    close(out.approx_kl, 0.5 * mean((a - b) ** 2 for a, b in zip(lp_theta, lp_old)))


# ---------------------------------------------------------------- sampling steps


def f32_exact(t: torch.Tensor) -> torch.Tensor:
    """Round to float32-representable values, kept in float64 for the reference."""
    return t.float().double()


def test_dance_step_mean_std_log_prob():
    """DanceGRPO (arXiv 2505.07818, eq. 4-5): mean = x + (v − ½a²·score)·dt, std = a·sqrt(−dt), Gaussian log p."""
    g = gen(5)
    B, a = 4, 0.7
    x, v = f32_exact(randn(g, B, 4, 2)), f32_exact(randn(g, B, 4, 2))
    sigma = torch.tensor([1.0, 0.75, 0.5, 0.25], dtype=F64)
    sigma_next = torch.tensor([0.875, 0.625, 0.375, 0.125], dtype=F64)
    x_next = f32_exact(randn(g, B, 4, 2))
    out = dance_step(x.float(), v.float(), sigma.float(), sigma_next.float(), a, next_latents=x_next.float())

    want_mean, want_std, want_lp = [], [], []
    for xr, vr, sg, sn, xn in zip(rows(x), rows(v), vals(sigma), vals(sigma_next), rows(x_next)):
        dt = sn - sg
        m = []
        for xi, vi in zip(xr, vr):
            x0_hat = xi - sg * vi
            score = -(xi - (1 - sg) * x0_hat) / sg**2
            m.append(xi + (vi - 0.5 * a * a * score) * dt)
        std = a * math.sqrt(-dt)
        want_mean.extend(m)
        want_std.append(std)
        want_lp.append(gaussian_step_log_prob(xn, m, std))
    close(out.mean, want_mean, rel=1e-5, abs_=1e-6)
    close(out.std, want_std, rel=1e-6)
    close(out.log_prob, want_lp, rel=1e-5, abs_=1e-5)
    assert torch.equal(out.next_latents, x_next.float())

    # a = 0: the Euler step x + v·dt, no log-prob
    euler = dance_step(x.float(), v.float(), sigma.float(), sigma_next.float(), 0.0)
    want_euler = [xi + vi * (sn - sg) for xr, vr, sg, sn in zip(rows(x), rows(v), vals(sigma), vals(sigma_next))
                  for xi, vi in zip(xr, vr)]
    close(euler.mean, want_euler, rel=1e-6, abs_=1e-6)
    assert euler.log_prob is None


def test_sde_step_mean_std_log_prob():
    """Flow-GRPO (arXiv 2505.05470, eq. 9): mean = x + [v + σ_t²/(2σ)(x + (1−σ)v)]·dt, std = σ_t·sqrt(−dt), σ_t = a·sqrt(σ/(1−σ))."""
    g = gen(6)
    B, a, sigma_max = 4, 0.7, 0.96875
    x, v = f32_exact(randn(g, B, 4, 2)), f32_exact(randn(g, B, 4, 2))
    sigma = torch.tensor([1.0, 0.75, 0.5, 0.25], dtype=F64)
    sigma_next = torch.tensor([0.96875, 0.625, 0.375, 0.125], dtype=F64)
    x_next = f32_exact(randn(g, B, 4, 2))
    out = sde_step(x.float(), v.float(), sigma.float(), sigma_next.float(), a, sigma_max=sigma_max,
                   next_latents=x_next.float())
    want_mean, want_std, want_lp = [], [], []
    for xr, vr, sg, sn, xn in zip(rows(x), rows(v), vals(sigma), vals(sigma_next), rows(x_next)):
        dt = sn - sg
        sg_tilde = sigma_max if sg >= 1 else sg
        std_t = a * math.sqrt(sg / (1 - sg_tilde))
        m = [xi + (vi + std_t**2 / (2 * sg) * (xi + (1 - sg) * vi)) * dt for xi, vi in zip(xr, vr)]
        std = std_t * math.sqrt(-dt)
        want_mean.extend(m)
        want_std.append(std)
        want_lp.append(gaussian_step_log_prob(xn, m, std))
    close(out.mean, want_mean, rel=1e-5, abs_=1e-5)
    close(out.std, want_std, rel=1e-6)
    close(out.log_prob, want_lp, rel=1e-5, abs_=1e-5)
    euler = sde_step(x.float(), v.float(), sigma.float(), sigma_next.float(), 0.0, sigma_max=sigma_max)
    want_euler = [xi + vi * (sn - sg) for xr, vr, sg, sn in zip(rows(x), rows(v), vals(sigma), vals(sigma_next))
                  for xi, vi in zip(xr, vr)]
    close(euler.mean, want_euler, rel=1e-6, abs_=1e-6)


# ---------------------------------------------------------------- AWM


AWM_EPS = 1e-10


def awm_reference(err: float, t: float, weighting: str, p: float) -> float:
    if weighting == "uniform":
        return -err
    if weighting == "t":
        return -t * err
    if weighting == "t2":
        return -t * t * err
    if weighting == "huber":
        return -t * (math.sqrt(err + AWM_EPS) - math.sqrt(AWM_EPS))
    if weighting == "ghuber":
        return -(t / p) * ((err + AWM_EPS) ** p - AWM_EPS**p)
    raise AssertionError(weighting)


@pytest.mark.parametrize("weighting", ["uniform", "t", "t2", "huber", "ghuber"])
def test_awm_log_prob_weightings(weighting):
    """AWM (arXiv 2509.25050, eq. 10; Flow-Factory weightings): log p = −w(t, ℓ) for uniform/t/t²/huber/ghuber."""
    g = gen(7)
    err = torch.rand(5, generator=g, dtype=F64) * 2
    err[0] = 1e-12  # where the ε of the (generalized) Huber matters
    t = torch.rand(5, generator=g, dtype=F64)
    p = 0.3
    got = L.awm_log_prob(err, t.reshape(5, 1), weighting, p)
    assert got.dtype == F64 and got.shape == (5,)
    close(got, [awm_reference(e, ti, weighting, p) for e, ti in zip(vals(err), vals(t))], rel=1e-12, abs_=1e-300)


def test_awm_log_prob_rejects_unknown_weighting():
    """AWM (arXiv 2509.25050): only the five documented weightings are accepted."""
    with pytest.raises(ValueError):
        L.awm_log_prob(torch.ones(2, dtype=F64), torch.ones(2, dtype=F64), "cubic")


def test_awm_loss_value():
    """AWM (arXiv 2509.25050, eq. 11): PPO clipped surrogate of ρ = exp(logp − logp_old), A clamped to ±c, + penalty."""
    g = gen(8)
    B, eps, c = 8, 0.1, 1.2
    old = randn(g, B)
    logp = old + randn(g, B, scale=0.2)
    adv = randn(g, B, scale=1.5)
    penalty = torch.tensor(0.0375, dtype=F64)
    out = L.awm_loss(logp, old, adv, clip_range=eps, adv_clip_max=c, penalty=penalty)
    d_list = vals(logp - old)
    policy = mean(ppo_reference(d_list, vals(adv), eps, c))
    # awm_loss forms ρ in float32 (`.float()` on the log-ratio), hence the float32-level tolerance
    close(out.policy_loss, policy, rel=1e-6, abs_=1e-7)
    close(out.loss, policy + 0.0375, rel=1e-6, abs_=1e-7)
    close(out.ratio, [math.exp(d) for d in d_list], rel=1e-6)
    close(out.clipfrac, mean(1.0 if abs(math.exp(d) - 1) > eps else 0.0 for d in d_list), rel=1e-7)  # float32
    no_pen = L.awm_loss(logp, old, adv, clip_range=eps, adv_clip_max=c)
    close(no_pen.loss, policy, rel=1e-6, abs_=1e-7)


@pytest.mark.parametrize("weighting", ["uniform", "t"])
def test_awm_on_policy_gradient_is_advantage_weighted_flow_matching(weighting):
    """AWM (arXiv 2509.25050, eq. 11-12): on policy, ∇_v L = ∇_v mean_i A_i·w_i·ℓ_i(v) = 2·A_i·w_i·(v_i − (ε_i − x0_i))/(N·B)."""
    g = gen(9)
    B, c = 4, 2.0
    v = randn(g, B, 4, 2).requires_grad_(True)
    x0, noise = randn(g, B, 4, 2), randn(g, B, 4, 2)
    t = torch.rand(B, generator=g, dtype=F64)
    adv = randn(g, B, scale=1.5)
    err = L.flow_matching_error(v, x0, noise)
    close(err, [mean((vi - (ni - xi)) ** 2 for vi, ni, xi in zip(vr, nr, xr))
                for vr, nr, xr in zip(rows(v), rows(noise), rows(x0))])
    logp = L.awm_log_prob(err, t, weighting)
    out = L.awm_loss(logp, logp.detach(), adv, clip_range=0.2, adv_clip_max=c)
    out.loss.backward()
    n = 8
    want = []
    for vr, nr, xr, a, ti in zip(rows(v), rows(noise), rows(x0), vals(adv), vals(t)):
        w = 1.0 if weighting == "uniform" else ti
        a = clampf(a, -c, c)
        want.extend(2 * a * w * (vi - (ni - xi)) / (n * B) for vi, ni, xi in zip(vr, nr, xr))
    # the ratio's backward runs in float32 (awm_loss casts the log-ratio), hence rel 1e-6
    close(v.grad, want, rel=1e-6, abs_=1e-9)


# ---------------------------------------------------------------- Diffusion-DPO


def test_dpo_loss_value_gradient_accuracy():
    """Diffusion-DPO (arXiv 2311.12908, eq. 14): mean −log σ(−β/2·((ℓ_w − ℓ_ref,w) − (ℓ_l − ℓ_ref,l)))."""
    g = gen(10)
    B, beta = 6, 5.0
    ew, el, rw, rl = (torch.rand(B, generator=g, dtype=F64).requires_grad_(True) for _ in range(4))
    out = L.dpo_loss(ew, el, rw, rl, beta=beta)
    z = [-beta / 2 * ((a - b) - (c - d)) for a, b, c, d in zip(vals(ew), vals(rw), vals(el), vals(rl))]
    assert any(zi > 0 for zi in z) and any(zi < 0 for zi in z)
    close(out.loss, mean(-log_sigmoid(zi) for zi in z))
    close(out.implicit_accuracy, mean(1.0 if zi > 0 else 0.0 for zi in z), rel=1e-7)  # a float32 fraction
    close(out.margin, mean(z))
    out.loss.backward()
    # ∂L/∂z_i = −σ(−z_i)/B; ∂z/∂ℓ_w = −β/2, ∂z/∂ℓ_l = +β/2 (the references with the opposite signs)
    d_w = [sigmoid(-zi) * beta / (2 * B) for zi in z]
    close(ew.grad, d_w)
    close(el.grad, [-d for d in d_w])
    close(rw.grad, [-d for d in d_w])
    close(rl.grad, d_w)


# ---------------------------------------------------------------- DGPO


def test_dgpo_loss_value_and_gradient():
    """DGPO (arXiv 2510.08425, eq. 9): mean_g −log σ(−(β/n)·Σ_i A_i(ℓ_gi − ℓ_ref,gi)), A clamped to ±c."""
    g = gen(11)
    G, n, beta, c = 3, 4, 20.0, 1.0
    err = torch.rand(G, n, generator=g, dtype=F64).requires_grad_(True)
    ref = torch.rand(G, n, generator=g, dtype=F64)
    adv = randn(g, G, n, scale=1.5)
    out = L.dgpo_loss(err, ref, adv, beta=beta, adv_clip_max=c)
    e_rows, r_rows, a_rows = rows(err), rows(ref), rows(adv)
    assert any(abs(a) > c for row in a_rows for a in row)
    z = [-(beta / n) * math.fsum(clampf(a, -c, c) * (e - r) for a, e, r in zip(ar, er, rr))
         for ar, er, rr in zip(a_rows, e_rows, r_rows)]
    close(out.loss, mean(-log_sigmoid(zg) for zg in z))
    close(out.implicit_accuracy, mean(1.0 if zg > 0 else 0.0 for zg in z), rel=1e-7)  # a float32 fraction
    close(out.margin, mean(z))
    out.loss.backward()
    # hand-derived: ∂L/∂ℓ_gi = −σ(−z_g)/G · (−(β/n)·A_gi) = σ(−z_g)·A_gi·β/(n·G)
    hand = [sigmoid(-zg) * clampf(a, -c, c) * beta / (n * G) for zg, ar in zip(z, a_rows) for a in ar]
    close(err.grad, hand)
    # Flow-Factory's gradient-equivalent form: σ(β/n·Σ_j A_j Δ_j)·A_i·(β/n)/G
    ff = []
    for ar, er, rr in zip(a_rows, e_rows, r_rows):
        s = sigmoid(beta / n * math.fsum(clampf(a, -c, c) * (e - r) for a, e, r in zip(ar, er, rr)))
        ff.extend(s * clampf(a, -c, c) * (beta / n) / G for a in ar)
    close(err.grad, ff)


# ---------------------------------------------------------------- CRD


def crd_reference(err_rows, old_rows, adv_rows, beta, c, kind, kl_rows=None, kl_beta=0.0, adaptive=False):
    """Returns (loss, policy, kl_loss, implicit_reward, per-element grad wrt err)."""
    G, n = len(err_rows), len(err_rows[0])
    distill, grad, r_theta_all, kl_terms = [], [], [], []
    for g_i in range(G):
        r = [clampf(clampf(a, -c, c) / (2 * c) + 0.5, 0.0, 1.0) for a in adv_rows[g_i]]
        r_c = [ri - mean(r) for ri in r]
        r_th = [-(e - o) for e, o in zip(err_rows[g_i], old_rows[g_i])]
        r_thc = [ri - mean(r_th) for ri in r_th]
        r_theta_all.extend(r_th)
        if kind == "mse":
            resid = [beta * a - b for a, b in zip(r_thc, r_c)]
            distill.extend(x * x for x in resid)
            # ∂/∂ℓ_k of c/β·mean((β R_θc − R_c)²) = −2c/(Gn)·(resid_k − mean(resid)), mean(resid) = 0
            grad.extend(-2 * c / (G * n) * (x - mean(resid)) for x in resid)
        else:
            x = [beta * a for a in r_thc]
            y = [sigmoid(b) for b in r_c]
            distill.extend(-(yi * log_sigmoid(xi) + (1 - yi) * log_sigmoid(-xi)) for xi, yi in zip(x, y))
            resid = [sigmoid(xi) - yi for xi, yi in zip(x, y)]
            grad.extend(-c / (G * n) * (q - mean(resid)) for q in resid)
        if kl_rows is not None:
            floor = 1e-4 / kl_beta if kl_beta > 0 else 0.0
            for ri, k in zip(r, kl_rows[g_i]):
                w = floor + ri * (1 - floor) if adaptive else 1.0
                kl_terms.append(w * k)
    policy = mean(distill) * c / beta
    kl_loss = mean(kl_terms) if (kl_rows is not None and kl_beta > 0) else 0.0
    return policy + kl_beta * kl_loss, policy, kl_loss, mean(r_theta_all), grad


@pytest.mark.parametrize("kind", ["mse", "bce"])
@pytest.mark.parametrize("kl_mode", ["none", "plain", "adaptive"])
def test_crd_loss_value_and_gradient(kind, kl_mode):
    """CRD (arXiv 2603.14128, eq. 8-10): group-centered r_θ = −(ℓ − ℓ_old) distilled onto centered r, mse or bce, ×c/β, + KL."""
    g = gen(12)
    G, n, beta, c, kl_beta = 3, 4, 0.7, 1.5, 0.01
    err = torch.rand(G, n, generator=g, dtype=F64).requires_grad_(True)
    old = torch.rand(G, n, generator=g, dtype=F64)
    adv = randn(g, G, n, scale=1.5)
    kl = torch.rand(G, n, generator=g, dtype=F64)
    kwargs = {} if kl_mode == "none" else dict(kl=kl, kl_beta=kl_beta, reward_adaptive_kl=kl_mode == "adaptive")
    out = L.crd_loss(err, old, adv, beta=beta, adv_clip_max=c, kind=kind, **kwargs)
    loss, policy, kl_loss, implicit, grad = crd_reference(
        rows(err), rows(old), rows(adv), beta, c, kind,
        kl_rows=None if kl_mode == "none" else rows(kl), kl_beta=0.0 if kl_mode == "none" else kl_beta,
        adaptive=kl_mode == "adaptive")
    assert any(abs(a) > c for row in rows(adv) for a in row)
    close(out.policy_loss, policy)
    close(out.kl_loss, kl_loss)
    close(out.loss, loss)
    close(out.implicit_reward, implicit)
    out.loss.backward()
    close(err.grad, grad, rel=1e-9, abs_=1e-13)
    # and the hand-derived gradient agrees with a finite difference of the reference
    old_rows, adv_rows = rows(old), rows(adv)
    fd = finite_diff(lambda flat: crd_reference([flat[i * n:(i + 1) * n] for i in range(G)], old_rows, adv_rows,
                                                beta, c, kind)[0], vals(err))
    close(grad, fd, rel=1e-6, abs_=1e-8)


def test_nft_reward_weight_table():
    """DiffusionNFT (arXiv 2509.16117, eq. 11): r = clamp(clamp(A, ±c)/(2c) + 0.5, 0, 1)."""
    adv = torch.tensor([-10.0, -2.0, -1.0, 0.0, 0.5, 2.0, 7.0], dtype=F64)
    close(L.nft_reward_weight(adv, 2.0), [0.0, 0.0, 0.25, 0.5, 0.625, 1.0, 1.0])


# ---------------------------------------------------------------- schedules and weighting


@pytest.mark.parametrize("step,want", [(0, 0.5), (9, 0.5), (10, 0.5), (11, 0.52), (20, 0.7), (34, 0.98),
                                       (35, 0.99), (36, 0.99), (1000, 0.99)])
def test_snapshot_decay_table(step, want):
    """CRD (arXiv 2603.14128, snapshot schedule): value before start, then min(value + (step − start)·slope, end)."""
    assert L.snapshot_decay(step, (10, 0.5, 0.02, 0.99)) == pytest.approx(want, rel=1e-12)


def test_adaptive_mse_value_and_stop_gradient():
    """DiffusionNFT (arXiv 2509.16117, adaptive weighting): mean(e²)/sg(max(mean|e|, 1e-5)), gradient 2e/(N·max(mean|e|, 1e-5))."""
    g = gen(13)
    e = randn(g, 4, 4, 2)
    e[3] = e[3] * 1e-7  # this sample's mean|e| is under the 1e-5 floor
    e.requires_grad_(True)
    got = L.adaptive_mse(e)
    N = 8
    denom = [max(mean(abs(x) for x in r), 1e-5) for r in rows(e)]
    assert denom[3] == 1e-5 and denom[0] > 1e-5
    close(got, [mean(x * x for x in r) / d for r, d in zip(rows(e), denom)], rel=1e-10, abs_=1e-300)
    got.sum().backward()
    want = [2 * x / (N * d) for r, d in zip(rows(e), denom) for x in r]
    close(e.grad, want, rel=1e-10, abs_=1e-300)


def test_awm_ema_schedules_are_flow_factorys_per_rollout():
    """--awm-ema-schedule: constant, linear (d·min(k/W, 1)) and power (min(d, (1 + k)/(W + k))), k the rollout from 0."""
    from types import SimpleNamespace

    from diffrl.train.objectives.awm import awm_ema_decay

    def decay(schedule, k):
        return awm_ema_decay(SimpleNamespace(awm_ema_decay=0.3, awm_ema_schedule=schedule, awm_ema_warmup=10), k)

    assert [decay("constant", k) for k in (0, 5, 50)] == [0.3, 0.3, 0.3]
    assert [decay("linear", k) for k in (0, 5, 10, 50)] == pytest.approx([0.0, 0.15, 0.3, 0.3])
    assert [decay("power", k) for k in (0, 1, 50)] == pytest.approx([0.1, 2 / 11, 0.3])
