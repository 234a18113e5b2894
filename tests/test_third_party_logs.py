"""diffusers' keep-in-float32 warning on a cast of a model that keeps no module in float32 is dropped; a model
that does keep some still warns, and the cast's numbers are the same."""

from __future__ import annotations

import logging

import pytest
import torch
from diffusers import AutoencoderKL


@pytest.fixture
def diffusers_warnings():
    import diffrl.models  # noqa: F401  (installs the filter, as any command that loads a model does)

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logger = logging.getLogger("diffusers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(block_out_channels=(8,), norm_num_groups=4, latent_channels=2, layers_per_block=1)


def test_a_cast_of_a_model_without_fp32_modules_says_nothing(diffusers_warnings):
    vae = tiny_vae()
    expected = {name: t.detach().to(torch.bfloat16) for name, t in vae.state_dict().items()}
    vae.to(torch.bfloat16)
    vae.to(dtype=torch.float32)
    assert not [m for m in diffusers_warnings if "should be kept in float32" in m]
    # the same cast as before the filter: tensor by tensor, bfloat16 then back
    vae2 = tiny_vae().to(torch.bfloat16)
    assert all(torch.equal(t, expected[name]) for name, t in vae2.state_dict().items())


def test_a_model_that_keeps_fp32_modules_still_warns(diffusers_warnings):
    class KeepsNorms(AutoencoderKL):
        _keep_in_fp32_modules = ["norm"]

    torch.manual_seed(0)
    KeepsNorms(block_out_channels=(8,), norm_num_groups=4, latent_channels=2, layers_per_block=1).to(torch.bfloat16)
    assert [m for m in diffusers_warnings if "should be kept in float32: ['norm']" in m]
