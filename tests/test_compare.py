"""Checkpoints applied to a base model, and the base-vs-trained comparison."""

import json

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.errors import ModelLoadError
from diffrl.evaluation.compare import outcome
from diffrl.models.checkpoint import load_model
from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


def _transformer_equal(a, b) -> bool:
    sa, sb = a.transformer.state_dict(), b.transformer.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("use_lora", [False, True])
def test_a_run_checkpoint_loads_as_the_trained_model(tiny_model_dir, tmp_path, use_lora):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=use_lora))
    trainer.rollout_and_update(0)
    trainer.rollout_index = 1
    path = trainer.save_checkpoint()
    loaded = load_model(tiny_model_dir, path)
    base = load_model(tiny_model_dir)
    assert not _transformer_equal(loaded, base)
    # The loaded model samples exactly what the trainer's model samples.
    from diffrl.evaluation.shapes import generate

    kwargs = dict(num_steps=2, guidance_scale=1.0)
    torch.testing.assert_close(generate(loaded, ["a red circle"], [3], **kwargs),
                               generate(trainer.policy.family, ["a red circle"], [3], **kwargs), rtol=0, atol=1e-6)


def test_transformer_only_checkpoint_and_bad_paths(tiny_model_dir, tiny_family, tmp_path):
    with torch.no_grad():
        for p in tiny_family.transformer.parameters():
            p.add_(0.01)
    tiny_family.transformer.save_pretrained(tmp_path / "ckpt" / "transformer", safe_serialization=True)
    loaded = load_model(tiny_model_dir, tmp_path / "ckpt")
    assert _transformer_equal(loaded, tiny_family)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="holds no model"):
        load_model(tiny_model_dir, tmp_path / "empty")
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tiny_model_dir, tmp_path / "missing")


def test_a_lora_for_another_model_is_refused_naming_the_base_flag(tiny_model_dir, tmp_path):
    """A LoRA whose targets the base lacks (a video run's checkpoint evaluated on the default base, the demo
    model) is a one-line error naming the flag to pass, not PEFT's "Target modules … not found"."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    lora = tmp_path / "ckpt" / "lora"
    LoraConfig(r=2, lora_alpha=2, target_modules=["attn1.to_q", "ffn.net.2"]).save_pretrained(str(lora))
    save_file({"base_model.model.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 4)},
              str(lora / "adapter_model.safetensors"))
    with pytest.raises(ModelLoadError, match="not modules of the demo model .*--model-path"):
        load_model(tiny_model_dir, tmp_path / "ckpt")


def test_a_full_finetune_of_another_base_is_refused_naming_the_base_flag(tiny_model_dir, tmp_path):
    """A transformer-only checkpoint (a full finetune's model/) applied to a base it was not trained from (the
    default base, the demo model, under another family's run) names the base, the run's own --model-path and the
    flag to pass, as a LoRA of another base does; it said only "weights do not fit the config … (Error(s) in
    loading state_dict for …:)"."""
    from diffrl.models.random_checkpoints import demo as random_demo

    config = random_demo.tiny()
    config.transformer.update(num_layers=2)
    other = random_demo.random_family(config, seed=1)
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "rollout-00002"
    other.transformer.save_pretrained(checkpoint / "model" / "transformer", safe_serialization=True)
    (run / "config.json").write_text(json.dumps({"flags": {"model_path": "/m/the-base"}}))
    with pytest.raises(ModelLoadError, match=r"model/transformer was not trained from the demo model at .*tiny-demo.*"
                                             r"its run trained /m/the-base.*--model-path, or --base"):
        load_model(tiny_model_dir, checkpoint)


def _lora_run_and_a_base_of_other_sizes(model_dir, tmp_path, other: str):
    """A LoRA checkpoint (…/rollout-00001) trained on `model_dir`'s demo model, and a demo model one layer deeper or
    with wider heads (`other`) to apply it to."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from diffrl.models.demo import DemoFamily
    from diffrl.models.lora import LoraSpec, add_lora
    from diffrl.models.random_checkpoints import demo as random_demo

    family = DemoFamily.load(model_dir)
    add_lora(family.transformer, LoraSpec(rank=2, alpha=2, target_modules=list(DemoFamily.lora_target_modules)))
    lora = tmp_path / "run" / "checkpoints" / "rollout-00001" / "lora"
    lora.mkdir(parents=True)
    save_file({f"base_model.model.{k}": v.contiguous() for k, v in get_peft_model_state_dict(family.transformer).items()},
              str(lora / "adapter_model.safetensors"))
    family.transformer.peft_config["default"].save_pretrained(str(lora))
    config = random_demo.tiny()
    config.transformer.update(num_layers=2) if other == "deeper" else config.transformer.update(attention_head_dim=16)
    base = tmp_path / "other-demo"
    random_demo.random_family(config, seed=1).save(base)
    return lora.parent, base


@pytest.mark.parametrize("other", ["deeper", "wider"])
def test_a_lora_of_another_size_is_refused_naming_the_base_flag(tiny_model_dir, tmp_path, other):
    """A run's LoRA on a base of its family but of other sizes: a deeper base kept no adapter weights for its extra
    layers (B = 0, silently a partial adapter), a wider one was a torch 'size mismatch' traceback."""
    checkpoint, base = _lora_run_and_a_base_of_other_sizes(tiny_model_dir, tmp_path, other)
    with pytest.raises(ModelLoadError, match=r"lora: its LoRA \(.*\) does not fit the demo model at .*other-demo; "
                                             r"pass the base model the run trained"):
        load_model(base, checkpoint)


def test_outcome_rules():
    assert outcome(0, 1, 0.9, 0.5) == "win"  # a strict pass beats any partial credit
    assert outcome(1, 0, 0.5, 0.9) == "loss"
    assert outcome(1, 1, 0.7, 0.7) == "tie"
    assert outcome(0, 0, 0.5, 0.75) == "win"
    assert outcome(0, 0, 0.75, 0.5) == "loss"


def test_compare_command_writes_report_and_grid(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    # The base against itself: every prompt ties, and the report says so.
    code = cli_main(["compare", "--trained", str(tiny_model_dir), "--base", str(tiny_model_dir), "--num-prompts", "4",
                     "--num-steps", "2", "--device", "cpu", "--output-dir", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["win_tie_loss"] == {"win": 0, "tie": 4, "loss": 0}
    assert len(report["prompts"]) == 4 and (out / "side_by_side.png").is_file()
    assert "4 ties" in capsys.readouterr().out
    assert cli_main(["compare", "--trained", str(tmp_path / "nope"), "--device", "cpu"]) == 2


def test_a_wrong_trained_path_fails_before_the_base_model_samples(tiny_model_dir, tmp_path, capsys):
    """The trained model loads after the base model's columns are sampled (minutes on a real model): a missing
    path, or a run folder given for one of its checkpoints, fails first, in one line."""
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    run = tmp_path / "run"
    (run / "checkpoints" / "rollout-00001").mkdir(parents=True)
    for trained, message in ((tmp_path / "nope", "checkpoint directory not found"),
                             (run, "holds no model (a run folder: pass one of its checkpoints/rollout-N)")):
        out = tmp_path / "cmp"
        code = cli_main(["compare", "--base", str(tiny_model_dir), "--trained", str(trained), "--prompt-data",
                         str(tmp_path / "prompts.txt"), "--reward", "jpeg_compressibility", "--guidance-scale", "2",
                         "--num-steps", "1", "--device", "cpu", "--output-dir", str(out)])
        assert code == 2 and message in capsys.readouterr().err
        assert not out.exists()  # nothing sampled


@pytest.mark.parametrize("other", ["deeper", "wider"])
def test_check_fits_finds_another_base_without_reading_weights(tiny_model_dir, tmp_path, other):
    """What load_model refuses, check_fits refuses from the adapter's names and shapes alone: diffrl compare calls it
    before sampling the base, which it did in full before finding out."""
    from diffrl.models.checkpoint import check_fits
    from diffrl.models.demo import DemoFamily

    checkpoint, base = _lora_run_and_a_base_of_other_sizes(tiny_model_dir, tmp_path, other)
    check_fits(DemoFamily.load(tiny_model_dir), tiny_model_dir, checkpoint)  # its own base: fits
    with pytest.raises(ModelLoadError, match=r"lora: its LoRA \((no weights for|other sizes).*\) does not fit the demo "
                                             r"model at .*other-demo; pass the base model the run trained"):
        check_fits(DemoFamily.load(base), base, checkpoint)


def test_compare_refuses_another_familys_run_before_sampling_the_base(tiny_model_dir, tmp_path, capsys):
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "rollout-00001"
    (checkpoint / "lora").mkdir(parents=True)
    (checkpoint / "lora" / "adapter_config.json").write_text("{}")
    (run / "config.json").write_text(json.dumps({"flags": {"model_path": "/m/sd3", "diffusion_model_family": "sd3"}}))
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    out = tmp_path / "compare"
    assert cli_main(["compare", "--base", str(tiny_model_dir), "--trained", str(checkpoint), "--prompt-data",
                     str(tmp_path / "prompts.txt"), "--reward", "rewards_for_tests:darkness", "--num-steps", "2",
                     "--device", "cpu", "--output-dir", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: {checkpoint} (from a run of the sd3 family) does not fit the demo model at")
    assert "its run trained /m/sd3" in err and not (out / "base_cfg").exists()
