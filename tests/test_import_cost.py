"""Importing the trainer, a reward worker's module or the colocated engine process's module, and `diffrl train
--help`, load no heavy third-party package they do not use: diffusers' and transformers' model stacks (with peft)
take ~5 s on a CPU and load when a model does; fastapi only for `diffrl serve`; scipy when a shapes image is
verified; FSDP (torch._dynamo) when a transformer is sharded. Every `diffrl train` start, torchrun rank and reward
worker paid them before (`import diffrl.train.trainer` took ~10 s, 2.5 s of it torch)."""

import subprocess
import sys

# What none of these entry points may import by itself.
HEAVY = ("diffusers", "transformers", "peft", "fastapi", "uvicorn", "scipy", "torch.distributed.fsdp", "ray",
         "matplotlib", "open_clip")

CHECK = f"""
import sys
import diffrl.train.trainer, diffrl.rewards.workers, diffrl.serving.colocated, diffrl.cli.main
try:
    diffrl.cli.main.parse(["train", "--help"])
except SystemExit:
    pass
print("loaded:", *(m for m in {HEAVY!r} if m in sys.modules))
"""


def test_entry_points_import_no_heavy_package_they_do_not_use():
    done = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = done.stdout.splitlines()[-1].split()[1:]  # after the help text
    assert not loaded, f"imported without being used: {loaded}"
