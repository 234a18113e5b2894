"""`diffrl bench-train [any flag of diffrl train]`: what the training loop costs on this machine, for a
run's own settings and checkpoint.

It runs the trainer for a few rollouts (3 unless --num-rollout says otherwise; no held-out evaluation
and no checkpoints unless asked; a temporary run folder unless --output-dir) and prints, from the run's
metrics.jsonl, per sample (its rollout and its trained steps), per rollout image (reward included), per
train pair, the peak GPU memory, the first pass's rollout-vs-trainer |Δ log p| and clipped share (the
on-policy exactness a speed-up must keep), and on a GPU an MFU estimate. Steady state is the median
over the rollouts after the first; the first pays the warm-up (allocator, kernel selection, compiled
graphs) and is shown apart.

`training_table` and `format_table` compute and print the table from any run's records.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from diffrl.algorithms.methods import METHODS
from diffrl.cli.bench import transformer_gflop
from diffrl.cli.configs import BenchTrainConfig
from diffrl.train.config import TrainConfig
from diffrl.train.metrics import read_metrics
from diffrl.train.objectives import OBJECTIVES
from diffrl.train.parallel import finish_parallel
from diffrl.train.trainer import Trainer

# What bench-train changes in `diffrl train`'s defaults (a recipe's included); flags override them again.
def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rollout_row(record: dict, flops: dict | None = None, peak_tflops: float | None = None) -> dict:
    """One rollout's costs from its metrics record; None where the run did not measure it."""
    rollout_s = record["rollout/seconds"]
    samples = round(record["rollout/images_per_s"] * rollout_s)
    train_s, pairs = record.get("train/seconds"), record.get("train/pairs")
    trained = train_s is not None and pairs
    row = {"rollout": record["rollout"], "samples": samples, "rollout_image_s": rollout_s / samples,
           "train_pairs": pairs, "trained_steps_per_sample": pairs / samples if trained else None,
           "train_pair_ms": 1000 * train_s / pairs if trained else None,
           "sample_s": (rollout_s + train_s) / samples if trained else None,
           "peak_gib": record.get("memory/peak_gib"),
           "first_pass_log_prob_abs_diff": record.get("train/log_prob_mean_abs_diff"),
           "first_pass_clipfrac": record.get("train/first_pass_clipfrac"), "sample_gflop": None, "mfu": None}
    if flops is not None and trained:
        row["sample_gflop"] = (flops["rollout_gflop_per_sample"]
                               + row["trained_steps_per_sample"] * flops["train_gflop_per_pair"])
        row["mfu"] = row["sample_gflop"] / row["sample_s"] / 1000 / peak_tflops if peak_tflops else None
    return row


def training_table(records: list[dict], flops: dict | None = None, peak_tflops: float | None = None) -> dict:
    """The loop's costs from a run's metrics records: the first rollout's, and the medians of the later
    ones (steady state). `flops` (from `estimate_flops`) adds FLOPs per sample, `peak_tflops` an MFU."""
    rows = [rollout_row(r, flops, peak_tflops) for r in records if "rollout/seconds" in r]
    if not rows:
        raise ValueError("no rollout in the run's metrics: nothing to time")
    steady = rows[1:]
    keys = [k for k in rows[0] if k not in ("rollout", "samples")]
    return {"first": rows[0], "steady": {k: _median(r.get(k) for r in steady) for k in keys} if steady else None,
            "steady_rollouts": [r["rollout"] for r in steady], "rollouts": rows}


def backward_factor(cfg: TrainConfig) -> float:
    """A backward pass's FLOPs in forwards: ≈ 1 with LoRA (gradients of the activations only; the adapters'
    own are negligible), 2 for a full finetune (activations and weights)."""
    return 1.0 if cfg.model.use_lora else 2.0


def no_grad_forwards_per_pair(cfg: TrainConfig) -> float:
    """Forwards without gradients per sample of a train pair, as the method's objective runs them: the KL
    reference, NFT's old policy, CRD's old snapshot, a preference method's base model, AWM's sampling weights
    on optimizer steps after the first (a fraction when averaged over a rollout)."""
    return OBJECTIVES[cfg.algorithm.loss_type].forwards_without_grad(cfg)


def train_forward_equivalents(cfg: TrainConfig) -> float:
    """Model FLOPs of one train pair, in forwards of the trained velocity (a CFG velocity counts as one here):
    its forward, its backward and the forwards without gradients, times the samples a pair holds (a preference
    pair 2, a group row its group). Gradient checkpointing's recomputed forward is not counted, by MFU's
    convention (it is work the hardware does, not work the model needs)."""
    samples = OBJECTIVES[cfg.algorithm.loss_type].pair_size(cfg)
    return samples * (trained_forward(cfg) + trained_backward(cfg) + no_grad_forwards_per_pair(cfg))


def trained_forward(cfg: TrainConfig) -> float:
    """A train pair's forward in forwards of its velocity: 1, less CFG's unconditional half on the pairs of each
    rollout's first optimizer step when the rollout hands that half over (`Objective.hands_over_uncond`)."""
    reused = OBJECTIVES[cfg.algorithm.loss_type].hands_over_uncond(cfg)
    return 1.0 - 0.5 / cfg.optim.num_steps_per_rollout if reused else 1.0


def trained_backward(cfg: TrainConfig) -> float:
    """A train pair's backward in forwards of its velocity: the backward factor, halved when CFG's unconditional
    half is detached (`--detach-uncond`: no backward runs through it)."""
    return backward_factor(cfg) * (0.5 if cfg.algorithm.detach_uncond and trains_with_cfg(cfg) else 1.0)


def trains_with_cfg(cfg: TrainConfig) -> bool:
    """Whether a train pair's velocity is the CFG one (both branches): the policy-gradient methods replay the
    rollout's guided step; the methods on ODE samples train the conditional velocity alone."""
    return METHODS[cfg.algorithm.loss_type].rollout == "sde" and cfg.rollout.diffusion_guidance_scale > 1


def estimate_flops(cfg: TrainConfig, family) -> dict:
    """Transformer GFLOP per sample of a rollout and per train pair, counted at batch 1 by torch's
    FlopCounterMode (eagerly, as compiled graphs hide their ops from the counter)."""
    m, r, a = cfg.model, cfg.rollout, cfg.algorithm
    size = m.size() or family.default_size()
    frames = (m.num_frames or family.default_num_frames) if family.generates_video else None
    rollout_cfg = a.nft_rollout_guidance_scale if a.loss_type == "nft" else r.diffusion_guidance_scale
    train_cfg = r.diffusion_guidance_scale if trains_with_cfg(cfg) else 1.0
    gflop = {g: transformer_gflop(family, 1, size, g, frames) for g in {rollout_cfg, train_cfg}}  # counted eager
    backward, no_grad = trained_backward(cfg), no_grad_forwards_per_pair(cfg)
    train_pair = gflop[train_cfg] * train_forward_equivalents(cfg)
    step = "CFG step (cond + uncond)" if rollout_cfg > 1 else "step"
    how = (f"{r.diffusion_num_steps} rollout steps × {_gflop(gflop[rollout_cfg])} per {step} + each trained step "
           f"× {_gflop(train_pair)} (its forward, {_gflop(gflop[train_cfg])}"
           + (f" × {trained_forward(cfg):g} (CFG's unconditional half taken from the rollout on its first optimizer "
              "step)" if trained_forward(cfg) < 1 else "")
           + f", and a backward of ≈ {backward:g}× the "
           + ("forward: LoRA, input gradients only" if m.use_lora
              else "forward: full finetune, input and weight gradients")
           + (", through CFG's conditional half alone" if backward < backward_factor(cfg) else "")
           + (f"; and {no_grad:g} forward(s) without gradients" if no_grad else "")
           + "); the transformer alone, counted at batch 1 by torch's FlopCounterMode (text encoders, VAE, reward "
             "and gradient checkpointing's recompute not counted)")
    return {"rollout_step_gflop": gflop[rollout_cfg], "train_forward_gflop": gflop[train_cfg],
            "backward_factor": backward, "no_grad_forwards_per_pair": no_grad,
            "rollout_gflop_per_sample": r.diffusion_num_steps * gflop[rollout_cfg], "train_gflop_per_pair": train_pair,
            "how": how}


def _gflop(value: float) -> str:
    return f"{_num(value)} GFLOP"


def _num(value: float) -> str:
    """Three significant digits, without an exponent for large values (3,390 ms, not 3.39e+03)."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def _fmt(value, kind: str, missing: str = "n/a") -> str:
    if value is None:
        return missing
    if kind == "s":
        return f"{_num(value)} s"
    if kind == "ms":
        return f"{_num(value)} ms"
    if kind == "gib":
        return f"{value:.1f} GiB"
    if kind == "mfu":
        return f"{100 * value:.1f}%"
    if kind == "diff":
        return "0" if value == 0 else f"{value:.2g}"
    return _num(value)


def format_table(table: dict, loss_type: str = "flow_grpo", on_gpu: bool = True, clip_range: float | None = None,
                 peak_tflops: float | None = None, flops: dict | None = None) -> str:
    """The table as markdown, with a line on what steady state means and how FLOPs were estimated."""
    first, steady, later = table["first"], table["steady"], table["steady_rollouts"]
    no_ratio = f"n/a ({loss_type} has no ratio)" if loss_type != "flow_grpo" else "n/a"
    steps = steady["trained_steps_per_sample"] if steady else first["trained_steps_per_sample"]
    clip = f" (clip range {clip_range:g})" if clip_range is not None and loss_type == "flow_grpo" else ""
    rows = [(f"sample (its rollout + its {_fmt(steps, '')} trained step{'' if steps == 1 else 's'})", "sample_s", "s",
             "n/a"),
            ("rollout image, in the training loop (reward included)", "rollout_image_s", "s", "n/a"),
            ("train pair", "train_pair_ms", "ms", "n/a"),
            ("peak GPU memory", "peak_gib", "gib", "n/a" if on_gpu else "n/a (CPU)"),
            ("first-pass mean \\|Δ log p\\| rollout vs trainer", "first_pass_log_prob_abs_diff", "diff", no_ratio),
            (f"first-pass clipfrac{clip}", "first_pass_clipfrac", "", no_ratio)]
    if flops is not None:
        rows.append((f"MFU, estimated (against {peak_tflops:g} TFLOP/s)" if peak_tflops else "MFU, estimated",
                     "mfu", "mfu", "n/a" if on_gpu else "n/a (CPU)"))
    span = (f"rollout {later[0]}" if len(later) == 1 else f"rollouts {later[0]}–{later[-1]}") if later else ""
    head = f"| per | steady state: median of {span} | first rollout (warm-up) |" if steady else \
        "| per | first rollout (warm-up; no later rollout: pass --num-rollout 2 or more) |"
    lines = [head, "|---|---|---|" if steady else "|---|---|"]
    for label, key, kind, missing in rows:
        cells = ([_fmt(steady.get(key), kind, missing)] if steady else []) + [_fmt(first.get(key), kind, missing)]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    notes = [f"{first['samples']} samples per rollout; the first rollout holds the warm-up (allocator, kernel "
             "selection, compiled graphs), so steady state is the rollouts after it."]
    if flops is not None:
        sample_gflop = (steady or first).get("sample_gflop")
        total = "n/a" if sample_gflop is None else _gflop(sample_gflop)
        notes.append(f"FLOPs per sample, estimated: {total} = " + flops["how"] + ".")
    return "\n".join(lines + [""] + notes)


def _trainer_without_checkpoints():
    class BenchTrainer(Trainer):
        """The loop without writing checkpoints (their time is outside the measured seconds anyway)."""

        def save_checkpoint(self):
            return None

        def _keep_if_best(self, record: dict) -> None:
            return None

    return BenchTrainer


def bench_train(cfg: BenchTrainConfig) -> dict | None:
    """Run the trainer, then print (and with --out write) the table. Under torchrun the main rank reports."""
    train_cfg = cfg.train
    if train_cfg.uses_ray():
        raise ValueError("bench-train times the trainer in this process (or torchrun's ranks); not with Ray "
                         "placement (--ray-engines, --ray-trainer-ranks)")
    if train_cfg.checkpoint.resume:
        raise ValueError("bench-train times a fresh run; --resume would continue one (drop it)")
    trainer_cls = Trainer if cfg.checkpoints else _trainer_without_checkpoints()
    results = None
    with contextlib.ExitStack() as stack:
        temporary = train_cfg.checkpoint.output_dir is None and int(os.environ.get("WORLD_SIZE", "1")) == 1
        if temporary:  # under torchrun the trainer asks for a shared --output-dir itself
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="diffrl-bench-train-")))
            train_cfg = train_cfg.replace(output_dir=folder / "run")
        trainer = trainer_cls(train_cfg)
        trainer.train()
        if trainer.parallel.is_main:
            on_gpu = trainer.device.type == "cuda"
            records = read_metrics(trainer.out / "metrics.jsonl")[0]
            flops = estimate_flops(trainer.cfg, trainer.policy.engine_family)
            peak = cfg.peak_tflops if on_gpu else None
            table = training_table(records, flops, peak)
            a = trainer.cfg.algorithm
            print("\ntraining loop cost (diffrl bench-train)")
            print(format_table(table, a.loss_type, on_gpu, a.diffusion_clip_range, peak, flops))
            # --compile: the kinds of compiled block that ran eager anyway (the trainer checks after its first update)
            eager = next((r["compile/uncompiled_block_kinds"] for r in records if "compile/uncompiled_block_kinds" in r),
                         None)
            if eager:
                print(f"warning: {eager:g} kind(s) of compiled block ran eager (named in the run's log): these are "
                      "eager figures")
            if temporary:
                print("(the run folder was temporary; --output-dir keeps it)")
            device = torch.cuda.get_device_name(trainer.device) if on_gpu else "cpu"
            results = {"device": device, "loss_type": a.loss_type, "family": trainer.policy.family.name,
                       "peak_tflops": peak, "flops": flops, "uncompiled_block_kinds": eager, **table,
                       "config": json.loads(json.dumps(trainer.cfg.as_flat_dict(), default=str))}
            if cfg.out:
                cfg.out.write_text(json.dumps(results, indent=2) + "\n")
    finish_parallel(trainer.parallel)  # a torchrun rank exits here
    return results
