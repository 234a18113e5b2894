"""Every RL method of the algorithm bench, with the bench's own flags (scripts/device/sweeps/algorithms.txt), trains
two rollouts on the demo family at a small batch: the loss is finite, the weights move, and the rollout is the
kind the method declares (algorithms/methods.py). The real-size families take the same flags (test_family_methods)."""

import math
import shlex
from pathlib import Path

import pytest
import torch

from diffrl.algorithms.methods import METHODS
from diffrl.cli.main import parse
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.train.objectives import OBJECTIVES
from diffrl.train.trainer import Trainer

SWEEP = Path(__file__).parents[1] / "scripts/device/sweeps/algorithms.txt"
BENCH_LINES = {name.removesuffix("-s0"): shlex.split(flags) for name, _, flags in
               (line.partition(" ") for line in SWEEP.read_text().splitlines() if line.strip() and line[0] != "#")}
# The bench's batch shape shrunk to CPU size: 2 prompts × 4 samples, 2 optimizer steps, 4 denoising steps.
SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "4", "--rollout-microgroup-size", "4",
         "--global-batch-size", "4", "--num-steps-per-rollout", "2", "--micro-batch-size", "8", "--num-rollout", "2",
         "--diffusion-num-steps", "4", "--eval-images-per-category", "0", "--val-images-per-category", "0",
         "--reward", "rewards_for_tests:darkness", "--category-sampling", "uniform", "--device", "cpu",
         "--engine-max-batch-outputs", "8", "--engine-concurrency", "2"]


def test_the_bench_runs_every_method_and_the_registry_is_the_method_table():
    assert set(OBJECTIVES) == set(METHODS)
    assert {parse(["train", *flags, "--device", "cpu"]).algorithm.loss_type for flags in BENCH_LINES.values()} == \
        set(METHODS)


def _small(flags: list[str], model: Path, out: Path) -> list[str]:
    window = ["--diffusion-sde-window-range", "0,3"] if "--diffusion-sde-window-range" in flags else []
    return ["train", *flags, *SMALL, *window, "--model-path", str(model), "--output-dir", str(out)]


@pytest.mark.parametrize("method", sorted(BENCH_LINES))
def test_each_bench_method_trains_two_rollouts(method, tiny_model_dir, tmp_path):
    cfg = parse(_small(BENCH_LINES[method], tiny_model_dir, tmp_path / "run"))
    trainer = Trainer(cfg)
    before = [p.detach().clone() for p in trainer.policy.params]
    requests = []
    objective_request = trainer.objective.request
    trainer.objective.request = lambda k: requests.append(objective_request(k)) or requests[-1]
    records = [trainer.rollout_and_update(k) for k in range(2)]
    row = METHODS[cfg.algorithm.loss_type]
    for record in records:
        assert "train/skipped" not in record, record
        assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0, record
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.params))
    assert all(r["rollout"] == (row.rollout == "sde") for r in requests)
    if row.rollout == "sde":
        assert all(r["rollout_sde_type"] == cfg.rollout.diffusion_sde_type for r in requests)
        assert records[0]["train/log_prob_mean_abs_diff"] < 1e-6  # on policy, also for the dance step
    sampler = trainer.objective.rollout_ema
    assert (sampler is not None) == (row.sampler == "old")


def test_mixgrpo_window_slides_over_training():
    cfg = parse(["train", *BENCH_LINES["mixgrpo"], "--device", "cpu"])
    from diffrl.train.objectives.flow_grpo import sde_window

    interval = cfg.rollout.diffusion_sde_window_shift_interval
    lo, hi = cfg.rollout.sde_window_range()
    starts = [sde_window(cfg, k)[0] for k in range(0, 20 * interval, interval)]
    assert starts[0] == lo and starts == sorted(starts) and starts[-1] == hi - cfg.rollout.diffusion_num_sde_steps
    assert len(set(sde_window(cfg, k)[0] for k in range(interval))) == 1  # still within an interval


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(BENCH_LINES))
def test_each_bench_method_trains_the_shipped_model(method, tmp_path):
    cfg = parse(_small(BENCH_LINES[method], SHIPPED_DEMO_MODEL, tmp_path / "run"))
    records = [Trainer(cfg).rollout_and_update(0)]
    assert math.isfinite(records[0]["train/loss"]) and records[0]["train/grad_norm"] > 0


# The real-size families take every method a flag away: the published SD3.5 recipe (CFG 4.5, LoRA r32, 512²) with
# --loss-type X on a tiny SD3 checkpoint, shrunk to CPU size. Methods on ODE samples roll out at the recipe's CFG and
# train the conditional velocity; the KL term of the recipe (β 0.01, x-based for the SDE methods) becomes v-based.
RECIPE_SMALL = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2",
                "--global-batch-size", "4", "--num-steps-per-rollout", "1", "--micro-batch-size", "4",
                "--num-rollout", "1", "--diffusion-num-steps", "2", "--resolution", "32", "--lora-rank", "2",
                "--eval-interval", "10", "--reward", "rewards_for_tests:darkness", "--device", "cpu",
                "--checkpoint-interval", "10"]
SDE_SMALL = ["--diffusion-sde-window-range", "0,2", "--diffusion-num-sde-steps", "1"]


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint

    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny")


# Two methods in the default run (one per rollout kind that is not Flow-GRPO's own, which test_sd3 trains); the rest slow.
@pytest.mark.parametrize("loss_type", [m if m in ("awm", "dgpo") else pytest.param(m, marks=pytest.mark.slow)
                                       for m in sorted(METHODS)])
def test_every_method_runs_on_a_real_family_recipe(loss_type, sd3_dir, tmp_path):
    sde = METHODS[loss_type].rollout == "sde"
    cfg = parse(["train", "--recipe", "sd35-grpo-pickscore", "--loss-type", loss_type, "--model-path", str(sd3_dir),
                 "--output-dir", str(tmp_path / "run"), *RECIPE_SMALL, *(SDE_SMALL if sde else ["--kl-type", "v-based"])])
    assert cfg.model.use_lora and cfg.rollout.diffusion_guidance_scale == 4.5 and cfg.algorithm.diffusion_kl_beta == 0.01
    record = Trainer(cfg).rollout_and_update(0)
    assert math.isfinite(record["train/loss"]) and record["train/grad_norm"] > 0, record


def test_the_flags_choices_are_the_losses_own():
    """The config's choices for AWM's weighting and CRD's loss are the ones the loss functions implement."""
    import typing

    from diffrl.algorithms.losses import AWM_WEIGHTINGS, CRD_LOSSES
    from diffrl.train.config import AwmConfig, CrdConfig

    hints = {**typing.get_type_hints(AwmConfig), **typing.get_type_hints(CrdConfig)}
    assert typing.get_args(hints["awm_weighting"]) == AWM_WEIGHTINGS
    assert typing.get_args(hints["crd_loss"]) == CRD_LOSSES


@pytest.mark.parametrize("method", ["dpo", "crd"])
def test_a_reference_kept_on_the_host_trains_the_same(method, tiny_model_dir, tmp_path):
    """--offload-reference keeps a full finetune's starting weights in host memory and copies them in for each
    reference forward: the same losses and weights as the copy on the device (DPO reads the base model in its
    loss, CRD through its KL term), and the live weights come back after each use."""
    flags = [*BENCH_LINES[method], "--diffusion-kl-beta", "0.01"] if method == "crd" else BENCH_LINES[method]
    runs = []
    for offload in ([], ["--offload-reference"]):
        trainer = Trainer(parse(_small(flags, tiny_model_dir, tmp_path / f"run{len(runs)}") + offload))
        assert trainer.policy.base_weights.on_host == bool(offload)
        records = [trainer.rollout_and_update(k) for k in range(2)]
        runs.append(([r["train/loss"] for r in records], [p.detach().clone() for p in trainer.policy.params]))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_offload_reference_is_refused_with_lora():
    with pytest.raises(ValueError, match="--offload-reference"):
        parse(["train", "--offload-reference", "--use-lora", "--device", "cpu"]).check()


# The image-conditioned path: every method on the editing world (the shipped editing model, its rendered sources as
# condition images). Two in the default run, one per rollout kind; the rest slow.
@pytest.mark.parametrize("method", [m if m in ("flow-grpo", "nft") else pytest.param(m, marks=pytest.mark.slow)
                                    for m in sorted(BENCH_LINES)])
def test_each_bench_method_trains_with_the_condition_images(method, tmp_path):
    """Every forward with gradients (the replay of a Flow-GRPO step, each ODE method's loss) carries the source
    image's tokens: a method that lost them would train an editing model as a text-to-image one."""
    from diffrl.models.demo import SHIPPED_EDIT_MODEL

    flags = [*_small(BENCH_LINES[method], SHIPPED_EDIT_MODEL, tmp_path / "run"), "--world", "shapes-edit",
             "--reward", "shapes_edit", "--num-rollout", "1"]
    trainer = Trainer(parse(flags))
    forwards = []
    trainer.policy.family.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append((torch.is_grad_enabled(), "image_cond_hidden_states" in kwargs)),
        with_kwargs=True)
    record = trainer.rollout_and_update(0)
    assert math.isfinite(record["train/loss"]), record
    with_gradients = [has_source for grad, has_source in forwards if grad]
    assert with_gradients and all(with_gradients)
    assert all(has_source for _, has_source in forwards)  # the rollouts' too
