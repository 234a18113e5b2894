"""Host synchronizations per denoising step, per training micro-batch and per optimizer step, on tiny models.

    python benchmarks/host_syncs.py [--work-dir DIR] [--device cuda]

Counts with `diffrl.utils.host_syncs.HostSyncCounter` (on a CPU every tensor the loops compute counts as a device
tensor, see that module; on a GPU the count is exact and blocking copies to the device are counted too) and
prints, per phase, the count per unit and the diffrl source lines they come from:

- engine: one Flow-GRPO request (SDE on a window of steps, CFG, trajectory and denoising env returned) on the
  tiny demo family and on a tiny random SD3 checkpoint (on a CPU without its CPU-only row-by-row layers, as a
  GPU runs it), at two step counts: the difference is per denoising step, the rest per request (prompt
  encoding, decode, the response's bookkeeping);
- trainer: `Trainer.update` of one rollout of a tiny run (tests/test_trainer.py's sizes): `flow_grpo` and `nft`
  on the demo family, `flow_grpo` with LoRA and CFG 4.5 on the tiny SD3 (as a GPU runs it): per micro-batch
  (`objective.loss`, backward, the statistics) and per optimizer step (`policy.step`: clipping, the finite
  check, AdamW, the EMA), and the rollout's own bookkeeping outside both.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import tempfile
from pathlib import Path

import torch

from diffrl.engine.engine import Engine, EngineConfig, _Ticket
from diffrl.engine.protocol import RolloutRequest
from diffrl.utils.host_syncs import HostSyncCounter

GRPO_REQUEST = dict(prompt="a red circle", negative_prompt="blurry", seed=7, num_outputs_per_prompt=3,
                    guidance_scale=4.5, rollout=True, rollout_sde_type="sde", rollout_noise_level=0.7,
                    rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)


def engine_request_syncs(family, num_steps: int, **request) -> HostSyncCounter:
    """The syncs of one Flow-GRPO request of `num_steps` steps (SDE on steps 1 and 2), run in this thread."""
    engine = Engine(family, EngineConfig(max_outputs_per_request=16))
    fields = {**GRPO_REQUEST, "num_inference_steps": num_steps, "rollout_sde_step_indices": [1, 2], **request}
    req = RolloutRequest(**fields)
    ticket = _Ticket(req, engine.plan(req))
    engine._generate([ticket])  # warm (lazy buffers, prompt cache)
    engine._prompts.clear()
    with HostSyncCounter() as counter:
        outputs = engine._generate([ticket])
    if isinstance(outputs[0], Exception):
        raise outputs[0]
    return counter


def engine_syncs(family, steps: tuple[int, int] = (4, 8)) -> dict:
    """Per denoising step (the difference between two step counts) and per request (the rest)."""
    short, long = (engine_request_syncs(family, n) for n in steps)
    per_step = (long.total - short.total) / (steps[1] - steps[0])
    return {"per_step": per_step, "per_request": short.total - per_step * steps[0], "short": short, "long": long,
            "steps": steps}


@contextlib.contextmanager
def as_on_a_gpu():
    """SD3 families loaded inside leave out the row-by-row layers they run on a CPU only (batch invariance,
    `models/sd3.py`): the forward a GPU runs."""
    from unittest import mock

    import diffrl.models.sd3 as sd3

    with mock.patch.object(sd3, "_run_per_sample_layers_row_by_row", lambda transformer: None):
        yield


def load_as_on_a_gpu(path: Path, device: torch.device):
    from diffrl.models.registry import resolve_family

    with as_on_a_gpu():
        return resolve_family("sd3", path).load(path, device=device, dtype=torch.float32)


def tiny_train_config(model_dir: Path, out: Path, **overrides):
    from diffrl.train.config import TrainConfig

    base = dict(model_path=model_dir, output_dir=out, num_rollout=1, rollout_batch_size=2, n_samples_per_prompt=3,
                rollout_microgroup_size=2, global_batch_size=3, num_steps_per_rollout=2, micro_batch_size=2,
                diffusion_num_steps=3, diffusion_sde_window_range=(0, 3), diffusion_num_sde_steps=2,
                diffusion_guidance_scale=2.0, lr=1e-3, eval_interval=1, checkpoint_interval=1, use_lora=False,
                reward="jpeg_compressibility")
    base.update(overrides)
    return TrainConfig.flat(**base)


@contextlib.contextmanager
def _tally(obj, name: str, counter: HostSyncCounter, into: dict):
    """Count the calls of `obj.name` and the syncs inside them."""
    original = getattr(obj, name)
    into.update(calls=0, syncs=0)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        before = counter.total
        try:
            return original(*args, **kwargs)
        finally:
            into["calls"] += 1
            into["syncs"] += counter.total - before

    setattr(obj, name, wrapped)
    try:
        yield
    finally:
        setattr(obj, name, original)


def trainer_syncs(model_dir: Path, out: Path, **overrides) -> dict:
    """One rollout and update of a tiny run: the syncs of the micro-batches, the optimizer steps and the rest."""
    from diffrl.train.trainer import Trainer

    trainer = Trainer(tiny_train_config(model_dir, out, **overrides))
    loss, step, update = {}, {}, {}
    with HostSyncCounter() as counter, _tally(trainer.objective, "loss", counter, loss), \
            _tally(trainer.policy, "step", counter, step), _tally(trainer, "update", counter, update):
        trainer.rollout_and_update(0)
    # A micro-batch is its loss plus what the loop does with it (backward, statistics); the optimizer step is
    # `policy.step`; what update() does besides is per micro-batch too (it has no per-update work of its own).
    # Cutting micro-batches where a trained step ends reads the pairs' σ (`micro_batch_bounds`): the pairs live on the
    # host on every device (the trainer pins them and copies each micro-batch over), so on a GPU no wait for it; a CPU
    # run counts them, at that site, apart.
    host_pair_reads = sum(1 for e in counter.events if e.where.endswith("(micro_batch_bounds)"))
    micro = (update["syncs"] - step["syncs"] - host_pair_reads) / loss["calls"]
    return {"per_micro_batch": micro, "host_pair_reads": host_pair_reads, "per_loss": loss["syncs"] / loss["calls"],
            "per_optimizer_step": step["syncs"] / max(step["calls"], 1), "micro_batches": loss["calls"],
            "optimizer_steps": step["calls"], "rollout_bookkeeping": counter.total - update["syncs"],
            "counter": counter}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="host-syncs-"))
    from diffrl.models.random_checkpoints import demo as random_demo
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
    from diffrl.models.registry import resolve_family

    demo_dir = work / "tiny-demo"
    random_demo.random_family(random_demo.tiny(), seed=0).save(demo_dir)
    demo = resolve_family("demo", demo_dir).load(demo_dir, device=device, dtype=torch.float32)
    sd3_dir = save_random_checkpoint(work / "sd3-tiny", with_t5=False)
    sd3 = load_as_on_a_gpu(sd3_dir, device)
    results = {}
    for name, family in (("demo", demo), ("sd3", sd3)):
        r = results[f"engine/{name}"] = engine_syncs(family)
        print(f"engine, {name} family, Flow-GRPO request: {r['per_step']:g} per denoising step, "
              f"{r['per_request']:g} per request")
        print(r["long"].report(label=f"  {r['steps'][1]} steps: "))
    runs = {"demo flow_grpo": (demo_dir, dict(loss_type="flow_grpo")), "demo nft": (demo_dir, dict(loss_type="nft")),
            # SD3's published Flow-GRPO settings in small: LoRA, CFG 4.5
            "sd3 flow_grpo": (sd3_dir, dict(loss_type="flow_grpo", use_lora=True, diffusion_guidance_scale=4.5))}
    for name, (model_dir, flags) in runs.items():
        with as_on_a_gpu():
            r = results[f"train/{name}"] = trainer_syncs(model_dir, work / f"run-{name.replace(' ', '-')}",
                                                         device=args.device, **flags)
        print(f"trainer, {name}: {r['per_micro_batch']:g} per micro-batch ({r['per_loss']:g} in the loss), "
              f"{r['per_optimizer_step']:g} per optimizer step, {r['rollout_bookkeeping']} in the rollout's "
              f"bookkeeping ({r['micro_batches']} micro-batches, {r['optimizer_steps']} optimizer steps)")
        print(r["counter"].report(label="  all: "))
    return results


if __name__ == "__main__":
    main()
