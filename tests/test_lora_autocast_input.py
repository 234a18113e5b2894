"""LoRA layers under autocast take their input in the autocast dtype: no fp32 copy of it, the same numbers."""

import copy

import torch
from torch.profiler import ProfilerActivity, profile

from diffrl.models.lora import LoraSpec, add_lora


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(32, 32)
        self.ff = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.ff(torch.nn.functional.gelu(self.to_q(x)))


def _peft_cast_back(model):
    """The same model with peft's own input cast (what every adapter layer did before)."""
    from peft.tuners.lora import LoraLayer

    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, LoraLayer):
            module.__class__ = type(module).__mro__[2]  # past the subclass and its mixin
    return plain


def _copies(model, x) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        model(x)
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")


def test_lora_input_stays_bf16_under_autocast_with_the_same_outputs_and_gradients():
    from diffusers.models.modeling_utils import ModelMixin  # peft's add_adapter lives on diffusers' models

    class Model(ModelMixin):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def forward(self, x):
            return self.block(x)

    from diffusers.loaders import PeftAdapterMixin

    Model = type("Model", (Model, PeftAdapterMixin), {})  # noqa: N806
    torch.manual_seed(0)
    model = Model().to(torch.bfloat16)
    add_lora(model, LoraSpec(rank=4, alpha=4.0, target_modules=["to_q", "ff"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_()  # a trained adapter (B starts at zero)
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)
    plain = _peft_cast_back(model)
    assert type(plain.block.to_q) is not type(model.block.to_q)
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(model(x), plain(x))
        assert _copies(model, x) < _copies(plain, x)  # the fp32 copies of each adapted layer's input are gone
        xs = [x.clone().requires_grad_() for _ in range(2)]
        for m, xi in zip((model, plain), xs, strict=True):
            m(xi).float().square().sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
    grads = [{n: p.grad for n, p in m.named_parameters() if "lora_" in n} for m in (model, plain)]
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])
    # Without autocast the input is cast to the adapter's dtype, as peft does (fp32 adapter on an fp32 input here).
    model.float()
    assert model(x.float()).dtype == torch.float32
    twin = copy.deepcopy(model)  # an old policy or a reference keeps the behaviour
    assert type(twin.block.to_q) is type(model.block.to_q)
