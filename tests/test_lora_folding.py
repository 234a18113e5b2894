"""`--fold-lora-without-grad`: forwards without gradients run an adapted linear layer as one matmul with the adapter
folded into its weight. It gives the unfolded layer's result up to one rounding (exactly while B = 0), never runs
the adapter's thin matmuls on the activations, leaves trained forwards and a switched-off adapter as they were, and
is on by default only for the methods whose no-gradient forwards are sampling and targets."""

import copy

import pytest
import torch
from diffusers.loaders import PeftAdapterMixin
from diffusers.models.modeling_utils import ModelMixin

from diffrl.models.lora import LoraSpec, add_lora, current_lora, lora_folding, set_lora_folding
from diffrl.train.config import TrainConfig


class _Model(ModelMixin, PeftAdapterMixin):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(48, 40)
        self.ff = torch.nn.Linear(40, 32, bias=False)

    def forward(self, x):
        return self.ff(torch.nn.functional.gelu(self.to_q(x)))


def _adapted(fold: bool, trained: bool = True, dtype=torch.float32) -> _Model:
    torch.manual_seed(0)
    model = _Model().to(dtype)
    add_lora(model, LoraSpec(rank=4, alpha=8.0, target_modules=["to_q", "ff"], fold_without_grad=fold))
    if trained:  # B starts at zero: give the adapter a delta of the base weights' order
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(std=0.3)
    return model


def _refuse_thin_matmuls(model, monkeypatch):
    for module in model.modules():
        if hasattr(module, "lora_A"):
            for thin in (*module.lora_A.values(), *module.lora_B.values()):
                monkeypatch.setattr(thin, "forward", lambda *_: pytest.fail("an adapter matmul ran on activations"))


def test_a_folded_forward_is_the_unfolded_one_up_to_rounding_without_the_thin_matmuls(monkeypatch):
    folded, plain = _adapted(True), _adapted(False)
    assert lora_folding(folded) and not lora_folding(plain)
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        reference = plain(x)
        _refuse_thin_matmuls(folded, monkeypatch)
        out = folded(x)
    assert out.shape == reference.shape and not torch.equal(out, reference)  # another order of the same sums
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        plain.disable_adapters()
        assert (plain(x) - reference).abs().max() > 0.1  # the adapter matters: a fold that dropped it fails above


def test_under_autocast_the_fold_rounds_once_and_is_exact_while_b_is_zero():
    x = torch.randn(3, 5, 48, dtype=torch.bfloat16)
    for trained in (False, True):
        folded, plain = _adapted(True, trained, torch.bfloat16), _adapted(False, trained, torch.bfloat16)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out, reference = folded(x), plain(x)
        assert out.dtype == reference.dtype == torch.bfloat16
        if not trained:
            assert torch.equal(out, reference)
        else:  # a bf16 matmul of rounded weights against a bf16 matmul plus the adapter's: bf16's epsilon apart
            torch.testing.assert_close(out.float(), reference.float(), rtol=0.03, atol=0.03)


def test_trained_forwards_and_a_switched_off_adapter_do_not_fold():
    folded, plain = _adapted(True), _adapted(False)
    x = torch.randn(2, 9, 48)
    out, reference = folded(x), plain(x)  # gradients on
    assert torch.equal(out, reference)
    out.square().sum().backward()
    reference.square().sum().backward()
    for (name, p), (_, q) in zip(folded.named_parameters(), plain.named_parameters(), strict=True):
        if "lora_" in name:
            assert p.grad is not None and torch.equal(p.grad, q.grad), name
    with torch.no_grad():
        folded.disable_adapters()
        plain.disable_adapters()
        assert torch.equal(folded(x), plain(x))  # the base model alone (a LoRA run's reference)


def test_the_setting_travels_with_the_spec_and_copies():
    model = _adapted(True)
    spec = current_lora(model)
    assert spec.fold_without_grad and LoraSpec.model_validate_json(spec.model_dump_json()) == spec
    twin = copy.deepcopy(model)  # an engine copy keeps it
    assert lora_folding(twin)
    assert set_lora_folding(twin, False) == 2 and not lora_folding(twin) and not current_lora(twin).fold_without_grad


def test_the_methods_whose_no_grad_forwards_are_targets_fold_by_default_and_ratio_methods_refuse_it():
    assert TrainConfig.flat(loss_type="nft").model.folds_lora("nft")
    assert not TrainConfig.flat(loss_type="flow_grpo").model.folds_lora("flow_grpo")
    assert not TrainConfig.flat(loss_type="nft", fold_lora_without_grad="off").model.folds_lora("nft")
    assert not TrainConfig.flat(loss_type="nft", use_lora=False).model.folds_lora("nft")
    for loss_type in ("flow_grpo", "awm"):
        with pytest.raises(ValueError, match=f"--fold-lora-without-grad on with --loss-type {loss_type}: its loss sets"):
            TrainConfig.flat(loss_type=loss_type, fold_lora_without_grad="on").check()
    with pytest.raises(ValueError, match="a full finetune \\(--no-use-lora\\) has none"):
        TrainConfig.flat(loss_type="nft", use_lora=False, fold_lora_without_grad="on").check()


def test_an_nft_run_samples_folded_and_its_engine_adapter_says_so(tiny_model_dir, tmp_path):
    from diffrl.engine.engine import Engine
    from diffrl.models.checkpoint import load_model
    from diffrl.train.trainer import Trainer

    trainer = Trainer(TrainConfig.flat(model_path=tiny_model_dir, output_dir=tmp_path / "run", loss_type="nft",
                                       eval_images_per_category=0))
    spec = trainer.policy.lora
    assert spec.fold_without_grad and lora_folding(trainer.policy.family.transformer)
    engine = Engine(load_model(tiny_model_dir))  # a remote engine given the trainer's spec folds as well
    assert engine.add_lora_adapter(LoraSpec.model_validate_json(spec.model_dump_json()))
    assert lora_folding(engine.family.transformer)


@pytest.mark.slow
def test_a_compiled_folded_forward_matches_the_eager_one():
    folded = _adapted(True)
    x = torch.randn(2, 9, 48)
    with torch.no_grad():
        eager = folded(x)
        compiled = torch.compile(folded)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)


def test_flop_counts_count_the_model_work_folded_or_not(tiny_model_dir):
    from diffrl.cli.bench import transformer_gflop
    from diffrl.models.checkpoint import load_model

    counts = []
    for fold in (False, True):
        family = load_model(tiny_model_dir)
        add_lora(family.transformer, LoraSpec(rank=4, alpha=8.0, target_modules=list(family.lora_target_modules),
                                              fold_without_grad=fold))
        counts.append(transformer_gflop(family, 2, family.default_size(), 1.0))
        assert lora_folding(family.transformer) == fold  # restored after the count
    assert counts[0] == counts[1] > 0


def test_evaluate_samples_a_lora_checkpoint_as_its_run_did(tiny_model_dir, tmp_path):
    """`diffrl evaluate` and `compare` load a LoRA checkpoint folded where its run's method folds (NFT) and unfolded
    where it does not (Flow-GRPO) or where no run is beside it."""
    import shutil

    from diffrl.models.checkpoint import load_model
    from diffrl.train.trainer import train
    from test_trainer import tiny_config

    checkpoints = {}
    for loss_type, folds in (("nft", True), ("flow_grpo", False)):
        run = tmp_path / loss_type
        train(tiny_config(tiny_model_dir, run, loss_type=loss_type, use_lora=True, eval_images_per_category=0,
                          **({"global_batch_size": 6, "num_steps_per_rollout": 1} if loss_type == "nft" else {})))
        checkpoints[loss_type] = run / "checkpoints" / "rollout-00001"
        assert lora_folding(load_model(tiny_model_dir, checkpoints[loss_type]).transformer) == folds
    loose = shutil.copytree(checkpoints["nft"], tmp_path / "loose")
    assert not lora_folding(load_model(tiny_model_dir, loose).transformer)
    assert not lora_folding(load_model(tiny_model_dir).transformer)  # the base model: no adapter
