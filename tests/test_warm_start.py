"""`diffrl train --init-from CHECKPOINT`: a run that starts from saved weights (a LoRA adapter or full weights)
instead of the base model's own, with a fresh optimizer, rollout count and seeds."""

import pytest
import torch

from diffrl.errors import ModelLoadError
from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


@pytest.fixture(scope="module")
def trained(module_tiny_model_dir, tmp_path_factory):
    """One rollout and update of a LoRA run and of a full finetune: (their checkpoints, their trained weights)."""
    runs = {}
    for use_lora in (True, False):
        out = tmp_path_factory.mktemp("runs") / ("lora" if use_lora else "full")
        trainer = Trainer(tiny_config(module_tiny_model_dir, out, use_lora=use_lora, eval_interval=10))
        trainer.train()
        (checkpoint,) = sorted((out / "checkpoints").glob("rollout-*"))
        runs[use_lora] = checkpoint, {n: p.detach().clone() for n, p in
                                      zip(trainer.policy.trainable_names, trainer.policy.params, strict=True)}
    return runs


def _weights(trainer) -> dict:
    return {n: p.detach() for n, p in zip(trainer.policy.trainable_names, trainer.policy.params, strict=True)}


def test_a_lora_run_starts_from_the_saved_adapter_and_trains_on(module_tiny_model_dir, trained, tmp_path):
    checkpoint, saved = trained[True]
    fresh = _weights(Trainer(tiny_config(module_tiny_model_dir, tmp_path / "fresh", use_lora=True)))
    assert all(torch.count_nonzero(w) == 0 for n, w in fresh.items() if "lora_B" in n)  # a fresh adapter: B = 0
    for source in (checkpoint, checkpoint / "lora"):  # a run checkpoint, or the PEFT folder itself
        trainer = Trainer(tiny_config(module_tiny_model_dir, tmp_path / source.name, use_lora=True,
                                      init_from=source, loss_type="nft"))
        started = _weights(trainer)
        assert started.keys() == saved.keys()
        for name, value in saved.items():
            assert torch.equal(started[name], value), name
        # The objective's old policy (NFT's EMA) starts from the loaded adapter too, not from B = 0.
        assert all(torch.equal(s, p) for s, p in zip(trainer.policy.ema.shadow, trainer.policy.params, strict=True))
        assert trainer.rollout_index == 0 and trainer.policy.weight_version == 0  # not a resume
    record = trainer.rollout_and_update(0)
    assert record["train/grad_norm"] > 0
    assert any(not torch.equal(p, saved[n]) for n, p in _weights(trainer).items())


def test_a_full_finetune_starts_from_saved_full_weights(module_tiny_model_dir, trained, tmp_path):
    checkpoint, saved = trained[False]
    trainer = Trainer(tiny_config(module_tiny_model_dir, tmp_path / "full", init_from=checkpoint))
    started = _weights(trainer)
    for name, value in saved.items():
        assert torch.equal(started[name], value), name
    # A LoRA run on those full weights: the transformer is the saved one, with a fresh adapter on top.
    trainer = Trainer(tiny_config(module_tiny_model_dir, tmp_path / "lora-on-full", use_lora=True,
                                  init_from=checkpoint))
    base = {n.replace(".base_layer", ""): p for n, p in trainer.policy.transformer.named_parameters()
            if "lora_" not in n}
    for name, value in saved.items():
        assert torch.equal(base[name].float(), value.float()), name


def test_an_adapter_that_is_not_the_runs_is_refused_naming_the_flags(module_tiny_model_dir, trained, tmp_path):
    checkpoint, _ = trained[True]
    with pytest.raises(ModelLoadError, match=r"rank 8, alpha 16.*not this run's \(rank 4, alpha 16.*--lora-rank 8"):
        Trainer(tiny_config(module_tiny_model_dir, tmp_path / "r4", use_lora=True, lora_rank=4, init_from=checkpoint))
    with pytest.raises(ModelLoadError, match="warm-starts a LoRA run"):
        Trainer(tiny_config(module_tiny_model_dir, tmp_path / "full", init_from=checkpoint))
    with pytest.raises(ModelLoadError, match="holds no model"):
        Trainer(tiny_config(module_tiny_model_dir, tmp_path / "none", init_from=tmp_path))
