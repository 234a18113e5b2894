"""DGPO's options from its reference code (as Flow-Factory's DGPO trainer carries them): an old policy that is a
fast EMA of the weights stepped per optimizer step, a PPO-style clip of each sample's flow-matching error (and of the
KL term) against it, the old policy as the preference's reference, rollouts under it after N optimizer steps, and a
v-based KL term (which DPO and SFT now add too, instead of ignoring the flag)."""

import math

import pytest
import torch

from diffrl.algorithms import losses as L
from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from diffrl.train.trainer import Trainer

SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4",
         "--global-batch-size", "4", "--num-steps-per-rollout", "2", "--micro-batch-size", "8",
         "--diffusion-num-steps", "4", "--eval-images-per-category", "0", "--val-images-per-category", "0",
         "--reward", "rewards_for_tests:darkness", "--category-sampling", "uniform", "--device", "cpu",
         "--lr", "1e-3"]


def test_the_clip_mask_follows_the_advantages_direction():
    err = torch.tensor([1.0, 1.0, 1.0, 1.0])
    old = torch.tensor([1.2, 1.01, 0.8, 0.99])  # ratio exp(old − err): 1.22, 1.01, 0.82, 0.99
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    mask = L.dgpo_clip_mask(err, old, adv, clip_range=0.05, adv_clip_max=5.0)
    # A > 0 clips once the error fell far enough below the old policy's; A < 0 once it rose far enough above it.
    assert mask.tolist() == [True, False, True, False]


def test_clipped_samples_count_in_the_preference_but_pass_no_gradient():
    """Against Flow-Factory's DGPO step: weight = σ(Σ_j A_j·β·(ℓ_j − ℓ_ref,j)/n) per group (detached), loss =
    mean(weight·A·ℓ) with the clipped samples' ℓ detached. diffrl's −log σ form has β times that gradient."""
    g = torch.Generator().manual_seed(5)
    G, n, beta, c = 3, 4, 10.0, 5.0
    err = torch.rand(G, n, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.rand(G, n, generator=g, dtype=torch.float64)
    adv = torch.randn(G, n, generator=g, dtype=torch.float64)
    frozen = torch.rand(G, n, generator=g) < 0.4
    assert frozen.any() and not frozen.all()
    plain = L.dgpo_loss(err, ref, adv, beta=beta, adv_clip_max=c)
    out = L.dgpo_loss(err, ref, adv, beta=beta, adv_clip_max=c, frozen=frozen)
    assert torch.equal(out.loss, plain.loss)  # the groups' sums still hold every sample
    out.loss.backward()
    ff_err = err.detach().clone().requires_grad_(True)
    weight = torch.sigmoid((adv * beta * (ff_err.detach() - ref)).sum(1, keepdim=True) / n)
    used = torch.where(frozen, ff_err.detach(), ff_err)
    (weight * adv * used).mean().backward()
    assert torch.equal(err.grad[frozen], torch.zeros_like(err.grad[frozen]))
    torch.testing.assert_close(err.grad, beta * ff_err.grad, rtol=1e-12, atol=0)


def dgpo_trainer(model, out, *flags):
    return Trainer(parse(["train", "--loss-type", "dgpo", *SMALL, *flags, "--model-path", str(model),
                          "--output-dir", str(out)]))


def test_the_old_policy_is_a_fast_ema_stepped_per_optimizer_step(tiny_model_dir, tmp_path):
    trainer = dgpo_trainer(tiny_model_dir, tmp_path / "run", "--dgpo-clip-dsm", "--diffusion-clip-range", "0.05",
                           "--dgpo-ema-ref-ramp-rate", "0.2", "--dgpo-ema-ref-max-decay", "0.3")
    old = trainer.objective.old
    assert old is not None and trainer.policy.extra_emas["dgpo_old"] is old
    shadow = [s.clone() for s in old.shadow]
    record = trainer.rollout_and_update(0)
    assert math.isfinite(record["train/loss"]) and 0 <= record["train/clipfrac"] <= 1
    assert trainer.policy.weight_version == 2
    # Two steps: decays min(0.3, 0.2·1) = 0.2, then min(0.3, 0.2·2) = 0.3, each a lerp toward the weights then.
    # The last step's lerp is checked exactly: shadow₂ = 0.3·shadow₁ + 0.7·θ₂.
    assert any(not torch.equal(a, b) for a, b in zip(shadow, old.shadow))
    live = [p.detach() for p in trainer.policy.params]
    again = [s.clone() for s in old.shadow]
    trainer.objective.after_optimizer_step(3)  # decay min(0.3, 0.6) = 0.3
    for before, after, p in zip(again, old.shadow, live):
        torch.testing.assert_close(after, 0.3 * before + 0.7 * p)


def test_rollouts_sample_under_the_old_policy_after_the_switch(tiny_model_dir, tmp_path):
    trainer = dgpo_trainer(tiny_model_dir, tmp_path / "run", "--dgpo-use-ema-ref", "--dgpo-switch-ema-ref", "1")
    assert trainer.objective.rollout_ema is None  # 0 optimizer steps taken
    trainer.rollout_and_update(0)  # two steps
    assert trainer.objective.rollout_ema is trainer.objective.old
    record = trainer.rollout_and_update(1)  # sampled under it, trained against it
    assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0


def test_the_kl_term_is_added_and_can_be_clipped(tiny_model_dir, tmp_path):
    base = dgpo_trainer(tiny_model_dir, tmp_path / "a", "--diffusion-kl-beta", "0.5", "--dgpo-clip-kl",
                        "--diffusion-clip-range", "0.05")
    base.rollout_and_update(0)
    record = base.rollout_and_update(1)
    assert record["train/kl_loss"] > 0 and "train/clipfrac" in record
    without = dgpo_trainer(tiny_model_dir, tmp_path / "b")
    without.rollout_and_update(0)
    assert without.rollout_and_update(1)["train/kl_loss"] == 0 and without.objective.old is None


@pytest.mark.parametrize("loss_type", ["dpo", "sft"])
def test_dpo_and_sft_add_the_kl_term_they_used_to_ignore(loss_type, tiny_model_dir, tmp_path):
    trainer = Trainer(parse(["train", "--loss-type", loss_type, *SMALL, "--diffusion-kl-beta", "0.5",
                             "--model-path", str(tiny_model_dir), "--output-dir", str(tmp_path / "run")]))
    trainer.rollout_and_update(0)
    record = trainer.rollout_and_update(1)
    assert record["train/kl_loss"] > 0


def test_a_switch_without_an_old_policy_is_refused(tiny_model_dir, tmp_path, capsys):
    assert cli_main(["train", "--loss-type", "dgpo", *SMALL, "--dgpo-switch-ema-ref", "200", "--model-path",
                     str(tiny_model_dir), "--output-dir", str(tmp_path / "r")]) == 2
    assert "--dgpo-switch-ema-ref samples under DGPO's old policy" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
