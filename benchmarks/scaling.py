"""Scaling curve of a recipe over data-parallel ranks (one GPU each), and the published recipes at their layout.

    python benchmarks/scaling.py --recipe flux3-klein-nft-pickscore --checkpoint runs/flux3_image-random \
        --gpus 1 2 4 8 --groups 8 --rollouts 2 --budget-s 480 --out scaling.json --md scaling.md
    python benchmarks/scaling.py --layout flux3-klein-grpo-hps --checkpoint runs/flux3_image-random --rollouts 2

Scaling: for each world size N (largest first), `torchrun --nproc-per-node N` runs this file's worker, which
builds the recipe's `Trainer` exactly as `diffrl train` does under torchrun (FSDP2 over the ranks, one
in-process engine per rank, the reward model on each rank's GPU) and times `--rollouts` rollouts of a fixed
`--groups` prompt groups (each rank rolls out groups/N of them, with the group indices, hence the seeds, that
those groups have in one process). By default a step is the rollout alone (engine weight sync, sampling,
reward, the rewards gathered: `--debug-rollout-only`); `--train` adds the update. Reported per N: seconds per
rollout (the slowest rank's wall clock, barrier to barrier), samples/s, speed-up and parallel efficiency
(samples/s at N over N × samples/s at 1), and whether every (rollout, group, sample) has the same seed, image
bits and reward as at the smallest N (the rollout layout keeps the samples whatever the GPU count).

Random weights at the family's real size and the recipe's reward model at its published size are built when
`--checkpoint` is missing (`recipe_runs.py`; `--tiny`: tiny ones for a CPU run). Without `--recipe`, the
flags after `--` describe the run (`--device cpu` and the tiny demo model in the tests).

Budget: `--budget-s` is the wall clock the whole may take. Before anything runs, the plan (from
`--prior-s-per-sample`, the recipe's seconds per sample at one GPU, and `--prior-startup-s` per launch) cuts
rollouts to 1 and then groups (in multiples of the largest N) until it fits, and says what it cut; after each
world the estimate is redone from what was measured, and a world that would not fit is skipped (and said).

`--layout RECIPE`: one run of the recipe at its published layout (`PUBLISHED_LAYOUTS`: ranks and where the
reward model sits), training included, groups cut to one per rank unless `--groups`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

# The published runs' placement on one 8×H200 node: trainer ranks (one engine each, FSDP2 over them) and the
# reward model either on every rank's own GPU ("rank") or on one GPU of its own, after the ranks' ("own").
# Wan2.2's 17-GPU run (16 ranks + 1) needs two nodes; on one node its 5-GPU layout runs.


@dataclass(frozen=True)
class Layout:
    ranks: int
    reward: str  # "rank" | "own"
    note: str


PUBLISHED_LAYOUTS = {
    "flux3-klein-nft-pickscore": Layout(8, "rank", "LoRA r32; trainer, engines and PickScore on all 8 GPUs"),
    "flux3-klein-grpo-hps": Layout(8, "rank", "full finetune (FSDP2); trainer, engines and HPSv2.1 on all 8 GPUs"),
    "qwen-image-grpo-pickscore": Layout(4, "own", "LoRA r64; 4 colocated GPUs plus one PickScore GPU"),
    "wan22-grpo-pickscore": Layout(4, "own", "LoRA r64; 4 colocated GPUs plus one PickScore GPU (the 5-GPU run)"),
}


def layout_gpus(layout: Layout) -> int:
    return layout.ranks + (1 if layout.reward == "own" else 0)


def layout_flags(layout: Layout) -> list[str]:
    """The train flags a layout adds: a reward GPU of its own is the one after the ranks' GPUs."""
    return ["--reward-device", f"cuda:{layout.ranks}"] if layout.reward == "own" else []


def launch_command(nproc: int, train_flags: list[str], python: str = sys.executable) -> list[str]:
    """`diffrl train` under torchrun with one process per GPU (a plain process for one)."""
    if nproc == 1:
        return [python, "-m", "diffrl.cli.main", "train", *train_flags]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
            "-m", "diffrl.cli.main", "train", *train_flags]


def layout_commands(models: str = "MODELS", python: str = "python") -> dict[str, str]:
    """Per published recipe, the command that launches it at its layout on real checkpoints (paths as
    placeholders under `models`: the family's diffusers directory, the reward's checkpoint, the prompts)."""
    from diffrl.recipes import recipe_overrides

    commands = {}
    for recipe, layout in PUBLISHED_LAYOUTS.items():
        o = recipe_overrides(recipe, "cuda")
        flags = ["--recipe", recipe, "--model-path", f"{models}/{o['diffusion_model_family']}",
                 "--prompt-data", f"{models}/prompts", "--reward", f"{o['reward']}@{models}/{o['reward']}",
                 "--device", "cuda", "--output-dir", f"runs/{recipe}", *layout_flags(layout)]
        visible = ",".join(str(i) for i in range(layout_gpus(layout)))
        commands[recipe] = f"CUDA_VISIBLE_DEVICES={visible} " + " ".join(launch_command(layout.ranks, flags, python))
    return commands


# ----------------------------------------------------------------------------------------------- the table


def efficiency_rows(worlds: list[dict]) -> list[dict]:
    """Per world size (ascending): seconds per rollout, samples/s, speed-up and parallel efficiency against the
    smallest world measured (efficiency = samples/s at N / ((N / N0) × samples/s at N0); N0 is 1 when it ran)."""
    measured = sorted((w for w in worlds if w.get("seconds_per_rollout")), key=lambda w: w["world_size"])
    if not measured:
        return []
    base = measured[0]
    base_rate = base["samples_per_rollout"] / base["seconds_per_rollout"]
    rows = []
    for w in measured:
        rate = w["samples_per_rollout"] / w["seconds_per_rollout"]
        scale = w["world_size"] / base["world_size"]
        rows.append({"world_size": w["world_size"], "seconds_per_rollout": w["seconds_per_rollout"],
                     "samples_per_s": rate, "speedup": rate / base_rate, "efficiency": rate / (scale * base_rate),
                     "rollout_s": w.get("rollout_s"), "train_s": w.get("train_s"),
                     "timed_rollouts": w.get("timed_rollouts"), "same_samples": w.get("same_samples")})
    return rows


def markdown(report: dict) -> str:
    rows = efficiency_rows(report["worlds"])
    lines = [f"Scaling of `{report.get('recipe') or 'the run'}`: {report['groups']} groups × "
             f"{report['samples_per_group']} samples per rollout ({report['step']}), {report['device']}.", "",
             "| GPUs | s per rollout | samples/s | speed-up | parallel efficiency | same samples as the smallest |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        same = r["same_samples"]
        if same is None:
            same_text = "—"
        else:  # with updates, the bits after the first rollout follow the weights' rounding
            bits = same["first_rollout"] if "update" in report["step"] else same
            which = "first rollout: " if bits is not same else ""
            same_text = (f"seeds {same['seeds']}/{same['total']}; {which}image bits {bits['images']}/{bits['total']}, "
                         f"rewards {bits['rewards']}/{bits['total']}")
        lines.append(f"| {r['world_size']} | {r['seconds_per_rollout']:.2f} | {r['samples_per_s']:.3f} | "
                     f"{r['speedup']:.2f}× | {100 * r['efficiency']:.0f}% | {same_text} |")
    for w in report["worlds"]:
        if not w.get("seconds_per_rollout"):
            lines.append(f"| {w['world_size']} | not measured: {w.get('skipped') or w.get('error') or 'no rollout'} "
                         f"| | | | |")
    agreement = report.get("curves_agreement")
    if agreement:
        a, b = agreement["worlds"]
        late_a, late_b = agreement["second_half_mean"]
        lines += ["", f"Reward curves, {a} against {b} GPUs: {agreement['within_2_se']} of {agreement['rollouts']} rollouts' "
                  f"mean rewards within 2 standard errors of each other (largest |z| {agreement['max_abs_z']:.2f}); "
                  f"mean reward over the second half {late_a:.4f} and {late_b:.4f}."]
    if report.get("cuts"):
        lines += ["", "Cut to fit the budget: " + "; ".join(report["cuts"])]
    return "\n".join(lines) + "\n"


def compare_samples(reference: list[dict], other: list[dict]) -> dict:
    """How many samples of `other` (rows: rollout, group, index, seed, image, latents, log_probs, reward) match
    the reference's at the same (rollout, group, index): seed, the bits of the image, of the returned latents and
    of the log-probs, and the reward, each exactly; over every rollout and, under `first_rollout`, over the first
    alone (after an update the weights of two world sizes differ by rounding, and so may every later sample)."""
    ref = {(s["rollout"], s["group"], s["index"]): s for s in reference}
    first = min((s["rollout"] for s in other), default=0)

    def count(rows: list[dict]) -> dict:
        same = {"total": len(rows), "missing": 0, "seeds": 0, "images": 0, "latents": 0, "log_probs": 0, "rewards": 0}
        for s in rows:
            r = ref.get((s["rollout"], s["group"], s["index"]))
            if r is None:
                same["missing"] += 1
                continue
            same["seeds"] += r["seed"] == s["seed"]
            same["images"] += r["image"] == s["image"]
            same["latents"] += r.get("latents") == s.get("latents")
            same["log_probs"] += r.get("log_probs") == s.get("log_probs")
            same["rewards"] += r["reward"] == s["reward"]
        return same

    return {**count(other), "first_rollout": count([s for s in other if s["rollout"] == first])}


def reward_curves(samples_by_world: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per world, per rollout: the mean reward of its samples and the standard error of that mean."""
    curves = {}
    for world, samples in samples_by_world.items():
        by_rollout: dict[int, list[float]] = {}
        for s in samples:
            if s.get("reward") is not None:
                by_rollout.setdefault(s["rollout"], []).append(s["reward"])
        rows = []
        for k, rewards in sorted(by_rollout.items()):
            n = len(rewards)
            mean = sum(rewards) / n
            var = sum((r - mean) ** 2 for r in rewards) / (n - 1) if n > 1 else 0.0
            rows.append({"rollout": k, "mean": mean, "se": (var / n) ** 0.5, "n": n})
        curves[world] = rows
    return curves


def curves_agreement(curves: dict[str, list[dict]], a: str, b: str) -> dict:
    """Worlds a and b rollout by rollout: the difference of their mean rewards in units of its standard error,
    sqrt(se_a² + se_b²) (the two as independent runs; about 95% of rollouts lie within 2 when they differ by
    noise alone), how many rollouts lie within 2, and each world's mean reward over the second half."""
    left = {r["rollout"]: r for r in curves[a]}
    right = {r["rollout"]: r for r in curves[b]}
    common = sorted(set(left) & set(right))
    z = []
    for k in common:
        se = (left[k]["se"] ** 2 + right[k]["se"] ** 2) ** 0.5
        diff = left[k]["mean"] - right[k]["mean"]
        z.append(0.0 if diff == 0 else (diff / se if se > 0 else float("inf")))
    half = common[len(common) // 2:]

    def late(side: dict) -> float | None:
        return sum(side[k]["mean"] for k in half) / len(half) if half else None

    return {"worlds": [a, b], "rollouts": len(common), "within_2_se": sum(abs(v) <= 2 for v in z),
            "max_abs_z": max((abs(v) for v in z), default=None), "z": z,
            "second_half_mean": [late(left), late(right)]}


# ----------------------------------------------------------------------------------------------- the plan


def fits_world(groups: int, world_size: int) -> bool:
    return groups % world_size == 0


def plan(gpus: list[int], groups: int, rollouts: int, samples_per_group: int, budget_s: float, setup_s: float,
         startup_s: float, s_per_sample: float) -> tuple[int, int, list[str]]:
    """Groups and rollouts per world such that every world's launch and rollouts fit `budget_s` at the prior
    cost (one GPU: `s_per_sample` seconds per sample; N GPUs: 1/N of it). Rollouts are cut first (to 1), then
    groups, in multiples of the largest world. Returns (groups, rollouts, what was cut)."""
    unit = max(gpus)
    cuts = []

    def cost(g: int, r: int) -> float:
        return setup_s + sum(startup_s + r * g * samples_per_group * s_per_sample / n for n in gpus)

    start_groups, start_rollouts = groups, rollouts
    while cost(groups, rollouts) > budget_s and rollouts > 1:
        rollouts -= 1
    while cost(groups, rollouts) > budget_s and groups > unit:
        groups -= unit
    if rollouts != start_rollouts:
        cuts.append(f"rollouts per world {start_rollouts} → {rollouts}")
    if groups != start_groups:
        cuts.append(f"groups per rollout {start_groups} → {groups}")
    if cost(groups, rollouts) > budget_s:
        cuts.append(f"the plan ({cost(groups, rollouts):.0f} s at the prior cost) still exceeds --budget-s {budget_s:.0f}: "
                    "the smallest worlds may be skipped")
    return groups, rollouts, cuts


# ----------------------------------------------------------------------------------------------- the worker


def _digest(t) -> str | None:
    """The first 16 hex digits of the sha256 of a tensor's bytes (None stays None)."""
    import torch

    if t is None:
        return None
    return hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def worker(argv: list[str]) -> None:
    """One rank (torchrun) or the one process: the Trainer of `diffrl train`, `--rollouts` timed rollouts (and
    updates with `--train`), every rank's samples gathered; rank 0 writes the JSON."""
    import torch
    import torch.distributed as dist

    from diffrl.cli.main import parse
    from diffrl.engine.protocol import RolloutRequest
    from diffrl.train.parallel import finish_parallel
    from diffrl.train.trainer import Trainer

    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--json", required=True)
    p.add_argument("--rollouts", type=int, required=True)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--stop-by", type=float, default=None)
    args, train_flags = p.parse_known_args(argv)
    train_flags = [f for f in train_flags if f != "--"]
    cfg = parse(["train", *train_flags])
    start = time.perf_counter()
    trainer = Trainer(cfg)
    load_s = time.perf_counter() - start
    parallel = trainer.parallel
    cuda = trainer.device.type == "cuda"

    def sync() -> None:
        if parallel.enabled:
            dist.barrier()
        if cuda:
            torch.cuda.synchronize(trainer.device)

    captured: list = []
    original = trainer.manager.rollout

    async def capturing(*a, **kw):
        groups = await original(*a, **kw)
        captured.append(groups)
        return groups

    trainer.manager.rollout = capturing
    warmup_s = 0.0
    if args.warmup_steps:  # kernels and allocator warmed at the run's shapes, outside the timed rollouts
        request = {k: v for k, v in trainer.objective.request(0).items()
                   if not k.startswith("rollout_") or k in ("rollout_noise_level",)}
        request.update(num_inference_steps=args.warmup_steps, rollout=False)
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            trainer.engine.generate(RolloutRequest(prompt="warm-up", seed=2**31 - 1, num_outputs_per_prompt=min(
                cfg.rollout.rollout_microgroup_size, cfg.rollout.n_samples_per_prompt), **request))
        sync()
        warmup_s = time.perf_counter() - t

    rows, samples, longest, stopped = [], [], 0.0, None
    n = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt
    for k in range(args.rollouts):
        late = bool(args.stop_by is not None and rows and time.time() + 1.1 * longest > args.stop_by)
        if _any(late, parallel):
            stopped = f"before rollout {k}: --stop-by"
            break
        sync()
        t = time.perf_counter()
        record = trainer.rollout_and_update(k)
        sync()
        wall = time.perf_counter() - t
        trainer.rollout_index = k + 1
        longest = max(longest, wall)
        mine = [{"rollout": k, "group": s.group_index, "index": s.sample_index, "seed": s.seed,
                 "image": _digest(s.output.generated_output),
                 "latents": _digest(s.output.dit_trajectory.latents if s.output.dit_trajectory is not None else None),
                 "log_probs": _digest(s.output.rollout_log_probs),
                 "reward": None if s.reward is None else float(s.reward), "rank": parallel.rank}
                for g in captured.pop() for s in g]
        times = {"rollout_s": record["rollout/seconds"], "train_s": record.get("train/seconds", 0.0)}
        if parallel.enabled:
            everyone = [None] * parallel.world_size
            dist.all_gather_object(everyone, (mine, times))
        else:
            everyone = [(mine, times)]
        samples += [s for part, _ in everyone for s in part]
        rows.append({"rollout": k, "wall_s": wall, "samples": n,
                     "rollout_s": max(t["rollout_s"] for _, t in everyone),
                     "train_s": max(t["train_s"] for _, t in everyone),
                     "reward_mean": record["rollout/reward/raw_mean"]})
        if "compile/uncompiled_block_kinds" in record:  # --compile: blocks that ran eager anyway (0: all compiled)
            rows[-1]["uncompiled_block_kinds"] = record["compile/uncompiled_block_kinds"]
        if "compile/block_kinds_at_recompile_limit" in record:  # --compile: kinds past dynamo's cache (then eager)
            rows[-1]["block_kinds_at_recompile_limit"] = record["compile/block_kinds_at_recompile_limit"]
        if parallel.is_main:
            print(json.dumps({"world_size": parallel.world_size, **rows[-1]}), flush=True)
    trainer._close_workers()
    if parallel.is_main:
        peak = torch.cuda.max_memory_allocated(trainer.device) / 2**30 if cuda else None
        Path(args.json).write_text(json.dumps({
            "world_size": parallel.world_size, "load_s": load_s, "warmup_s": warmup_s, "rollouts": rows,
            "samples": sorted(samples, key=lambda s: (s["rollout"], s["group"], s["index"])),
            "peak_gib_rank0": peak, "stopped": stopped}, indent=1))
    finish_parallel(parallel)


def _any(flag: bool, parallel) -> bool:
    from diffrl.train.parallel import any_rank

    return any_rank(flag, parallel)


# ----------------------------------------------------------------------------------------------- the driver


def summarize_world(result: dict) -> dict:
    """Seconds per rollout over the timed rollouts: all but the first when more than one ran."""
    rows = result["rollouts"]
    timed = rows[1:] if len(rows) > 1 else rows
    if not timed:
        return {"world_size": result["world_size"], "seconds_per_rollout": None}
    mean = lambda key: sum(r[key] for r in timed) / len(timed)  # noqa: E731
    return {"world_size": result["world_size"], "seconds_per_rollout": mean("wall_s"),
            "samples_per_rollout": timed[0]["samples"], "rollout_s": mean("rollout_s"), "train_s": mean("train_s"),
            "timed_rollouts": [r["rollout"] for r in timed], "load_s": result["load_s"],
            "warmup_s": result["warmup_s"], "peak_gib_rank0": result.get("peak_gib_rank0"),
            "stopped": result.get("stopped")}


def world_command(n: int, worker_args: list[str], train_flags: list[str], port: int | None = None) -> list[str]:
    script = str(Path(__file__).resolve())
    if n == 1:
        return [sys.executable, script, "--worker", *worker_args, "--", *train_flags]
    rdzv = ["--standalone"] if port is None else ["--master-port", str(port)]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv, "--nproc-per-node", str(n), script, "--worker",
            *worker_args, "--", *train_flags]


def run_world(cmd: list[str], env: dict, timeout: float | None, log_path: Path) -> tuple[int | str, str]:
    """Run one world in a session of its own; past `timeout` the whole session is killed (torchrun's ranks with
    it: killing torchrun alone would leave them holding their GPUs for the next world). Returns (exit code or
    "timeout", the log, also written to `log_path`)."""
    import signal

    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    return rc, log_path.read_text(errors="replace")


def available_gpus(device: str) -> int | None:
    if device != "cuda":
        return None  # CPU ranks: as many as asked
    import torch

    return torch.cuda.device_count()


def parse_args(argv: list[str] | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default=None)
    p.add_argument("--layout", default=None, choices=sorted(PUBLISHED_LAYOUTS),
                   help="run this recipe once at its published layout instead of the scaling curve")
    p.add_argument("--checkpoint", type=Path, default=None, help="model directory; built (random) when missing")
    p.add_argument("--print-layouts", action="store_true",
                   help="print every published layout's launch command on real checkpoints (under --checkpoint) and exit")
    p.add_argument("--tiny", action="store_true", help="tiny random checkpoints (CPU)")
    p.add_argument("--reward", default=None, help="default: the recipe's, on a random real-size checkpoint")
    p.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8], help="world sizes (those available run)")
    p.add_argument("--groups", type=int, default=None, help="prompt groups per rollout (default: the recipe's)")
    p.add_argument("--rollouts", type=int, default=2, help="rollouts per world (the first is untimed when >1)")
    p.add_argument("--train", action="store_true", help="time rollout + update (default: the rollout alone)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget-s", type=float, default=None, help="wall clock the whole may take")
    p.add_argument("--prior-s-per-sample", type=float, default=2.1,
                   help="planning prior: seconds per sample on one GPU (FLUX 3 NFT rollout, BENCHMARKS.md: 16.6 s / 8)")
    p.add_argument("--prior-startup-s", type=float, default=30.0,
                   help="planning prior: seconds per launch (imports, NCCL, loading a checkpoint in the page cache)")
    p.add_argument("--work-dir", type=Path, default=Path("runs/scaling"))
    p.add_argument("--master-port", type=int, default=None, help="fixed rendezvous port (default: --standalone)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--md", type=Path, default=None)
    args = p.parse_args(argv)
    if args.checkpoint is None and not args.print_layouts:
        p.error("--checkpoint is required")
    if args.layout and args.recipe and args.layout != args.recipe:
        p.error("--layout names the recipe; drop --recipe or give the same one")
    args.recipe = args.layout or args.recipe
    if any(n < 1 for n in args.gpus):
        p.error("--gpus: world sizes must be >= 1")
    return args, extra


def base_flags(args, extra: list[str]) -> tuple[list[str], object]:
    """The train flags every world shares (the recipe, the model, the reward, prompts), and their config."""
    from diffrl.cli.main import parse

    flags = []
    if args.recipe:
        sys.path.insert(0, str(HERE))
        from family_rollout import make_checkpoint
        from recipe_runs import PROMPTS, reward_spec

        from diffrl.recipes import recipe_overrides

        import torch

        overrides = recipe_overrides(args.recipe, "cuda")
        args.work_dir.mkdir(parents=True, exist_ok=True)
        if not args.checkpoint.exists():
            make_checkpoint(overrides["diffusion_model_family"], args.checkpoint,
                            torch.device(args.device), tiny=args.tiny)
        prompts = args.work_dir / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        flags += ["--recipe", args.recipe, "--prompt-data", str(prompts), "--eval-num-prompts", "0",
                  "--reward", reward_spec(args.reward or overrides["reward"], args.work_dir, args.tiny)]
    elif args.reward:
        flags += ["--reward", args.reward]
    flags += ["--model-path", str(args.checkpoint), "--device", args.device, *extra]
    return flags, parse(["train", *flags])


def run_flags(flags: list[str], cfg, groups: int, rollouts: int, train: bool, out_dir: Path) -> list[str]:
    """One world's flags: its groups (the optimizer batch follows, the recipe's optimizer steps stay), rollouts,
    its own run folder."""
    r, o = cfg.rollout, cfg.optim
    samples = groups * r.n_samples_per_prompt
    if samples % o.num_steps_per_rollout:
        raise ValueError(f"--groups {groups}: {samples} samples do not split into --num-steps-per-rollout "
                         f"{o.num_steps_per_rollout} optimizer steps")
    out = [*flags, "--rollout-batch-size", str(groups), "--global-batch-size", str(samples // o.num_steps_per_rollout),
           "--num-rollout", str(max(rollouts, 1)), "--output-dir", str(out_dir)]
    return out if train else [*out, "--debug-rollout-only"]


def world_refusal(flags: list[str], n: int) -> str | None:
    """Why `diffrl train` refuses these flags at N ranks (the message names the flags), or None."""
    from diffrl.cli.main import parse
    from diffrl.train.parallel import Parallel
    from diffrl.train.trainer import validate_config, validate_parallel

    cfg = parse(["train", *flags])
    try:
        validate_config(cfg)
        if n > 1:
            validate_parallel(cfg, Parallel(rank=0, world_size=n))
    except ValueError as err:
        return str(err)
    return None


def main(argv: list[str] | None = None) -> dict:
    args, extra = parse_args(argv)
    if args.print_layouts:
        commands = layout_commands(str(args.checkpoint or "MODELS"))
        for recipe, command in commands.items():
            print(f"# {recipe}: {PUBLISHED_LAYOUTS[recipe].note}\n{command}")
        return {"commands": commands}
    began = time.time()
    stop_at = began + args.budget_s if args.budget_s else None
    flags, cfg = base_flags(args, extra)
    setup_s = time.time() - began
    n_per_group = cfg.rollout.n_samples_per_prompt
    cuts: list[str] = []
    if args.layout:
        layout = PUBLISHED_LAYOUTS[args.layout]
        gpus = [layout.ranks]
        groups = args.groups or layout.ranks  # one group per rank
        flags = [*flags, *layout_flags(layout)]
        train, rollouts = True, args.rollouts
        have = available_gpus(args.device)
        if have is not None and have < layout_gpus(layout):
            raise SystemExit(f"--layout {args.layout} needs {layout_gpus(layout)} GPUs; {have} here")
    else:
        have = available_gpus(args.device)
        gpus = sorted({n for n in args.gpus if have is None or n <= have}, reverse=True)
        dropped = sorted(set(args.gpus) - set(gpus))
        if dropped:
            cuts.append(f"world sizes {dropped}: {have} GPUs here")
        groups = args.groups or cfg.rollout.rollout_batch_size
        train, rollouts = args.train, args.rollouts
    if args.recipe and groups != cfg.rollout.rollout_batch_size:
        cuts.append(f"groups per rollout: the recipe's {cfg.rollout.rollout_batch_size} → {groups}")
    # With the update, NFT's training costs ~4× its rollout (BENCHMARKS.md: 66.7 s against 16.6 s).
    s_per_sample = args.prior_s_per_sample * (5 if train else 1)
    if args.budget_s and not args.layout:
        groups, rollouts, planned = plan(gpus, groups, rollouts, n_per_group, args.budget_s - setup_s, 0.0,
                                         args.prior_startup_s, s_per_sample)
        cuts += planned
    report = {"recipe": args.recipe, "layout": args.layout, "device": args.device, "groups": groups,
              "samples_per_group": n_per_group, "rollouts_per_world": rollouts,
              "step": "rollout + update" if train else "rollout only (--debug-rollout-only)",
              "cuts": cuts, "setup_s": setup_s, "worlds": [], "commands": {}}
    for line in cuts:
        print(f"cut: {line}", flush=True)

    def save() -> None:
        report["table"] = efficiency_rows(report["worlds"])
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=2))
        if args.md:
            args.md.write_text(markdown(report))

    per_world: dict[int, dict] = {}
    estimate_1 = None  # seconds per rollout at one GPU, an upper bound from the worlds measured so far
    for i, n in enumerate(gpus):
        out_dir = args.work_dir / f"world-{n}-{time.strftime('%H%M%S')}"
        world_flags = run_flags(flags, cfg, groups, rollouts, train, out_dir / "run")
        refusal = world_refusal(world_flags, n)
        if refusal:
            report["worlds"].append({"world_size": n, "skipped": f"refused: {refusal}"})
            print(f"world {n}: refused: {refusal}", flush=True)
            save()
            continue
        result_json = out_dir / "result.json"
        out_dir.mkdir(parents=True, exist_ok=True)
        worker_args = ["--json", str(result_json), "--rollouts", str(rollouts)]
        timeout = None
        if stop_at is not None:  # every world gets its first rollout; later ones only where time is left
            startup = max([w["load_s"] for w in per_world.values()] + [args.prior_startup_s])
            prior = estimate_1 if estimate_1 is not None else groups * n_per_group * s_per_sample
            need = startup + prior / n
            later = sum(startup + prior / m for m in gpus[i + 1:])
            left = stop_at - time.time()
            if need > left:
                report["worlds"].append({"world_size": n, "skipped": f"budget: needs ~{need:.0f} s, {left:.0f} s left"})
                print(f"world {n}: skipped, needs ~{need:.0f} s and {left:.0f} s are left", flush=True)
                save()
                continue
            worker_args += ["--stop-by", str(max(stop_at - later, time.time() + need))]
            timeout = max(need, left - later) + 60  # a backstop: the worker stops itself first (--stop-by)
        cmd = world_command(n, worker_args, world_flags, args.master_port)
        report["commands"][str(n)] = " ".join(cmd)
        print(f"== world {n} ({groups} groups × {n_per_group}, {rollouts} rollouts) {time.strftime('%T')}", flush=True)
        env = {**os.environ}
        env.pop("WORLD_SIZE", None)
        rc, log = run_world(cmd, env, timeout, out_dir / "log.txt")
        if rc != 0 or not result_json.exists():
            lines = [line for line in log.splitlines() if line.strip()]
            # The ranks' own errors first (torchrun's summary that ends the log names none).
            errors = [line for line in lines if "Error" in line and "ChildFailedError" not in line][:8]
            tail = "\n".join([*errors, "…", *lines[-12:]])
            report["worlds"].append({"world_size": n, "error": f"exit {rc}", "log_tail": tail})
            print(f"world {n}: exit {rc}\n{tail}", flush=True)
            save()
            continue
        result = json.loads(result_json.read_text())
        per_world[n] = result
        summary = summarize_world(result)
        if summary["seconds_per_rollout"]:
            estimate = summary["seconds_per_rollout"] * n  # ≥ one GPU's time when efficiency ≤ 1
            estimate_1 = estimate if estimate_1 is None else min(estimate_1, estimate)
        report["worlds"].append(summary)
        print(f"world {n}: {json.dumps(summary)}", flush=True)
        save()
    # Same samples whatever the world size: every world against the smallest measured.
    if per_world:
        smallest = min(per_world)
        for w in report["worlds"]:
            if w["world_size"] in per_world and w.get("seconds_per_rollout") is not None:
                w["same_samples"] = compare_samples(per_world[smallest]["samples"], per_world[w["world_size"]]["samples"])
        report["reference_world"] = smallest
        report["samples"] = {str(n): r["samples"] for n, r in per_world.items()}
        report["reward_curves"] = reward_curves(report["samples"])
        if train and len(per_world) > 1:  # with updates: do the curves of the largest and smallest agree
            report["curves_agreement"] = curves_agreement(report["reward_curves"], str(max(per_world)), str(smallest))
    report["elapsed_s"] = time.time() - began
    save()
    print(markdown(report), flush=True)
    return report


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        worker([a for a in sys.argv[1:] if a != "--worker"])
    else:
        main()
