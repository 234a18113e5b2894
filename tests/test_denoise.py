"""The denoising loop: reproducible per sample, SDE steps logged, indices validated."""

import pytest
import torch

from diffrl.engine import denoise
from diffrl.sampling import make_generators


def _run(family, seeds, **kwargs):
    gens = make_generators(seeds)
    latents = family.prepare_latents(gens, 64, 64)
    cond = family.encode_prompts(["a red circle"]).repeat(len(seeds))
    uncond = family.encode_prompts([""]).repeat(len(seeds))
    return denoise(family, latents, family.sigmas(4, 64, 64), cond, uncond, 3.0, generators=gens, **kwargs)


@pytest.mark.parametrize("sde_type", ["ode", "sde", "cps"])
def test_sample_k_does_not_depend_on_its_batch(tiny_family, sde_type):
    kwargs = dict(sde_type=sde_type, noise_level=0.7, sde_step_indices=[1, 2], return_step_indices=[1, 2, 4])
    full = _run(tiny_family, [100, 101, 102, 103], **kwargs)
    for k, seed in enumerate([100, 101, 102, 103]):
        alone = _run(tiny_family, [seed], **kwargs)
        assert torch.equal(alone.latents[0], full.latents[k])
        assert torch.equal(alone.log_probs[0], full.log_probs[k])
    assert full.log_probs.shape == (4, 2)
    assert sorted(full.trajectory) == [1, 2, 4]
    assert torch.equal(full.trajectory[4], full.latents)
    if sde_type == "ode":
        assert torch.equal(full.log_probs, torch.zeros(4, 2))
    else:
        assert torch.isfinite(full.log_probs).all() and full.log_probs.abs().sum() > 0


def test_sde_with_zero_noise_reproduces_ode(tiny_family):
    ode = _run(tiny_family, [1, 2], sde_type="ode")
    sde = _run(tiny_family, [1, 2], sde_type="sde", noise_level=0.0, sde_step_indices=[0, 1, 2, 3])
    assert torch.equal(ode.latents, sde.latents)


def test_noise_changes_the_sample(tiny_family):
    ode = _run(tiny_family, [1], sde_type="ode")
    sde = _run(tiny_family, [1], sde_type="sde", noise_level=0.7, sde_step_indices=[0])
    assert not torch.allclose(ode.latents, sde.latents)


def test_bad_indices_and_types_are_refused(tiny_family):
    with pytest.raises(ValueError, match=r"sde_step_indices \[4\] out of range 0..3"):
        _run(tiny_family, [1], sde_type="sde", noise_level=0.7, sde_step_indices=[4])
    with pytest.raises(ValueError, match=r"return_step_indices \[-1\]"):
        _run(tiny_family, [1], return_step_indices=[-1])
    with pytest.raises(ValueError, match="unknown sde type 'bogus'"):
        _run(tiny_family, [1], sde_type="bogus")
