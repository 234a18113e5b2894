"""The training loop on a tiny random model: on-policy exactness, NFT, config checks, resume."""

import json
import math
import shutil

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer, validate_config


def tiny_config(model_dir, out, **overrides) -> TrainConfig:
    base = dict(model_path=model_dir, output_dir=out, num_rollout=1, rollout_batch_size=2, n_samples_per_prompt=3,
                rollout_microgroup_size=2, global_batch_size=3, num_steps_per_rollout=2, micro_batch_size=2,
                diffusion_num_steps=3, diffusion_sde_window_range=(0, 3), diffusion_num_sde_steps=2,
                diffusion_guidance_scale=2.0, lr=1e-3, eval_interval=1, checkpoint_interval=1, use_lora=False,
                reward="rewards_for_tests:darkness")
    base.update(overrides)
    return TrainConfig.flat(**base)


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("use_lora", [False, True])
def test_first_on_policy_step_has_ratio_one_and_zero_log_prob_gap(tiny_model_dir, tmp_path, use_lora):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", use_lora=use_lora)
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.policy.params]
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0
    assert record["train/pairs"] == 2 * 3 * 2  # groups × samples × trained steps
    assert record["train/grad_norm"] > 0
    assert trainer.policy.weight_version == 2  # one bump per optimizer step
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.params))  # the weights moved


def test_first_pass_ratio_is_exactly_one(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", num_steps_per_rollout=1, global_batch_size=6)
    record = Trainer(cfg).rollout_and_update(0)
    # approx_kl = ½·mean(Δlogp²) is exactly 0 only if every ratio is exactly exp(0) = 1.
    assert record["train/approx_kl"] == 0.0 and record["train/clipfrac"] == 0.0
    assert record["train/ratio_mean"] == pytest.approx(1.0, abs=1e-12)  # a weighted mean of ones


def test_nft_rollout_and_update(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", loss_type="nft")
    trainer = Trainer(cfg)
    old = [s.clone() for s in trainer.policy.ema.shadow]
    record = trainer.rollout_and_update(0)
    assert record["train/pairs"] == 6 * 2  # int(0.99 · 3 timesteps) = 2 per sample
    assert torch.isfinite(torch.tensor(record["train/loss"]))
    # δ = 0 at the first rollout: the old policy becomes the current one.
    assert all(torch.equal(s, p.detach()) for s, p in zip(trainer.policy.ema.shadow, trainer.policy.params))
    assert any(not torch.equal(a, b) for a, b in zip(old, trainer.policy.ema.shadow))


def test_nft_rollouts_can_sample_with_cfg(tiny_model_dir, tmp_path):
    """--nft-rollout-guidance-scale G: NFT's rollouts (its training data) sample with CFG G; the loss
    still trains the conditional velocity. CFG-free stays the default."""
    plain = Trainer(tiny_config(tiny_model_dir, tmp_path / "plain", loss_type="nft"))
    guided = Trainer(tiny_config(tiny_model_dir, tmp_path / "guided", loss_type="nft", nft_rollout_guidance_scale=3.0))
    a, b = plain.rollout_and_update(0), guided.rollout_and_update(0)
    assert plain.objective.request(0)["guidance_scale"] == 1.0
    assert guided.objective.request(0)["guidance_scale"] == 3.0
    assert b["rollout/reward/raw_mean"] != a["rollout/reward/raw_mean"]  # other samples
    assert torch.isfinite(torch.tensor(b["train/loss"])) and b["train/pairs"] == a["train/pairs"]
    for bad in (dict(loss_type="nft", nft_rollout_guidance_scale=0.5), dict(nft_rollout_guidance_scale=3.0)):
        with pytest.raises(ValueError, match="--nft-rollout-guidance-scale"):
            validate_config(tiny_config(tiny_model_dir, tmp_path / "bad", **bad))


@pytest.mark.parametrize("loss_type", ["nft", "flow_grpo"])
def test_kl_reference_base_is_the_starting_weights_of_a_full_finetune(tiny_model_dir, tmp_path, loss_type):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", loss_type=loss_type, diffusion_kl_beta=0.1)
    trainer = Trainer(cfg)
    start = [p.detach().clone() for p in trainer.policy.params]
    first = trainer.rollout_and_update(0)
    assert any(not torch.equal(a, p) for a, p in zip(start, trainer.policy.params))  # the weights moved
    moved = [p.detach().clone() for p in trainer.policy.params]
    with trainer.policy.reference():
        assert all(torch.equal(a, p) for a, p in zip(start, trainer.policy.params))  # the base, not the EMA
    assert all(torch.equal(a, p) for a, p in zip(moved, trainer.policy.params))  # restored on exit
    # The first of the rollout's two optimizer steps starts at the base (KL 0); the second does not.
    assert first["train/kl_loss"] > 0
    second = trainer.rollout_and_update(1)
    assert second["train/kl_loss"] > 0


def test_kl_reference_ema_needs_an_ema(tiny_model_dir, tmp_path):
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", diffusion_kl_beta=0.1, kl_reference="ema")
    with pytest.raises(ValueError, match="--use-ema"):
        validate_config(cfg)
    validate_config(tiny_config(tiny_model_dir, tmp_path / "run", diffusion_kl_beta=0.1, kl_reference="ema",
                                loss_type="nft"))  # NFT's EMA is its old policy


def test_contradictory_batch_sizes_are_refused_naming_the_flags(tiny_model_dir, tmp_path, capsys):
    code = cli_main(["train", "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / "x"),
                     "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "5"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--rollout-batch-size" in err and "--global-batch-size" in err and "--num-steps-per-rollout" in err
    assert not (tmp_path / "x").exists()  # refused before anything was written
    with pytest.raises(ValueError, match="--diffusion-sde-window-range"):
        validate_config(TrainConfig.flat(diffusion_sde_window_range=(5, 12)))
    with pytest.raises(ValueError, match="--diffusion-num-sde-steps"):
        validate_config(TrainConfig.flat(diffusion_sde_window_range=(3, 5), diffusion_num_sde_steps=3))
    assert cli_main(["train", "--recipe", "no-such-recipe"]) == 2


def test_recipe_then_flags(tmp_path):
    from diffrl.cli.main import parse

    cfg = parse(["train", "--recipe", "shapes-nft", "--lr", "0.5", "--output-dir", str(tmp_path)])
    assert cfg.recipe == "shapes-nft" and cfg.algorithm.loss_type == "nft" and cfg.optim.lr == 0.5


@pytest.mark.parametrize("sampling", [pytest.param({}, marks=pytest.mark.slow), {"category_sampling": "adaptive", "train_categories": ("colors", "counting")}],
                         ids=["uniform", "adaptive"])
def test_resume_continues_the_run_exactly(tiny_model_dir, tmp_path, sampling):
    """Adaptive category sampling depends on past rewards: its state travels in the checkpoint."""
    # One held-out image per category (not 8): the evaluation at every rollout was most of the test's time, and
    # the resumed run's eval/strict must still equal the uninterrupted run's.
    flags = {**sampling, "eval_images_per_category": 1}
    straight = tmp_path / "straight"
    Trainer(tiny_config(tiny_model_dir, straight, num_rollout=3, **flags)).train()

    # The run "killed" after rollout 2: the uninterrupted run's folder without rollout 3's checkpoint and metrics
    # line, and without the report and curve the resumed run must write again (a third run, to stop one at rollout
    # 2, cost a third of the test).
    split = tmp_path / "split"
    shutil.copytree(straight, split)
    shutil.rmtree(split / "checkpoints" / "rollout-00003")
    (split / "report.md").unlink()
    (split / "reward_curve.png").unlink()
    metrics = split / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]))  # rollouts 0, 1 and 2
    resumed = Trainer(tiny_config(tiny_model_dir, split, num_rollout=3, resume=True, **flags))
    assert resumed.rollout_index == 2 and resumed.next_group_index == 4
    assert resumed.policy.optimizer.state_dict()["state"]  # Adam moments restored
    resumed.train()

    a, b = _records(straight), _records(split)
    assert [r["rollout"] for r in b] == [0, 1, 2, 3]
    for key in ("rollout/reward/raw_mean", "train/loss", "eval/strict"):
        assert a[3][key] == b[3][key], key
    if sampling:  # per-category rewards logged; shares moved off uniform after the first rollout
        assert a[3].keys() >= {"rollout/reward/colors", "rollout/category_share/counting"} or \
            a[3].keys() >= {"rollout/reward/counting", "rollout/category_share/counting"}
        assert a[3]["rollout/category_share/counting"] == b[3]["rollout/category_share/counting"]
        assert a[1]["rollout/category_share/counting"] == 0.5
    state_a = torch.load(straight / "checkpoints" / "rollout-00003" / "train_state.pt", weights_only=True)
    state_b = torch.load(split / "checkpoints" / "rollout-00003" / "train_state.pt", weights_only=True)
    assert all(torch.equal(x, y) for x, y in zip(state_a["params"], state_b["params"]))
    assert (split / "reward_curve.png").is_file() and (split / "checkpoints" / "rollout-00003" / "model").is_dir()
    report = (split / "report.md").read_text()  # rewritten by the resumed run: the whole run's report
    assert "3 of 3 rollouts" in report and f"| 3 | {b[3]['eval/strict']:.4g} |" in report


def test_lora_checkpoint_is_peft_format(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    # No held-out evaluation: the test reads the saved adapter (evaluating 48 images twice was most of its time).
    Trainer(tiny_config(tiny_model_dir, out, use_lora=True, eval_images_per_category=0)).train()
    lora = out / "checkpoints" / "rollout-00001" / "lora"
    config = json.loads((lora / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
    from safetensors.torch import load_file

    weights = load_file(str(lora / "adapter_model.safetensors"))
    assert weights and all("lora_" in k for k in weights)
    # PEFT's own loader reads every tensor (its keys carry PEFT's `base_model.model.` prefix); without it
    # PeftModel.from_pretrained only warned and kept a fresh adapter, B = 0: the base model, silently.
    from peft import PeftModel

    from diffrl.models.demo import DemoFamily

    loaded = PeftModel.from_pretrained(DemoFamily.load(tiny_model_dir).transformer, str(lora))
    params = dict(loaded.named_parameters())
    for key, value in weights.items():
        assert torch.equal(params[key.replace(".weight", ".default.weight")], value), key
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # trained, not the zero init


def test_unknown_rewards_are_named():
    from diffrl.rewards import get_reward

    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        get_reward("nope")
    with pytest.raises(ValueError, match="cannot be imported"):
        get_reward("no_such_module:fn")
    assert get_reward("rewards_for_tests:darkness") is not None


def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, tmp_path):
    results = []
    for flag in (False, True):
        trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / f"run-{flag}", gradient_checkpointing=flag))
        assert trainer.policy.family.transformer.gradient_checkpointing is flag
        record = trainer.rollout_and_update(0)
        results.append((record["train/loss"], [p.detach().clone() for p in trainer.policy.params]))
    (loss_a, params_a), (loss_b, params_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6)
    for a, b in zip(params_a, params_b, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_bf16_forward_is_shared_by_engine_and_trainer(tiny_model_dir, tmp_path):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", mixed_precision="bf16"))
    family = trainer.policy.family
    assert family.autocast_dtype is torch.bfloat16 and trainer.engine.family is family
    x = torch.randn(2, 256, 48)
    cond = family.encode_prompts(["a red circle"]).repeat(2)
    from diffrl.models.base import Latents

    latents = Latents(x, family.prepare_latents([torch.Generator().manual_seed(0)] * 2, 64, 64).ids)
    v_bf16 = family.velocity(family.transformer, latents, torch.full((2,), 0.5), cond, None, 1.0)
    family.autocast_dtype = None
    v_fp32 = family.velocity(family.transformer, latents, torch.full((2,), 0.5), cond, None, 1.0)
    family.autocast_dtype = torch.bfloat16
    assert v_bf16.dtype == torch.float32 and not torch.equal(v_bf16, v_fp32)  # autocast really ran
    torch.testing.assert_close(v_bf16, v_fp32, rtol=0.05, atol=0.05)
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] < 0.05 and torch.isfinite(torch.tensor(record["train/loss"]))


def test_recipes_scale_with_the_device_and_flags_override_them():
    from diffrl.cli.main import parse
    from diffrl.recipes import recipe_config

    cpu, gpu = recipe_config("shapes-nft", "cpu"), recipe_config("shapes-nft", "cuda")
    assert (cpu.rollout.rollout_batch_size, cpu.rollout.diffusion_num_steps) == (6, 4)
    assert (gpu.rollout.rollout_batch_size, gpu.rollout.diffusion_num_steps) == (32, 10)
    assert recipe_config("shapes-grpo-gpu", "cpu").rollout.rollout_batch_size == 32  # -gpu forces the GPU size
    for cfg in (cpu, gpu, recipe_config("shapes-grpo", "cpu"), recipe_config("shapes-grpo", "cuda")):
        validate_config(cfg)  # every preset satisfies the batch invariant
    parsed = parse(["train", "--recipe", "shapes-nft", "--device", "cpu", "--lr", "2e-5"])
    assert parsed.rollout.rollout_batch_size == 6 and parsed.optim.lr == 2e-5 and parsed.recipe == "shapes-nft"
    with pytest.raises(ValueError, match="shapes-nft-gpu"):
        recipe_config("shapes-sft")


def test_cosine_learning_rate_schedule(tiny_model_dir, tmp_path):
    from diffrl.train.trainer import learning_rate

    cfg = TrainConfig.flat(lr=1e-3, lr_schedule="cosine", lr_min_ratio=0.1, num_rollout=11)
    rates = [learning_rate(cfg, k) for k in range(11)]
    assert rates[0] == pytest.approx(1e-3) and rates[5] == pytest.approx(0.55e-3) and rates[-1] == pytest.approx(1e-4)
    assert all(a > b for a, b in zip(rates, rates[1:]))
    assert learning_rate(TrainConfig.flat(lr=1e-3), 7) == 1e-3  # constant by default
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", lr_schedule="cosine", num_rollout=3))
    trainer.rollout_index = 2
    record = trainer.rollout_and_update(2)
    assert record["train/lr"] == pytest.approx(1e-4) and trainer.policy.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)


# Covered in the default run by test_rewards.py::test_worker_pool_scores_like_the_inline_reward (worker processes
# score as the inline reward) and test_determinism.py (a training run scored by 2 reward worker processes).
@pytest.mark.slow
def test_reward_worker_processes_give_the_inline_run(tiny_model_dir, tmp_path):
    # No held-out evaluation: the rollout's rewards and the loss are compared, not the evaluation's.
    inline = Trainer(tiny_config(tiny_model_dir, tmp_path / "inline", loss_type="nft", diffusion_guidance_scale=1.0,
                                 eval_images_per_category=0))
    pooled = Trainer(tiny_config(tiny_model_dir, tmp_path / "pooled", loss_type="nft", diffusion_guidance_scale=1.0,
                                 reward_workers=2, eval_images_per_category=0))
    a, b = inline.train(), pooled.train()
    # Rewards match exactly; the loss to float rounding, since CPU matmul reductions can split differently when
    # the reward workers' processes compete for the cores.
    assert b["rollout/reward/raw_mean"] == a["rollout/reward/raw_mean"]
    assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("eval_num_steps, expected", [(None, 3), (5, 5)])
def test_held_out_evaluation_steps(tiny_model_dir, tmp_path, monkeypatch, eval_num_steps, expected):
    """The held-out evaluation samples with --eval-num-steps, else with the rollout's steps."""
    import diffrl.tasks.shapes as trainer_module

    seen = []
    real = trainer_module.evaluate_prompts

    def spy(*args, num_steps, **kwargs):
        seen.append(num_steps)
        return real(*args, num_steps=num_steps, **kwargs)

    monkeypatch.setattr(trainer_module, "evaluate_prompts", spy)
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", eval_num_steps=eval_num_steps, eval_images_per_category=1)
    assert "eval/strict" in Trainer(cfg).evaluate(0)
    assert seen == [expected]
    cfg = tiny_config(tiny_model_dir, tmp_path / "run2", eval_num_steps=eval_num_steps, eval_images_per_category=1,
                      val_images_per_category=1)
    record = Trainer(cfg).evaluate(0)
    assert seen == [expected] * 3 and {"eval/strict", "val/strict", "val/strict/counting"} <= set(record)
    with pytest.raises(ValueError, match="--eval-num-steps"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "run", eval_num_steps=0))


def test_best_checkpoint_is_chosen_by_validation_not_by_the_test_split(tiny_model_dir, tmp_path, monkeypatch):
    """checkpoints/best holds the weights of the evaluation with the highest validation accuracy; the
    held-out (test) accuracy plays no part in the choice."""
    from safetensors.torch import load_file

    scripted = {0: (0.2, 0.9), 1: (0.6, 0.1), 2: (0.4, 0.8), 3: (0.5, 0.9), 4: (0.6, 0.7)}  # rollout: (validation, test)

    def fake_evaluate(self, k):
        val, test = scripted[k]
        return {"val/strict": val, "eval/strict": test}

    monkeypatch.setattr(Trainer, "evaluate", fake_evaluate)
    out = tmp_path / "run"
    Trainer(tiny_config(tiny_model_dir, out, loss_type="nft", num_rollout=3, val_images_per_category=1)).train()
    best = json.loads((out / "checkpoints" / "best" / "best.json").read_text())
    assert best["rollout"] == 1 and best["val/strict"] == 0.6

    def weights(checkpoint):
        return load_file(str(next((checkpoint / "model" / "transformer").glob("*.safetensors"))))

    chosen, at_1, at_2 = (weights(out / "checkpoints" / name) for name in ("best", "rollout-00001", "rollout-00002"))
    assert all(torch.equal(chosen[k], at_1[k]) for k in at_1)
    assert any(not torch.equal(chosen[k], at_2[k]) for k in at_2)

    # A resumed run remembers the best so far: an equal later score does not replace it.
    Trainer(tiny_config(tiny_model_dir, out, loss_type="nft", num_rollout=4, val_images_per_category=1,
                        resume=True)).train()
    assert json.loads((out / "checkpoints" / "best" / "best.json").read_text())["rollout"] == 1


def test_nft_use_ema_evaluates_and_saves_a_second_ema_and_resumes_both(tiny_model_dir, tmp_path):
    """NFT's --use-ema keeps an evaluation EMA beside the old policy: updated per optimizer step with
    --ema-decay, it is what the saved model holds, and a resume restores both EMAs."""
    from safetensors.torch import load_file

    out = tmp_path / "run"
    # One held-out image per category: the evaluation runs on the EMA as with 8, at an eighth of the sampling.
    overrides = dict(loss_type="nft", use_ema=True, ema_decay=0.5, num_steps_per_rollout=1, global_batch_size=6,
                     micro_batch_size=6, eval_interval=100, eval_images_per_category=1)
    trainer = Trainer(tiny_config(tiny_model_dir, out, **overrides))
    assert trainer.policy.eval_ema is not trainer.policy.ema
    start = [p.detach().clone() for p in trainer.policy.params]
    trainer.train()  # one rollout, one optimizer step, a checkpoint
    expected = [0.5 * s + 0.5 * p.detach() for s, p in zip(start, trainer.policy.params)]
    assert all(torch.allclose(e, s) for e, s in zip(expected, trainer.policy.eval_ema.shadow))
    assert all(torch.equal(s, p.detach()) for s, p in zip(trainer.policy.ema.shadow, trainer.policy.params))  # old policy: δ = 0

    ckpt = out / "checkpoints" / "rollout-00001"
    saved = {}
    for f in (ckpt / "model").rglob("*.safetensors"):
        saved.update(load_file(str(f)))
    for name, shadow, param in zip(trainer.policy.trainable_names, trainer.policy.eval_ema.shadow, trainer.policy.params):
        assert torch.equal(saved[name], shadow), name  # the saved model is the evaluated EMA,
    live = zip(trainer.policy.trainable_names, trainer.policy.params)
    assert any(not torch.equal(saved[n], p.detach()) for n, p in live)  # not the live weights

    resumed = Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, **overrides))
    assert all(torch.equal(a, b) for a, b in zip(resumed.policy.eval_ema.shadow, trainer.policy.eval_ema.shadow))
    assert all(torch.equal(a, b) for a, b in zip(resumed.policy.ema.shadow, trainer.policy.ema.shadow))


def test_a_checkpoint_from_before_named_emas_resumes_its_ema(tiny_model_dir, tmp_path):
    """train_state.pt files written before this format held one EMA under "ema" (NFT's old policy)."""
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_model_dir, out, loss_type="nft", eval_images_per_category=0))  # EMAs, not eval
    trainer.train()
    path = out / "checkpoints" / "rollout-00001" / "train_state.pt"
    state = torch.load(path, weights_only=True)
    state["ema"] = state.pop("emas")["ema"]  # the old layout
    torch.save(state, path)
    (path.parent / "manifest.json").unlink()  # checkpoints of that time had no manifest
    resumed = Trainer(tiny_config(tiny_model_dir, out, loss_type="nft", num_rollout=2, resume=True,
                                  eval_images_per_category=0))
    assert all(torch.equal(a, b) for a, b in zip(resumed.policy.ema.shadow, trainer.policy.ema.shadow))
    fresh = Trainer(tiny_config(tiny_model_dir, tmp_path / "fresh", loss_type="nft"))
    assert any(not torch.equal(a, b) for a, b in zip(resumed.policy.ema.shadow, fresh.policy.ema.shadow))  # not merely the start


def test_held_out_evaluation_can_be_turned_off(tiny_model_dir, tmp_path, capsys):
    """--eval-images-per-category 0: no test-prompt sampling (a model trained on another reward), the
    run still trains and checkpoints; a negative count is refused naming the flag."""
    out = tmp_path / "run"
    Trainer(tiny_config(tiny_model_dir, out, eval_images_per_category=0)).train()
    records = _records(out)
    assert not any(key.startswith("eval/") for r in records for key in r)
    assert any("train/loss" in r for r in records) and not (out / "eval").exists()
    assert (out / "checkpoints" / "rollout-00001").is_dir()
    with pytest.raises(ValueError, match="--eval-images-per-category must be >= 0"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "bad", eval_images_per_category=-1))


@pytest.mark.parametrize("use_lora", [True, False])
def test_bf16_forward_keeps_frozen_weights_in_bf16_and_trained_ones_in_fp32(tiny_model_dir, tmp_path, use_lora):
    """Real-size memory: with bf16 forwards the LoRA base, text encoder and the KL reference are bf16;
    what the optimizer updates (the adapter, or the whole transformer) stays fp32."""
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", use_lora=use_lora, mixed_precision="bf16",
                                  diffusion_kl_beta=0.1))
    policy = trainer.policy
    assert {p.dtype for p in policy.params} == {torch.float32}
    frozen = [p for n, p in policy.transformer.named_parameters() if "lora_" not in n]
    bf16_share = sum(p.numel() for p in frozen if p.dtype == torch.bfloat16) / sum(p.numel() for p in frozen)
    # A LoRA's base in bf16 (a family may keep a few small norms in fp32); a full finetune's weights fp32.
    assert bf16_share > 0.95 if use_lora else bf16_share == 0
    assert {p.dtype for p in policy.family.text_encoder.parameters()} == {torch.bfloat16}
    if not use_lora:
        assert {s.dtype for s in policy.base_weights.shadow} == {torch.bfloat16}
    record = trainer.rollout_and_update(0)
    assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0


def test_sft_trains_on_the_samples_that_beat_their_prompts_mean(tiny_model_dir, tmp_path):
    """--loss-type sft: the reward is each sample's seed, so in a group of 3 (seeds s, s+1, s+2) exactly
    one sample beats the mean; each becomes int(3 · 0.99) = 2 flow-matching pairs."""
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", loss_type="sft", reward="rewards_for_tests:seed_of"))
    before = [p.detach().clone() for p in trainer.policy.params]
    record = trainer.rollout_and_update(0)
    assert record["train/pairs"] == 2 * 1 * 2  # groups × samples above the mean × timesteps
    assert math.isfinite(record["train/loss"]) and record["train/loss"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.params))


def test_offloaded_text_encoder_visits_the_device_only_to_encode(tiny_model_dir, tmp_path, monkeypatch):
    """--offload-text-encoder: the frozen encoder's weights stay in host memory, a copy of them visits the device for
    each encode block, and leaving drops that copy without copying anything back (the host copy is still theirs).
    On a CPU the visit copies to the CPU; what is checked is which copy the weights are at each moment."""
    from diffrl.utils.offload import FrozenOffload

    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", offload_text_encoder=True, loss_type="nft"))
    family = trainer.policy.family
    (encoder,) = family.text_encoder_modules()
    host = {name: p.data for name, p in encoder.named_parameters()}  # the host copies (their storage, by pointer)
    before = {name: t.clone() for name, t in host.items()}
    visits, encoded_on_visiting_copies = [], []
    monkeypatch.setattr(FrozenOffload, "to_device", staticmethod(lambda h, device: (visits.append(str(device)),
                                                                                     h.clone())[1]))
    real_encode = family.encode_prompts

    def encode(prompts):
        encoded_on_visiting_copies.append(all(p.data_ptr() != host[n].data_ptr()
                                              for n, p in encoder.named_parameters()))
        return real_encode(prompts)

    monkeypatch.setattr(family, "encode_prompts", encode)
    trainer.rollout_and_update(0)
    assert encoded_on_visiting_copies and all(encoded_on_visiting_copies)  # every encode ran on a visit's copies
    assert visits and set(visits) == {str(family.device)}
    assert all(p.data_ptr() == host[n].data_ptr() for n, p in encoder.named_parameters())  # back on the host copies
    assert all(torch.equal(host[n], before[n]) for n in host)  # which nothing overwrote


def test_size_flags_square_or_height_and_width(tiny_model_dir, tmp_path, capsys):
    """--resolution is the square shorthand of --height/--width: both kinds, or one side alone, are refused in
    one line naming the flags; a size the family cannot make is refused naming the flags that gave it."""
    assert TrainConfig.flat(height=16, width=24).model.size() == (16, 24)
    assert TrainConfig.flat(resolution=16).model.size() == (16, 16) and TrainConfig.flat().model.size() is None
    flags = ["train", "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / "x")]
    for extra, named in ((["--resolution", "16", "--height", "16", "--width", "24"], ("--resolution 16", "--height")),
                         (["--height", "16"], ("--height and --width go together",))):
        assert cli_main([*flags, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and all(name in err for name in named), err
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="--height and --width must be > 0"):
        validate_config(TrainConfig.flat(height=0, width=16))
    with pytest.raises(ValueError, match=r"^--height 16 --width 24: "):  # the demo model makes one square size
        Trainer(tiny_config(tiny_model_dir, tmp_path / "run", height=16, width=24))


def test_random_sde_steps_are_distinct_seeded_and_trained_exactly(tiny_model_dir, tmp_path, monkeypatch):
    """--diffusion-sde-step-strategy random: each rollout's SDE steps are distinct, drawn anywhere in the
    window (not necessarily adjacent), sorted and fixed by the run seed and rollout index; the train pairs are
    exactly those steps' transitions, and the first pass reproduces the engine's log-probs."""
    cfg = tiny_config(tiny_model_dir, tmp_path / "run", diffusion_num_steps=6, diffusion_sde_window_range=(1, 6),
                      diffusion_num_sde_steps=2, diffusion_sde_step_strategy="random")
    trainer = Trainer(cfg)
    draws = [trainer.objective.sde_window(k) for k in range(40)]
    assert all(len(set(d)) == 2 and d == sorted(d) and 1 <= d[0] and d[-1] < 6 for d in draws)
    assert any(b - a > 1 for a, b in draws) and len({tuple(d) for d in draws}) > 5
    assert draws == [trainer.objective.sde_window(k) for k in range(40)]  # seeded, not stateful
    window = Trainer(tiny_config(tiny_model_dir, tmp_path / "window", diffusion_num_steps=6,
                                 diffusion_sde_window_range=(1, 6), diffusion_num_sde_steps=2))
    assert all(b == a + 1 for a, b in (window.objective.sde_window(k) for k in range(40)))  # the default: adjacent

    k = next(k for k, (a, b) in enumerate(draws) if b - a > 1)
    seen = {}
    real_pairs = trainer.objective.pairs

    def pairs(samples, advantages, env):
        seen["sigmas"] = samples[0].output.dit_trajectory.sigmas
        seen["pairs"] = real_pairs(samples, advantages, env)
        return seen["pairs"]

    monkeypatch.setattr(trainer.objective, "pairs", pairs)
    trainer.rollout_index = k
    record = trainer.rollout_and_update(k)
    sigmas, trained = seen["sigmas"], seen["pairs"]
    assert {float(s) for s in trained.sigma} == {float(sigmas[i]) for i in draws[k]}
    assert {float(s) for s in trained.sigma_next} == {float(sigmas[i + 1]) for i in draws[k]}
    assert record["train/pairs"] == 2 * 3 * 2 and record["train/log_prob_mean_abs_diff"] == 0.0


def test_a_run_without_learning_signal_says_so(tiny_model_dir, tmp_path, capsys):
    """Every group's rewards equal (as an OCR reward that reads nothing gives): every advantage is 0, nothing trains,
    and the run says why, once per ten rollouts."""
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", reward="rewards_for_tests:constant"))
    for k in range(3):
        trainer.rollout_and_update(k)
    out = capsys.readouterr().out
    assert out.count("warning: rollout 0: every prompt group's samples got the same reward (0), so every advantage "
                     "is 0 and nothing trains") == 1
    assert "warning: rollout 1" not in out and "--reward rewards_for_tests:constant" in out
    quiet = Trainer(tiny_config(tiny_model_dir, tmp_path / "graded"))
    quiet.rollout_and_update(0)
    assert "nothing trains" not in capsys.readouterr().out


def test_keep_last_checkpoints_removes_the_older_ones(tiny_model_dir, tmp_path):
    """--keep-last-checkpoints 2: after each save only the two newest rollout checkpoints stay, and the run resumes
    from the newest; 0 is refused (a run must keep one to resume from)."""
    out = tmp_path / "run"
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=3, eval_images_per_category=0,
                        keep_last_checkpoints=2)).train()
    assert sorted(p.name for p in (out / "checkpoints").glob("rollout-*")) == ["rollout-00002", "rollout-00003"]
    resumed = Trainer(tiny_config(tiny_model_dir, out, num_rollout=4, eval_images_per_category=0, resume=True,
                                  keep_last_checkpoints=2))
    assert resumed.rollout_index == 3
    with pytest.raises(ValueError, match="--keep-last-checkpoints must be >= 1"):
        validate_config(tiny_config(tiny_model_dir, tmp_path / "x", keep_last_checkpoints=0))


def test_overlapping_encode_blocks_share_one_visit_of_the_offloaded_encoder(tiny_family, monkeypatch):
    """Two engines sharing a family may encode at once: the encoder visits once and leaves when the last block ends."""
    from diffrl.utils.offload import FrozenOffload

    visits = []
    monkeypatch.setattr(FrozenOffload, "to_device", staticmethod(lambda h, device: (visits.append(1), h.clone())[1]))
    tiny_family.offload_text_encoders_to_cpu()
    offload = tiny_family._text_encoder_offload
    with tiny_family.text_encoders_on_device():
        with tiny_family.text_encoders_on_device():
            assert offload.visiting is not None
        assert offload.visiting is not None  # the outer block still uses it
    assert offload.visiting is None and len(visits) == len(offload._tensors)  # one copy of each tensor, once


def test_an_engine_batch_whose_prompts_are_cached_leaves_the_offloaded_encoder_where_it_is(tiny_family, monkeypatch):
    """The engine brings an offloaded text encoder to the device only when a prompt of the batch is not cached."""
    from diffrl.engine.engine import Engine
    from diffrl.engine.protocol import RolloutRequest
    from diffrl.utils.offload import FrozenOffload

    visits = []
    monkeypatch.setattr(FrozenOffload, "to_device", staticmethod(lambda h, device: (visits.append(1), h.clone())[1]))
    tiny_family.offload_text_encoders_to_cpu()
    engine, per_visit = Engine(tiny_family), len(tiny_family._text_encoder_offload._tensors)
    request = RolloutRequest(prompt="a red circle", seed=1, num_inference_steps=1, guidance_scale=1.0)
    engine.generate(request)
    assert len(visits) == per_visit and engine.prompt_encodes == 1
    engine.generate(request.model_copy(update={"seed": 2}))  # the same prompt, the same weights: cached
    assert len(visits) == per_visit and engine.prompt_encodes == 1
    engine.generate(request.model_copy(update={"prompt": "a blue square"}))
    assert len(visits) == 2 * per_visit and engine.prompt_encodes == 2


def test_the_flop_counters_encode_on_the_visiting_copies_of_an_offloaded_encoder(tiny_model_dir, tmp_path, monkeypatch):
    """`diffrl bench-train`'s and recipe_runs.py's FLOP counts encode a prompt themselves: with the recipe's
    --offload-text-encoder the encoder must visit the device for it (on the host copy a GPU run's text embeddings came
    out on the CPU and the transformer refused them)."""
    from benchmark_scripts import load_benchmark

    from diffrl.cli.bench import transformer_gflop
    from diffrl.utils.offload import FrozenOffload

    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", offload_text_encoder=True))
    family = trainer.policy.family
    (encoder,) = family.text_encoder_modules()
    host = {name: p.data.data_ptr() for name, p in encoder.named_parameters()}
    monkeypatch.setattr(FrozenOffload, "to_device", staticmethod(lambda h, device: h.clone()))
    on_visit, real_encode = [], family.encode_prompts

    def encode(prompts):
        on_visit.append(all(p.data_ptr() != host[n] for n, p in encoder.named_parameters()))
        return real_encode(prompts)

    monkeypatch.setattr(family, "encode_prompts", encode)
    assert transformer_gflop(family, 1, (64, 64), 2.0) > 0
    assert load_benchmark("recipe_runs", monkeypatch).forward_flops(trainer, "a red circle") > 0
    assert len(on_visit) == 3 and all(on_visit)  # cond and uncond, then the recipe's one prompt
    assert all(p.data_ptr() == host[n] for n, p in encoder.named_parameters())  # gone again after
