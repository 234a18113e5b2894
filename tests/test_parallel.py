"""Data-parallel training with FSDP2: two gloo ranks (torchrun, CPU) equal one process."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffrl.train.parallel import Parallel

SCRIPT = Path(__file__).with_name("parallel_step_check.py")
EMA_SCRIPT = Path(__file__).with_name("parallel_ema_check.py")


def _run(cmd: list[str], out: Path) -> tuple[list[float], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(cmd + [str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), load_file(str(out / "weights.safetensors"))


# Covered in the default run by test_two_rank_training_run_matches_one_process[grpo] (the same FSDP2 sharding through
# the trainer: losses, gradient norms and final weights equal one process) and, for NFT's alternating forwards
# under FSDP2, test_old_policy_swap_reaches_sharded_forward.
@pytest.mark.slow
def test_two_gloo_ranks_with_fsdp2_match_one_process(tmp_path):
    single_losses, single = _run([sys.executable, str(SCRIPT)], tmp_path / "single")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517"]
    dist_losses, sharded = _run(torchrun + [str(SCRIPT)], tmp_path / "fsdp")
    assert single_losses[0] != single_losses[1]  # the first step moved the weights
    assert dist_losses == pytest.approx(single_losses, rel=1e-5, abs=1e-7)
    assert single.keys() == sharded.keys()
    for name, w in single.items():
        torch.testing.assert_close(sharded[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_old_policy_swap_reaches_sharded_forward(tmp_path):
    """NFT alternates forwards of the EMA (swapped into the shards) and of the live weights; under
    FSDP2 each must see its own weights (the root module once kept the previous forward's)."""
    out = tmp_path / "ema"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29523"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(torchrun + [str(EMA_SCRIPT), str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    errors = json.loads((out / "errors.json").read_text())
    assert max(errors["old"]) < 1e-5 and max(errors["live"]) < 1e-5, errors


def test_shares_must_divide():
    p = Parallel(rank=1, world_size=2)
    assert p.shard_of(8, "batch") == slice(4, 8)
    with pytest.raises(ValueError, match="divisible by the number of ranks"):
        p.shard_of(7, "--rollout-batch-size")


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", False), pytest.param("nft", False, marks=pytest.mark.slow),
                                                            pytest.param("nft", True, marks=pytest.mark.slow)],
                         ids=["grpo", "nft", "nft-lora"])
def test_two_rank_training_run_matches_one_process(tiny_model_dir, tmp_path, loss_type, lora):
    """`diffrl train` under torchrun with two gloo ranks: same rollouts and rewards, the same losses
    and final weights (to rounding) as one process; only rank 0 writes the run folder. LoRA: the
    sharded blocks hold frozen base weights and trained adapters side by side. Resumed from its rollout-1
    checkpoint, a copy of the two-rank run ends as the run did (each rank's shards come back), LoRA or not."""
    flags = ["train", "--model-path", str(tiny_model_dir), "--loss-type", loss_type, "--num-rollout", "2",
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--rollout-microgroup-size", "2",
             "--global-batch-size", "6", "--num-steps-per-rollout", "1", "--micro-batch-size", "64",
             "--diffusion-num-steps", "3", "--diffusion-guidance-scale",
             "2.0" if loss_type == "flow_grpo" else "1.0", "--lr", "1e-3", "--eval-interval", "2",
             *(["--diffusion-sde-window-range", "0", "3"] if loss_type == "flow_grpo" else []),  # only it reads one
             "--eval-images-per-category", "1", "--checkpoint-interval", "1", "--device", "cpu",
             "--reward", "rewards_for_tests:darkness"] + (["--use-lora", "--lora-rank", "2"] if lora else ["--no-use-lora"])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("WORLD_SIZE", None)
    port = {("flow_grpo", False): "29521", ("nft", False): "29519", ("nft", True): "29527"}[(loss_type, lora)]
    weights_file = ("lora/adapter_model.safetensors" if lora else
                    "model/transformer/diffusion_pytorch_model.safetensors")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port,
                "-m", "diffrl.cli.main"]
    runs = {}
    # Both runs at once: the one process alone left a core idle (each process has one thread).
    started = {name: subprocess.Popen(launcher + flags + ["--output-dir", str(tmp_path / name)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=(tmp_path / f"{name}.err").open("w"))
               for name, launcher in (("single", [sys.executable, "-m", "diffrl.cli.main"]),
                                      ("ranks", torchrun))}
    try:
        for proc in started.values():
            proc.wait(timeout=300)
    finally:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, proc in started.items():
        assert proc.returncode == 0, (tmp_path / f"{name}.err").read_text()[-3000:]
        out = tmp_path / name
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        weights = load_file(str(out / "checkpoints" / "rollout-00002" / weights_file))
        runs[name] = (records, weights)
    (single, w_single), (ranks, w_ranks) = runs["single"], runs["ranks"]
    assert len(single) == len(ranks) == 3  # the evaluation before training, then two rollouts
    assert single[1]["rollout/reward/raw_mean"] == ranks[1]["rollout/reward/raw_mean"]  # the same samples
    for a, b in zip(single[1:], ranks[1:], strict=True):  # after an update: the same up to rounding
        assert b["rollout/reward/raw_mean"] == pytest.approx(a["rollout/reward/raw_mean"], rel=1e-6)
        assert b["train/loss"] == pytest.approx(a["train/loss"], rel=1e-5, abs=1e-7)  # GRPO: a mean of ~0
        # Adam hides a gradient scaled by a constant; the norm does not.
        assert b["train/grad_norm"] == pytest.approx(a["train/grad_norm"], rel=1e-4)
    if loss_type == "flow_grpo":
        assert ranks[1]["train/log_prob_mean_abs_diff"] == 0.0  # the engine's copy is exact
    if lora:  # the adapters trained (B starts at zero), so their equality means something
        assert any(w.abs().max() > 0 for name, w in w_single.items() if "lora_B" in name)
    # LoRA: Adam turns a gradient element near its eps into a move of up to lr (1e-3), so rounding in
    # a near-zero element of B's first gradients shows as ~2e-6 (measured); full weights stay at 1e-6.
    atol = 1e-5 if lora else 1e-6
    for name, w in w_single.items():
        torch.testing.assert_close(w_ranks[name], w, rtol=1e-5, atol=atol, msg=name)

    # The default run's check of a two-rank resume, on the run just made: one more launch instead of the two of
    # test_two_rank_run_resumes_from_its_sharded_checkpoint. The copy "killed" after rollout 1 loses rollout 2's
    # checkpoint and metrics line; resumed, rollout 2 and the final weights must equal the two-rank run's (LoRA: its
    # sharded state holds the adapters alone, the frozen base coming from the model folder).
    split = tmp_path / "split"
    shutil.copytree(tmp_path / "ranks", split)
    shutil.rmtree(split / "checkpoints" / "rollout-00002")
    metrics = split / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:2]))  # rollouts 0 and 1
    assert (split / "checkpoints" / "rollout-00001" / "train_state").is_dir()
    done = subprocess.run(torchrun + flags + ["--output-dir", str(split), "--resume"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["rollout"] for r in resumed] == [0, 1, 2]
    for key in ("rollout/reward/raw_mean", "train/loss", "train/grad_norm"):
        assert resumed[2][key] == pytest.approx(ranks[2][key], rel=1e-6, abs=1e-9), key
    w_resumed = load_file(str(split / "checkpoints" / "rollout-00002" / weights_file))
    assert w_resumed.keys() == w_ranks.keys()
    for name, w in w_ranks.items():
        torch.testing.assert_close(w_resumed[name], w, rtol=1e-6, atol=1e-7, msg=name)


# Covered in the default run by test_two_rank_training_run_matches_one_process[grpo], which resumes a copy of its
# two-rank run from a sharded checkpoint (weights, optimizer moments, counters and sampling position); this is the
# NFT version over three rollouts, whose EMA also comes back from each rank's shards.
@pytest.mark.slow
def test_two_rank_run_resumes_from_its_sharded_checkpoint(tiny_model_dir, tmp_path):
    """Killed after rollout 2 and resumed under torchrun: rollout 3 and the final weights equal the
    uninterrupted run's (optimizer moments, EMA and counters come back from each rank's shards)."""
    flags = ["train", "--model-path", str(tiny_model_dir), "--loss-type", "nft", "--rollout-batch-size", "2",
             "--n-samples-per-prompt", "3", "--rollout-microgroup-size", "2", "--global-batch-size", "6",
             "--num-steps-per-rollout", "1", "--micro-batch-size", "64", "--diffusion-num-steps", "3",
             "--diffusion-guidance-scale", "1.0", "--lr", "1e-3", "--no-use-lora", "--eval-interval", "3",
             "--eval-images-per-category", "1", "--checkpoint-interval", "1", "--device", "cpu",
             "--reward", "rewards_for_tests:darkness", "--nft-ema-ramp", "0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("WORLD_SIZE", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29525",
                "-m", "diffrl.cli.main"]

    def train(out, *extra):
        done = subprocess.run(torchrun + flags + ["--output-dir", str(out), *extra], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]

    train(tmp_path / "straight", "--num-rollout", "3")
    # The run "killed" after rollout 2: the uninterrupted run's folder without rollout 3's checkpoint and metrics
    # line (a third torchrun launch, to stop a run at rollout 2, cost ~23 s of the test).
    shutil.copytree(tmp_path / "straight", tmp_path / "split")
    shutil.rmtree(tmp_path / "split" / "checkpoints" / "rollout-00003")
    metrics = tmp_path / "split" / "metrics.jsonl"
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:3]))  # rollouts 0, 1 and 2
    assert (tmp_path / "split" / "checkpoints" / "rollout-00002" / "train_state").is_dir()
    train(tmp_path / "split", "--num-rollout", "3", "--resume")
    records = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
               for name in ("straight", "split")}
    assert [r["rollout"] for r in records["split"]] == [0, 1, 2, 3]
    for key in ("rollout/reward/raw_mean", "train/loss", "train/grad_norm"):
        assert records["split"][3][key] == pytest.approx(records["straight"][3][key], rel=1e-6), key
    weights = [load_file(str(tmp_path / name / "checkpoints" / "rollout-00003" / "model" / "transformer" /
                             "diffusion_pytorch_model.safetensors")) for name in ("straight", "split")]
    for name, w in weights[0].items():
        torch.testing.assert_close(weights[1][name], w, rtol=1e-6, atol=1e-7, msg=name)
