"""The shared sampling math: schedules, per-sample noise and the three transitions."""

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffrl.sampling import (
    cps_step,
    flux2_empirical_mu,
    make_generators,
    make_sigmas,
    ode_step,
    randn_per_sample,
    resolution_mu,
    sde_step,
    transition,
)


def _fixed_inputs(batch=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 16, 12, generator=g)
    v = torch.randn(batch, 16, 12, generator=g)
    return x, v


@pytest.mark.parametrize("num_steps,shift", [(10, 1.0), (10, 3.0), (28, 3.0), (4, 5.0)])
def test_static_shift_matches_diffusers(num_steps, shift):
    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps))
    ours = make_sigmas(num_steps, shift=shift)
    assert ours.shape == scheduler.sigmas.shape
    torch.testing.assert_close(ours, scheduler.sigmas.float(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("image_seq_len,num_steps", [(256, 10), (1024, 28), (4096, 50), (6000, 20)])
def test_dynamic_shift_matches_diffusers(image_seq_len, num_steps):
    for mu in (resolution_mu(image_seq_len), flux2_empirical_mu(image_seq_len, num_steps)):
        scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
        torch.testing.assert_close(make_sigmas(num_steps, mu=mu), scheduler.sigmas.float(), rtol=0, atol=1e-6)


def test_schedule_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_steps"):
        make_sigmas(0)
    with pytest.raises(ValueError, match="not both"):
        make_sigmas(10, shift=3.0, mu=1.0)


def test_sde_with_zero_noise_equals_ode_exactly():
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10, shift=3.0)
    for i in range(10):
        sde = sde_step(x, v, sigmas[i], sigmas[i + 1], 0.0, sigma_max=float(sigmas[1]))
        ode = ode_step(x, v, sigmas[i], sigmas[i + 1])
        assert torch.equal(sde.next_latents, ode.next_latents)
        assert sde.log_prob is None


def _gaussian_log_density_f64(x_next, mean, std):
    """Independent float64 reference: mean over dims of log N(x'; mean, std²)."""
    x_next, mean = x_next.double(), mean.double()
    std = std.double().reshape(-1, *([1] * (x_next.ndim - 1)))
    log_pdf = -((x_next - mean) ** 2) / (2 * std**2) - torch.log(std * math.sqrt(2 * math.pi))
    return log_pdf.flatten(1).mean(1)


def _sde_mean_std_f64(x, v, sigma, sigma_next, a, sigma_max):
    x, v = x.double(), v.double()
    dt = sigma_next - sigma
    sig_tilde = sigma_max if sigma == 1.0 else sigma
    std_t = a * math.sqrt(sigma / (1 - sig_tilde))
    mean = x * (1 + std_t**2 / (2 * sigma) * dt) + v * (1 + std_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_t * math.sqrt(-dt)


@pytest.mark.parametrize("step", [0, 3, 9])
def test_sde_log_prob_matches_float64_gaussian(step):
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10, shift=3.0).double()
    sigma, sigma_next, sigma_max, a = float(sigmas[step]), float(sigmas[step + 1]), float(sigmas[1]), 0.7
    out = sde_step(x, v, sigma, sigma_next, a, sigma_max=sigma_max, generators=make_generators([1, 2, 3]))
    mean64, std64 = _sde_mean_std_f64(x, v, sigma, sigma_next, a, sigma_max)
    torch.testing.assert_close(out.mean.double(), mean64, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.std.double(), torch.full((3,), std64, dtype=torch.float64), rtol=1e-6, atol=0)
    reference = _gaussian_log_density_f64(out.next_latents, mean64, torch.full((3,), std64))
    torch.testing.assert_close(out.log_prob.double(), reference, rtol=0, atol=1e-6)
    # Scoring the drawn latent again (the trainer's path) gives the same log-prob bit for bit.
    rescored = sde_step(x, v, sigma, sigma_next, a, sigma_max=sigma_max, next_latents=out.next_latents)
    assert torch.equal(rescored.log_prob, out.log_prob)


def test_sde_log_prob_without_constants_is_sglangs_squared_error():
    """`rollout_log_prob_no_const` means what sglang-diffusion's scheduler computes: −mean((x' − mean)²), with
    neither the constants nor the 1/(2·std²) of the Gaussian; the same draw, only the score differs."""
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10, shift=3.0)
    kwargs = dict(sigma_max=float(sigmas[1]), generators=make_generators([5, 6, 7]))
    full = sde_step(x, v, sigmas[2], sigmas[3], 0.7, **kwargs)
    bare = sde_step(x, v, sigmas[2], sigmas[3], 0.7, sigma_max=float(sigmas[1]),
                    next_latents=full.next_latents, log_prob_no_const=True)
    squared_error = ((full.next_latents.double() - full.mean.double()) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(bare.log_prob.double(), -squared_error, rtol=1e-6, atol=0)
    std = full.std.double()
    gaussian = -squared_error / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    torch.testing.assert_close(full.log_prob.double(), gaussian, rtol=0, atol=1e-5)


def test_cps_log_prob_matches_float64_reference():
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10, shift=3.0).double()
    a = 0.6
    for step in (0, 4, 8):
        sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
        out = cps_step(x, v, sigma, sigma_next, a, generators=make_generators([11, 12, 13]))
        std = sigma_next * math.sin(a * math.pi / 2)
        x64, v64 = x.double(), v.double()
        mean64 = (1 - sigma_next) * (x64 - sigma * v64) + math.sqrt(sigma_next**2 - std**2) * (x64 + (1 - sigma) * v64)
        torch.testing.assert_close(out.mean.double(), mean64, rtol=0, atol=1e-5)
        reference = -((out.next_latents.double() - mean64) ** 2).flatten(1).mean(1)
        torch.testing.assert_close(out.log_prob.double(), reference, rtol=0, atol=1e-6)
        # The drawn latent really has the stated spread around the mean.
        assert abs(float((out.next_latents.double() - mean64).std()) - std) < 0.1 * std


def test_last_sde_step_to_zero_is_finite():
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10, shift=3.0)
    out = sde_step(x, v, sigmas[9], sigmas[10], 0.7, sigma_max=float(sigmas[1]), generators=make_generators([1, 2, 3]))
    assert torch.isfinite(out.next_latents).all() and torch.isfinite(out.log_prob).all()


def test_same_seed_same_noise_on_any_batch_size():
    shape = (4, 8, 8)
    alone = randn_per_sample((1, *shape), make_generators([42]))
    for batch_seeds in ([42, 1, 2], [7, 42], [3, 4, 5, 6, 42]):
        batch = randn_per_sample((len(batch_seeds), *shape), make_generators(batch_seeds))
        assert torch.equal(batch[batch_seeds.index(42)], alone[0])


def test_sde_draws_are_per_sample_and_batch_independent():
    x, v = _fixed_inputs(batch=4)
    sigmas = make_sigmas(10, shift=3.0)
    seeds = [10, 11, 12, 13]
    full = sde_step(x, v, sigmas[1], sigmas[2], 0.7, sigma_max=float(sigmas[1]), generators=make_generators(seeds))
    for k in range(4):
        one = sde_step(x[k : k + 1], v[k : k + 1], sigmas[1], sigmas[2], 0.7, sigma_max=float(sigmas[1]),
                       generators=make_generators([seeds[k]]))
        assert torch.equal(one.next_latents[0], full.next_latents[k])
        assert torch.equal(one.log_prob[0], full.log_prob[k])


def test_transition_dispatch_and_errors():
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10)
    ode = transition("ode", x, v, sigmas[0], sigmas[1], 0.7, sigma_max=float(sigmas[1]))
    assert torch.equal(ode.next_latents, ode_step(x, v, sigmas[0], sigmas[1]).next_latents)
    with pytest.raises(ValueError, match="unknown sde type 'foo'"):
        transition("foo", x, v, sigmas[0], sigmas[1], 0.7, sigma_max=0.9)
    with pytest.raises(ValueError, match="generators"):
        transition("sde", x, v, sigmas[0], sigmas[1], 0.7, sigma_max=0.9)
    with pytest.raises(ValueError, match="3 samples needs 3 generators"):
        sde_step(x, v, sigmas[0], sigmas[1], 0.7, sigma_max=0.9, generators=make_generators([1]))


def test_per_sample_sigmas_match_scalar_calls():
    """Train batches mix timesteps: a `[B]` sigma gives each row the scalar-call result."""
    x, v = _fixed_inputs()
    sigmas = make_sigmas(10, shift=3.0)
    idx = [0, 4, 7]
    mixed = sde_step(x, v, sigmas[idx], sigmas[[i + 1 for i in idx]], 0.7, sigma_max=float(sigmas[1]),
                     generators=make_generators([1, 2, 3]))
    for row, i in enumerate(idx):
        one = sde_step(x[row : row + 1], v[row : row + 1], sigmas[i], sigmas[i + 1], 0.7,
                       sigma_max=float(sigmas[1]), generators=make_generators([row + 1]))
        torch.testing.assert_close(one.log_prob[0], mixed.log_prob[row], rtol=0, atol=0)


def test_noised_interpolates_data_and_noise_per_sample():
    from diffrl.sampling import noised

    x0, eps = torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    sigma = torch.tensor([0.0, 0.25, 1.0])
    x = noised(x0, eps, sigma)
    assert torch.equal(x[0], x0[0]) and torch.equal(x[2], eps[2])
    assert torch.allclose(x[1], 0.75 * x0[1] + 0.25 * eps[1])
    # An Euler step along the flow's velocity ε − x0 stays on the path.
    assert torch.allclose(ode_step(x, eps - x0, sigma, sigma - 0.1).next_latents, noised(x0, eps, sigma - 0.1), atol=1e-6)
