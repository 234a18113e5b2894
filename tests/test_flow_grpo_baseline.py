"""benchmarks/flow_grpo_baseline.py (the published Flow-GRPO recipe on diffusers' pipeline) on a tiny random
SD3 checkpoint on CPU in fp32: its SDE step is diffrl's, its first recomputation of the log-probs is the
rollout's, its optimizer steps move the LoRA, and its report holds what BENCHMARKS.md quotes."""

import json
from pathlib import Path

import pytest
import torch
from benchmark_scripts import load_benchmark

from diffrl.sampling import sde_step

try:  # where the random-checkpoint builders live now; before, each family module had its own
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
except ImportError:
    from diffrl.models.sd3 import save_random_checkpoint



@pytest.fixture(scope="module")
def baseline():
    return load_benchmark("flow_grpo_baseline")


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny", with_t5=False)


def test_sde_step_is_diffrls(baseline):
    """Same x, v and x' at every step of a shifted 10-step schedule: the same mean and log-prob as
    diffrl.sampling.sde_step, with σ = 1's stand-in taken from the schedule in both."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    generator = torch.Generator().manual_seed(0)
    x, v = (torch.randn(10, 4, 8, 8, generator=generator) for _ in range(2))
    next_x = torch.randn(10, 4, 8, 8, generator=generator)
    timesteps = scheduler.timesteps  # one sample per step, σ = 1 included
    _, log_prob, mean, _ = baseline.sde_step_with_log_prob(scheduler, v, timesteps, x, 0.7, next_x=next_x)
    sigmas = scheduler.sigmas.float()
    ours = sde_step(x, v, sigmas[:-1], sigmas[1:], 0.7, sigma_max=float(sigmas[1]), next_latents=next_x)
    torch.testing.assert_close(mean, ours.mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(log_prob, ours.log_prob, rtol=1e-6, atol=1e-6)
    assert log_prob.std() > 0.1  # the steps differ, so the comparison can fail
    # Drawing: x' lies one std from the mean on average (the score is then the Gaussian's).
    drawn, drawn_log_prob, _, _ = baseline.sde_step_with_log_prob(scheduler, v, timesteps, x, 0.7)
    rescored = sde_step(x, v, sigmas[:-1], sigmas[1:], 0.7, sigma_max=float(sigmas[1]), next_latents=drawn)
    torch.testing.assert_close(drawn_log_prob, rescored.log_prob, rtol=1e-6, atol=1e-6)
    z = ((drawn - ours.mean) / ours.std.view(-1, 1, 1, 1)).flatten()
    assert abs(z.std().item() - 1) < 0.1


def test_one_iteration_on_cpu_is_on_policy_and_moves_the_lora(baseline, sd3_dir, tmp_path):
    out = tmp_path / "baseline.json"
    argv = ["--checkpoint", str(sd3_dir), "--device", "cpu", "--dtype", "float32", "--resolution", "32",
            "--prompts", "2", "--samples-per-prompt", "4", "--rollout-batch", "4", "--train-batch", "4",
            "--optimizer-steps", "2", "--warmup", "0", "--iterations", "1", "--lora-rank", "4", "--lora-alpha", "8",
            "--out", str(out)]
    args = baseline.parse_args(argv)
    pipe = baseline.load_pipeline(args.checkpoint, "cpu", torch.float32)
    baseline.add_lora(pipe, args.lora_rank, args.lora_alpha)
    before = {name: p.detach().clone() for name, p in pipe.transformer.named_parameters() if p.requires_grad}
    assert before and all("lora_" in name for name in before)
    assert not any(p.any() for name, p in before.items() if "lora_B" in name)  # Gaussian init: B is zero

    results = baseline.main(argv, pipe)  # prints the table and writes --out

    # Nothing changed between the rollout and the first recomputation: fp32 on CPU reproduces it.
    assert results["first_pass_log_prob_abs_diff"] < 1e-4
    assert results["first_pass_clipfrac"] == 0
    record = results["iterations"][0]
    assert record["samples"] == 8 and record["pairs"] == 8 * 9 and record["optimizer_steps"] == 2
    after = dict(pipe.transformer.named_parameters())
    moved = [name for name in before if not torch.equal(before[name], after[name].detach())]
    assert any("lora_B" in name for name in moved) and any("lora_A" in name for name in moved)
    assert all(torch.isfinite(after[name]).all() for name in before)
    # The second optimizer step sees log-probs the first one changed.
    assert record["approx_kl"] > 0
    for key in ("s_per_rollout_image", "ms_per_train_pair", "s_per_sample"):
        assert results[key] > 0
    assert results["s_per_sample"] == pytest.approx(
        record["s_per_rollout_image"] + record["ms_per_train_pair"] * 9 / 1000, rel=1e-6)
    written = json.loads(out.read_text())
    assert written == json.loads(json.dumps(results)) and written["peak_gib_allocated"] is None
