"""Two optimizer steps of DiffusionNFT on a fixed batch, run as one process or under torchrun with
FSDP2 (each rank takes its share of the batch). Writes the final full weights and the losses, so
`test_parallel.py` can check that sharded data-parallel training equals the single-process run.

    python tests/parallel_step_check.py OUT            # one process
    torchrun --nproc-per-node 2 tests/parallel_step_check.py OUT
"""

import copy
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from diffrl.algorithms.losses import nft_loss
from diffrl.models.base import Latents
from diffrl.models.random_checkpoints import demo as random_demo
from diffrl.train.parallel import finish_parallel, full_tensor, init_parallel, shard_transformer

BATCH, STEPS = 8, 2


def main(out: Path) -> None:
    torch.set_num_threads(1)
    parallel = init_parallel(torch.device("cpu"))
    family = random_demo.random_family(random_demo.tiny(), seed=0)
    old_policy = copy.deepcopy(family.transformer)  # the frozen v_old of NFT
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(BATCH, 256, 48, generator=g), torch.randn(BATCH, 256, 48, generator=g)
    t = torch.rand(BATCH, generator=g) * 0.9 + 0.05
    advantages = torch.randn(BATCH, generator=g)
    prompts = ["a red circle", "two squares", "a blue triangle", "three diamonds"] * (BATCH // 4)
    with torch.no_grad():
        cond = family.encode_prompts(prompts)
    ids = family.prepare_latents([torch.Generator()], 64, 64).ids

    rows = parallel.shard_of(BATCH, "batch")
    if parallel.enabled:
        shard_transformer(family.transformer, family.block_lists, parallel.mesh)
    params = [p for p in family.transformer.parameters()]
    for p in params:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    s = t[rows].view(-1, 1, 1)
    x_t = (1 - s) * x0[rows] + s * noise[rows]
    local_cond = type(cond)(cond.embeds[rows], cond.ids)
    losses = []
    for _ in range(STEPS):
        optimizer.zero_grad()
        with torch.no_grad():
            v_old = family.velocity(old_policy, Latents(x_t, ids), t[rows], local_cond, None, 1.0)
        v = family.velocity(family.transformer, Latents(x_t, ids), t[rows], local_cond, None, 1.0)
        loss = nft_loss(v, v_old, x_t, x0[rows], t[rows], advantages[rows], beta=1.0, adv_clip_max=5.0).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        reported = loss.detach().clone()
        if parallel.enabled:  # equal shares: the global mean is the mean of the ranks' means
            dist.all_reduce(reported)
            reported /= parallel.world_size
        losses.append(float(reported))
    weights = {name: full_tensor(p.detach()).contiguous() for name, p in family.transformer.named_parameters()}
    if parallel.is_main:
        out.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(out / "weights.safetensors"))
        (out / "losses.json").write_text(json.dumps(losses))
    finish_parallel(parallel)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
