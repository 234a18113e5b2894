"""DiffusionNFT's old-policy forward under FSDP2: the EMA swapped into the sharded parameters must be
what the forward sees, also right after a forward of the live weights (the trainer alternates
the two every micro-batch). Compares both velocities with unsharded reference copies.

    torchrun --nproc-per-node 2 tests/parallel_ema_check.py OUT
"""

import copy
import json
import sys
from pathlib import Path

import torch

from diffrl.models.base import Latents
from diffrl.models.random_checkpoints import demo as random_demo
from diffrl.train.ema import ParameterEMA
from diffrl.train.parallel import finish_parallel, init_parallel, shard_transformer

BATCH = 4


def main(out: Path) -> None:
    torch.set_num_threads(1)
    parallel = init_parallel(torch.device("cpu"))
    family = random_demo.random_family(random_demo.tiny(), seed=0)
    ema_reference = copy.deepcopy(family.transformer)  # the EMA holds the initial weights
    with torch.no_grad():  # the live weights move away from the EMA
        for p in family.transformer.parameters():
            p.mul_(1.5)
    live_reference = copy.deepcopy(family.transformer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 256, 48, generator=g)
    t = torch.rand(BATCH, generator=g) * 0.9 + 0.05
    with torch.no_grad():
        cond = family.encode_prompts(["a red circle", "two squares", "a blue triangle", "three diamonds"])
    ids = family.prepare_latents([torch.Generator()], 64, 64).ids
    rows = parallel.shard_of(BATCH, "batch")
    local_cond = type(cond)(cond.embeds[rows], cond.ids)

    def velocity(model):
        return family.velocity(model, Latents(x[rows], ids), t[rows], local_cond, None, 1.0)

    with torch.no_grad():
        want_old, want_live = velocity(ema_reference), velocity(live_reference)
    shard_transformer(family.transformer, family.block_lists, parallel.mesh)
    params = list(family.transformer.parameters())
    ema = ParameterEMA(params)
    with torch.no_grad():  # the EMA shadow gets the initial weights: the live ones / 1.5
        for shadow in ema.shadow:
            shadow.div_(1.5)
    errors = {"old": [], "live": []}
    for _ in range(2):  # old, live, backward; twice: the second old-policy forward follows a live one
        with torch.no_grad(), ema.swapped_in():
            v_old = velocity(family.transformer)
        v_live = velocity(family.transformer)
        v_live.square().mean().backward()
        errors["old"].append((v_old - want_old).abs().max().item())
        errors["live"].append((v_live.detach() - want_live).abs().max().item())
    if parallel.is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "errors.json").write_text(json.dumps(errors))
    finish_parallel(parallel)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
