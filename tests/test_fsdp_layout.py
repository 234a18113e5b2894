"""What the published layouts need from a torchrun run: a full finetune's fp32 masters made block by block as
FSDP2 shards them (a 20.9 B transformer never whole in fp32 on a rank), the engine copy's dtype, and the reward
model on each rank's GPU or on one of its own."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.device_mesh import init_device_mesh

from diffrl.cli.main import parse
from diffrl.train.parallel import rank_reward_device, shard_transformer
from diffrl.train.policy import engine_copy_dtype
from diffrl.train.trainer import Trainer, validate_config


def test_a_ranks_reward_sits_on_its_gpu_unless_one_is_named():
    rank3 = torch.device("cuda", 3)
    assert rank_reward_device(None, rank3, 8) == "cuda:3"  # a spawned reward worker's bare "cuda" would be GPU 0
    assert rank_reward_device("cuda", rank3, 8) == "cuda:3"
    assert rank_reward_device("cuda:4", rank3, 5) == "cuda:4"  # a reward GPU of its own, after 4 ranks'
    assert rank_reward_device("cpu", rank3, 8) == "cpu"
    assert rank_reward_device(None, torch.device("cuda"), 1) is None  # one process on the current GPU: as before
    assert rank_reward_device(None, torch.device("cpu")) is None
    with pytest.raises(ValueError, match=r"--reward-device cuda:8: this machine has 8 GPU\(s\), cuda:0 to cuda:7"):
        rank_reward_device("cuda:8", rank3, 8)


def test_engine_copy_dtype_choices():
    t = torch.nn.Linear(4, 4)
    cpu = torch.device("cpu")
    assert engine_copy_dtype("auto", full_finetune=False, bf16=True, transformer=t, device=cpu) is None  # LoRA
    assert engine_copy_dtype("auto", True, True, t, cpu) == torch.float32
    assert engine_copy_dtype("auto", True, False, t, cpu) == torch.float32
    assert engine_copy_dtype("bfloat16", True, True, t, cpu) is None  # as loaded for a bf16 forward
    assert engine_copy_dtype("float32", True, True, t, cpu) == torch.float32
    with pytest.raises(ValueError, match="--engine-copy-dtype bfloat16 needs a bf16 forward"):
        engine_copy_dtype("bfloat16", True, False, t, cpu)


def test_engine_copy_dtype_flag_refusals(tiny_model_dir, tmp_path):
    base = ["train", "--device", "cpu", "--model-path", str(tiny_model_dir)]
    with pytest.raises(ValueError, match="--engine-copy-dtype bfloat16 sets a full finetune's engine copy"):
        validate_config(parse([*base, "--use-lora", "--engine-copy-dtype", "bfloat16"]))
    with pytest.raises(ValueError, match="--engine-copy-dtype bfloat16 needs a bf16 forward"):
        validate_config(parse([*base, "--no-use-lora", "--mixed-precision", "no", "--engine-copy-dtype", "bfloat16"]))
    one_process = parse([*base, "--no-use-lora", "--engine-copy-dtype", "float32", "--output-dir", str(tmp_path / "r")])
    with pytest.raises(ValueError, match="sets each torchrun rank's engine copy; one process's engine shares"):
        Trainer(one_process)
    assert not (tmp_path / "r").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sharding_casts_a_bf16_transformer_to_fp32_masters_block_by_block(tiny_family):
    """The same fp32 values as casting the whole transformer first, in fp32 shards, buffers included."""
    transformer = tiny_family.transformer.to(torch.bfloat16)
    expected = {n: t.float() for n, t in transformer.state_dict().items()}
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
    try:
        shard_transformer(transformer, tiny_family.block_lists, init_device_mesh("cpu", (1,)), dtype=torch.float32)
        got = {n: (t.full_tensor() if hasattr(t, "full_tensor") else t) for n, t in transformer.state_dict().items()}
    finally:
        dist.destroy_process_group()
    assert got.keys() == expected.keys()
    for name, t in got.items():
        assert t.dtype == (torch.float32 if expected[name].is_floating_point() else expected[name].dtype), name
        assert torch.equal(t, expected[name]), name
    assert all(type(p).__name__ == "DTensor" for p in transformer.parameters())


@pytest.mark.slow
def test_two_rank_full_finetune_of_a_bf16_checkpoint_matches_one_process(tiny_model_dir, tmp_path):
    """`--mixed-precision bf16` (the checkpoint loads in bf16, the masters are fp32): the same first rollout, an
    exact engine copy (first-pass log-prob gap 0) and the same weights to bf16 rounding; with
    `--engine-copy-dtype bfloat16` the gap is bf16 rounding's."""
    flags = ["train", "--model-path", str(tiny_model_dir), "--loss-type", "flow_grpo", "--num-rollout", "2",
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "3", "--rollout-microgroup-size", "2",
             "--global-batch-size", "6", "--num-steps-per-rollout", "1", "--micro-batch-size", "64",
             "--diffusion-num-steps", "3", "--diffusion-sde-window-range", "0", "3", "--diffusion-guidance-scale",
             "2.0", "--lr", "1e-3", "--eval-interval", "2", "--eval-images-per-category", "1",
             "--checkpoint-interval", "2", "--device", "cpu", "--reward", "rewards_for_tests:darkness",
             "--no-use-lora", "--mixed-precision", "bf16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("WORLD_SIZE", None)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(_free_port()), "-m", "diffrl.cli.main"]
    runs = {}
    for name, launcher, extra in (("single", [sys.executable, "-m", "diffrl.cli.main"], []), ("ranks", torchrun, []),
                                  ("bf16-copy", torchrun, ["--engine-copy-dtype", "bfloat16"])):
        out = tmp_path / name
        done = subprocess.run(launcher + flags + extra + ["--output-dir", str(out)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        runs[name] = (records, load_file(str(out / "checkpoints" / "rollout-00002" / "model" / "transformer" /
                                             "diffusion_pytorch_model.safetensors")))
    (single, w_single), (ranks, w_ranks), (copy16, _) = runs["single"], runs["ranks"], runs["bf16-copy"]
    assert single[1]["rollout/reward/raw_mean"] == ranks[1]["rollout/reward/raw_mean"]
    assert ranks[1]["train/log_prob_mean_abs_diff"] == 0.0 and ranks[2]["train/log_prob_mean_abs_diff"] == 0.0
    assert ranks[1]["train/grad_norm"] == pytest.approx(single[1]["train/grad_norm"], rel=1e-3)
    assert 0 < copy16[1]["train/log_prob_mean_abs_diff"] < 1e-3
    for name, w in w_single.items():
        assert w_ranks[name].dtype == torch.float32
        torch.testing.assert_close(w_ranks[name], w, rtol=0, atol=3e-3, msg=name)  # lr 1e-3: a few Adam steps apart


# Per family: a size its tiny random checkpoint makes.
TINY_SIZES = {"flux3_image": ["--resolution", "32"], "qwen_image": ["--resolution", "32"],
              "wan2_2": ["--height", "32", "--width", "32", "--num-frames", "1"]}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["flux3-klein-grpo-hps", "flux3-klein-nft-pickscore", "qwen-image-grpo-pickscore",
                                    "wan22-grpo-pickscore"])
def test_a_published_recipe_trains_under_torchrun_at_tiny_size(recipe, tmp_path, monkeypatch):
    """The recipe's own settings (LoRA or the full finetune, bf16 forward, gradient checkpointing, microgroups)
    on the family's tiny random checkpoint, two gloo ranks: FSDP2, an engine per rank, one rollout and update.
    Cut: the size, 4 steps, 2 groups; HPSv2.1 (a 1 B model) is replaced by a test reward."""
    benchmarks = Path(__file__).resolve().parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(benchmarks))
    from family_rollout import make_checkpoint
    from recipe_runs import PROMPTS, reward_spec

    from diffrl.recipes import recipe_overrides

    o = recipe_overrides(recipe, "cuda")
    family = o["diffusion_model_family"]
    make_checkpoint(family, tmp_path / family, torch.device("cpu"), tiny=True)
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    reward = reward_spec("pickscore", tmp_path, tiny=True) if o["reward"] == "pickscore" else "rewards_for_tests:darkness"
    flags = ["train", "--recipe", recipe, "--model-path", str(tmp_path / family), "--prompt-data",
             str(tmp_path / "prompts.txt"), "--reward", reward, "--device", "cpu", "--rollout-batch-size", "2",
             "--global-batch-size", str(2 * o["n_samples_per_prompt"] // o["num_steps_per_rollout"]),
             "--num-rollout", "1", "--eval-num-prompts", "0", "--diffusion-num-steps", "4", "--eval-num-steps", "4",
             "--output-dir", str(tmp_path / "run"), *TINY_SIZES[family]]
    if o["loss_type"] == "flow_grpo":
        lo, hi = o["diffusion_sde_window_range"]
        flags += ["--diffusion-sde-window-range", str(min(lo, 1)), str(min(hi, 3))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(_free_port()), "-m", "diffrl.cli.main", *flags], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (record,) = [r for r in records if "train/pairs" in r]
    assert record["train/pairs"] > 0 and record["train/grad_norm"] > 0
    if o["loss_type"] == "flow_grpo":
        assert record["train/log_prob_mean_abs_diff"] == 0.0  # each rank's engine copy computes what it trains
