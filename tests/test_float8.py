"""--float8: the blocks' linear layers as FP8 matmuls with rowwise scales, the same in rollout and training."""

import pytest
import torch

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.models.float8 import Float8Linear, convert_blocks_to_float8, convertible
from diffrl.models.lora import LoraSpec, add_lora
from diffrl.models.speed import SpeedOptions
from diffrl.train.trainer import Trainer
from test_engine import _group_through_manager
from test_trainer import tiny_config


def _relative(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_float8_linear_is_the_linear_to_fp8_rounding_forward_and_backward():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(3, 5, 64, requires_grad=True)
    grad = torch.randn(3, 5, 96)
    linear(x).backward(grad)
    want = {"y": linear(x).detach(), "x": x.grad.clone(), "w": linear.weight.grad.clone(), "b": linear.bias.grad.clone()}
    x.grad = linear.weight.grad = linear.bias.grad = None
    keys = list(linear.state_dict())
    Float8Linear.from_linear(linear)
    y = linear(x)
    y.backward(grad)
    assert list(linear.state_dict()) == keys and y.dtype == torch.float32 and x.grad.dtype == torch.float32
    # e4m3 keeps 3 mantissa bits: a few percent per product, not more; the weight's gradient is bf16's.
    assert 0 < _relative(y, want["y"]) < 0.06 and 0 < _relative(x.grad, want["x"]) < 0.06
    assert _relative(linear.weight.grad, want["w"]) < 0.01 and _relative(linear.bias.grad, want["b"]) < 0.01
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert linear(x).dtype == torch.bfloat16


def test_a_rows_result_does_not_depend_on_its_batchmates():
    torch.manual_seed(0)
    linear = Float8Linear.from_linear(torch.nn.Linear(32, 48))
    x = torch.randn(6, 32)
    x[1:] *= 100  # batchmates with a far larger range would change a per-tensor scale
    assert torch.equal(linear(x[:1]), linear(x)[:1])


def test_only_qualifying_block_layers_convert(tiny_family):
    assert convertible("attn.to_q", torch.nn.Linear(16, 16))
    assert not convertible("attn.to_q", torch.nn.Linear(16, 20))  # _scaled_mm needs multiples of 16
    assert not convertible("norm1.linear", torch.nn.Linear(16, 96))  # a modulation: one row per sample
    assert not convertible("attn.to_q.lora_A.default", torch.nn.Linear(16, 16))
    transformer = tiny_family.transformer
    add_lora(transformer, LoraSpec(rank=4, alpha=4.0, target_modules=["attn.to_q", "attn.to_v"]))
    names = list(transformer.state_dict())
    count = convert_blocks_to_float8(transformer, tiny_family.block_lists)
    converted = {n for n, m in transformer.named_modules() if isinstance(m, Float8Linear)}
    assert count == len(converted) > 0 and list(transformer.state_dict()) == names
    assert all(n.endswith("to_q.base_layer") or ".to_q" not in n for n in converted)
    assert not any("lora_" in n or n.startswith(("proj_out", "norm_out", "x_embedders", "context_embedder"))
                   for n in converted)


def _group(engine, microgroup_size):
    return _group_through_manager(engine, microgroup_size, n=8)


def test_sample_k_is_the_same_in_any_microgroup_and_differs_from_bf16_by_rounding(tiny_family):
    plain = _group(Engine(tiny_family, EngineConfig(max_outputs_per_request=8)), 8)
    SpeedOptions(float8=True).apply(tiny_family)
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    reference = _group(engine, 8)
    for m in (1, 3):
        for ref, sample in zip(reference, _group(engine, m), strict=True):
            assert torch.equal(sample.output.generated_output, ref.output.generated_output), (m, sample.sample_index)
            assert torch.equal(sample.output.rollout_log_probs, ref.output.rollout_log_probs)
    images = torch.stack([s.output.generated_output for s in reference]).float()
    plain_images = torch.stack([s.output.generated_output for s in plain]).float()
    assert 0 < _relative(images, plain_images) < 0.2


@pytest.mark.parametrize("use_lora", [False, True])
def test_training_with_float8_is_on_policy_and_moves_the_trained_weights(tiny_model_dir, tmp_path, use_lora):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=use_lora, float8=True))
    assert any(isinstance(m, Float8Linear) for m in trainer.policy.family.transformer.modules())
    frozen = {n: p.detach().clone() for n, p in trainer.policy.family.transformer.named_parameters()
              if "lora_" not in n}
    before = [p.detach().clone() for p in trainer.policy.params]
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.params))
    if use_lora:  # the FP8 base layers under the adapter stay as they were
        after = dict(trainer.policy.family.transformer.named_parameters())
        assert all(torch.equal(after[n], p) for n, p in frozen.items())


def test_float8_with_fused_qkv_is_refused():
    with pytest.raises(ValueError, match="--float8 with --fuse-qkv"):
        SpeedOptions(float8=True, fuse_qkv=True).check()
