"""Data-parallel training with FSDP2: two gloo ranks (torchrun, CPU) equal one process."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from diffrl.train.parallel import Parallel

SCRIPT = Path(__file__).with_name("parallel_step_check.py")


def _run(cmd: list[str], out: Path) -> tuple[list[float], dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run(cmd + [str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((out / "losses.json").read_text()), load_file(str(out / "weights.safetensors"))


def test_two_gloo_ranks_with_fsdp2_match_one_process(tmp_path):
    single_losses, single = _run([sys.executable, str(SCRIPT)], tmp_path / "single")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517"]
    dist_losses, sharded = _run(torchrun + [str(SCRIPT)], tmp_path / "fsdp")
    assert single_losses[0] != single_losses[1]  # the first step moved the weights
    assert dist_losses == pytest.approx(single_losses, rel=1e-5, abs=1e-7)
    assert single.keys() == sharded.keys()
    for name, w in single.items():
        torch.testing.assert_close(sharded[name], w, rtol=1e-5, atol=1e-6, msg=name)


def test_shares_must_divide():
    p = Parallel(rank=1, world_size=2)
    assert p.shard_of(8, "batch") == slice(4, 8)
    with pytest.raises(ValueError, match="divisible by the number of ranks"):
        p.shard_of(7, "--rollout-batch-size")
