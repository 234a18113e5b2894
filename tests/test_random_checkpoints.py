"""Random checkpoints built in code: the weights a seed gives do not depend on the device that builds them."""

import pytest
import torch

from diffrl.models.random_checkpoints import fill_normal_


def test_fill_normal_draws_what_the_cpu_generator_draws_into_a_parameter_on_any_device():
    want = torch.empty(4, 5).normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    param = torch.nn.Parameter(torch.empty(4, 5, dtype=torch.float64))
    fill_normal_(param, 0.1, torch.Generator().manual_seed(3))
    assert torch.equal(param.data.float(), want) and param.requires_grad
    # A parameter built under another default device (a GPU's, when the real sizes are built there): drawn on the
    # CPU and copied, where `param.normal_(generator=cpu_generator)` raises.
    with torch.device("meta"):
        elsewhere = torch.nn.Parameter(torch.empty(4, 5))
    fill_normal_(elsewhere, 1.0, torch.Generator().manual_seed(3))
    if torch.cuda.is_available():
        on_gpu = torch.nn.Parameter(torch.empty(4, 5, device="cuda"))
        fill_normal_(on_gpu, 0.1, torch.Generator().manual_seed(3))
        assert torch.equal(on_gpu.data.cpu(), want)
    else:
        pytest.skip("no GPU: the copy onto a CUDA parameter is checked where one exists")


def test_built_in_makes_modules_in_the_stored_dtype_and_restores_the_default():
    from diffrl.utils.device import built_in

    with built_in("cpu", torch.bfloat16):
        layer = torch.nn.Linear(4, 3)
    assert layer.weight.dtype == torch.bfloat16 and torch.get_default_dtype() == torch.float32
    with pytest.raises(RuntimeError), built_in("cpu", torch.bfloat16):
        raise RuntimeError("a failed build")
    assert torch.get_default_dtype() == torch.float32
