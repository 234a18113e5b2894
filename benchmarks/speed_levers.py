"""The speed levers of SD3.5-M's Flow-GRPO loop, one configuration at a time: what each costs and what it
keeps of on-policy exactness. `scripts/device/speed_levers.sh` runs the configurations; this file names them
and reads their results.

    python benchmarks/speed_levers.py flags train cudnn --dir runs/speed-levers   # a configuration's flags
    python benchmarks/speed_levers.py flags train combo --dir runs/speed-levers   # the best combination so far
    python benchmarks/speed_levers.py table --dir runs/speed-levers [--out table.md]
    python benchmarks/speed_levers.py sdpa                                        # the kernel `auto` picks here

Training configurations run `diffrl bench-train --recipe sd3-grpo --compile` plus their flags, each in
`DIR/train-NAME/` (its metrics.jsonl and config.json; `DIR/train-NAME.rc`: the command's exit status);
engine configurations run `benchmarks/family_rollout.py --compile` plus theirs, into `DIR/engine-NAME.json`
(`.rc` beside). `table` reads them all: per training run, from its metrics.jsonl, the steady state (median of
the rollouts after the first, as `diffrl bench-train` reports it): seconds per rollout image (reward
included), ms per train pair, seconds per sample (its rollout and its trained steps), peak GPU memory, and
the first pass's mean |Δ log p| rollout vs trainer and clipped share; per engine run the seconds per image
of a group of 16 at each microgroup size, the transformer's step, the decode, and diffusers' pipeline
(measured in the base run only: the levers change the transformer the pipeline would share).

`combo` is every lever that made a sample (train) or an image (engine) at least `MIN_GAIN` cheaper than
`base` without more than doubling the first pass's |Δ log p| (train), the best of each exclusive group
(one attention kernel, one compile mode, one decode batch, one micro-batch shape).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIN_GAIN = 0.02  # a lever joins the combination when it saves at least 2% over base


@dataclass(frozen=True)
class Lever:
    flags: tuple[str, ...]
    group: str  # levers of one group exclude each other (the combination takes the best)
    note: str = ""


# On top of `--compile` (the 2026-12-01 measurement's baseline, BENCHMARKS.md). `base` is that baseline.
TRAIN = {
    "base": Lever((), "base", "--compile (eager numerics on), the recipe's settings"),
    "autotune": Lever(("--compile-mode", "max-autotune-no-cudagraphs"), "compile", "GEMM autotuning (long compile)"),
    "flash": Lever(("--attention-backend", "flash"), "attention", "FlashAttention-2 kernel"),
    "cudnn": Lever(("--attention-backend", "cudnn"), "attention", "cuDNN attention"),
    "efficient": Lever(("--attention-backend", "efficient"), "attention", "memory-efficient kernel"),
    "fuse-qkv": Lever(("--fuse-qkv",), "fuse", "q/k/v as one matmul where LoRA allows (SD3.5-M: 13 of 61 streams)"),
    "vae-all": Lever(("--vae-decode-batch", "0"), "decode", "the whole batch in one VAE call"),
    "mb16": Lever(("--micro-batch-size", "16"), "batch", "16 pairs (32 rows with CFG) per forward/backward"),
    "mb32-gc": Lever(("--micro-batch-size", "32", "--gradient-checkpointing"), "batch",
                     "32 pairs per forward/backward, activations recomputed"),
    "no-eager-numerics": Lever(("--no-compile-eager-numerics",), "numerics", "inductor's own bf16 roundings"),
    "float8": Lever(("--float8",), "precision", "the blocks' linear layers in FP8 (rowwise), rollout and training"),
}
ENGINE = {
    "base": Lever((), "base", "--compile; diffusers' pipeline in the same run"),
    "flash": Lever(("--attention-backend", "flash"), "attention", "FlashAttention-2 kernel"),
    "cudnn": Lever(("--attention-backend", "cudnn"), "attention", "cuDNN attention"),
    "efficient": Lever(("--attention-backend", "efficient"), "attention", "memory-efficient kernel"),
    "fuse-qkv": Lever(("--fuse-qkv",), "fuse", "q/k/v as one matmul (no LoRA here: every stream)"),
    "vae-all": Lever(("--vae-decode-batch", "0"), "decode", "16 images in one VAE call, as the pipeline"),
    "vae-4": Lever(("--vae-decode-batch", "4"), "decode", "4 images per VAE call"),
    "float8": Lever(("--float8",), "precision", "the blocks' linear layers in FP8 (rowwise)"),
}
LEVERS = {"train": TRAIN, "engine": ENGINE}
# The engine levers' runs leave the pipeline out: it would run on the changed transformer.
ENGINE_LEVER_FLAGS = ("--no-pipeline",)


# ---------------------------------------------------------------------------------------------- reading results
def _rc(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def train_result(run: Path) -> dict:
    """A training run's costs from its metrics.jsonl (`diffrl.cli.bench_train.training_table`: the first
    rollout and the median of the later ones) and its status."""
    from diffrl.cli.bench_train import training_table
    from diffrl.train.metrics import read_metrics

    result = {"name": run.name.removeprefix("train-"), "rc": _rc(run.with_name(run.name + ".rc"))}
    metrics = run / "metrics.jsonl"
    records = read_metrics(metrics)[0] if metrics.exists() else []
    try:
        table = training_table(records)
    except ValueError:
        return {**result, "steady": None, "first": None}
    return {**result, "steady": table["steady"] or table["first"], "first": table["first"],
            "steady_rollouts": table["steady_rollouts"]}


def engine_result(path: Path) -> dict:
    result = {"name": path.stem.removeprefix("engine-"), "rc": _rc(path.with_suffix(".rc"))}
    if not path.exists():
        return {**result, "bench": None}
    return {**result, "bench": json.loads(path.read_text())}


def results(directory: Path, kind: str) -> dict[str, dict]:
    """name → result for every configuration of `kind` that ran (or was started) under `directory`."""
    found = {}
    if kind == "train":
        for run in sorted(p for p in directory.glob("train-*") if p.is_dir()):
            found[run.name.removeprefix("train-")] = train_result(run)
        for rc in sorted(directory.glob("train-*.rc")):
            name = rc.stem.removeprefix("train-")
            found.setdefault(name, {"name": name, "rc": _rc(rc), "steady": None, "first": None})
    else:
        for path in sorted(directory.glob("engine-*.json")):
            found[path.stem.removeprefix("engine-")] = engine_result(path)
        for rc in sorted(directory.glob("engine-*.rc")):
            name = rc.stem.removeprefix("engine-")
            found.setdefault(name, {"name": name, "rc": _rc(rc), "bench": None})
    return found


def _engine_cost(bench: dict | None) -> float | None:
    """Seconds per image of the engine's best microgroup size."""
    if not bench or not bench.get("engine"):
        return None
    return min(r["s_per_image"] for r in bench["engine"].values())


def _train_cost(result: dict) -> float | None:
    steady = result.get("steady")
    return None if not steady else steady.get("sample_s")


# ---------------------------------------------------------------------------------------------- the combination
def combination(directory: Path, kind: str) -> tuple[list[str], list[str]]:
    """(flags, reasons): the levers of `kind` measured under `directory` that beat base by MIN_GAIN (train: with
    at most twice base's first-pass |Δ log p|), the best of each group."""
    found, levers = results(directory, kind), LEVERS[kind]
    cost = _train_cost if kind == "train" else (lambda r: _engine_cost(r.get("bench")))
    base = found.get("base")
    base_cost = cost(base) if base else None
    if base_cost is None:
        return [], ["no base result under " + str(directory) + ": the combination needs the levers measured first"]
    base_diff = (base["steady"] or {}).get("first_pass_log_prob_abs_diff") if kind == "train" else None
    best: dict[str, tuple[float, str]] = {}
    reasons = []
    for name, result in found.items():
        if name in ("base", "combo") or name not in levers:
            continue
        value = cost(result)
        if value is None:
            reasons.append(f"{name}: no result (rc {result.get('rc')})")
            continue
        change = value / base_cost - 1  # the cost's change: negative is faster
        if change > -MIN_GAIN:
            reasons.append(f"{name}: {change:+.1%} against base, left out")
            continue
        diff = (result["steady"] or {}).get("first_pass_log_prob_abs_diff") if kind == "train" else None
        if base_diff is not None and diff is not None and diff > 2 * base_diff + 1e-7:
            reasons.append(f"{name}: {change:+.1%} but first-pass |Δ log p| {diff:.2g} against base's {base_diff:.2g}, "
                           "left out")
            continue
        group = levers[name].group
        if group not in best or value < best[group][0]:
            best[group] = (value, name)
        reasons.append(f"{name}: {change:+.1%} against base")
    chosen = sorted(name for _, name in best.values())
    flags = [flag for name in chosen for flag in levers[name].flags]
    reasons.append("combination: " + (", ".join(chosen) if chosen else "none (no lever beat base)"))
    return flags, reasons


def flags_of(kind: str, name: str, directory: Path) -> list[str]:
    """The flags of configuration `name` (besides the command's own, --compile included)."""
    if name == "combo":
        flags, reasons = combination(directory, kind)
        for line in reasons:
            print(line, file=sys.stderr)
    elif name in LEVERS[kind]:
        flags = list(LEVERS[kind][name].flags)
    else:
        raise SystemExit(f"unknown {kind} configuration {name!r}; expected one of {', '.join(LEVERS[kind])}, combo")
    if kind == "engine" and name != "base":
        flags += ENGINE_LEVER_FLAGS
    return flags


# ---------------------------------------------------------------------------------------------- the tables
def _f(value, fmt: str, missing: str = "–") -> str:
    return missing if value is None else format(value, fmt)


def _status(rc: int | None) -> str:
    if rc is None:
        return "not run"
    return {0: "", 124: "timed out", 137: "killed"}.get(rc, f"failed (rc {rc})")


def train_table(found: dict[str, dict], combo_flags: list[str] | None = None) -> str:
    lines = ["| config | flags beside --compile | rollout image s | train pair ms | sample s | vs base | peak GiB | "
             "first-pass \\|Δ log p\\| | first-pass clipfrac | first rollout s (compile) | rollouts (steady) | status |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    base = _train_cost(found["base"]) if "base" in found else None
    for name, result in _ordered(found, TRAIN):
        steady, first = result.get("steady") or {}, result.get("first") or {}
        cost = steady.get("sample_s")
        versus = "" if name == "base" or cost is None or base is None else f"{cost / base - 1:+.1%}"
        flags = " ".join(TRAIN[name].flags if name in TRAIN else combo_flags or [])
        first_s = None if first.get("sample_s") is None else first["sample_s"] * first["samples"]
        lines.append(f"| {name} | {flags or '–'} | {_f(steady.get('rollout_image_s'), '.3f')} | "
                     f"{_f(steady.get('train_pair_ms'), '.1f')} | {_f(cost, '.3f')} | {versus} | "
                     f"{_f(steady.get('peak_gib'), '.1f')} | {_f(steady.get('first_pass_log_prob_abs_diff'), '.2g')} | "
                     f"{_f(steady.get('first_pass_clipfrac'), '.3f')} | {_f(first_s, '.0f')} | {_steady_span(result)} | "
                     f"{_status(result.get('rc'))} |")
    return "\n".join(lines)


def engine_table(found: dict[str, dict], combo_flags: list[str] | None = None) -> str:
    lines = ["| config | flags beside --compile | engine s/image (M: s) | vs base | transformer ms/sample-step "
             "(batch n) | decode ms/image | peak GiB | pipeline s/image (n per call) | status |",
             "|---|---|---|---|---|---|---|---|---|"]
    base = _engine_cost(found["base"].get("bench")) if "base" in found else None
    for name, result in _ordered(found, ENGINE):
        bench = result.get("bench") or {}
        engine = bench.get("engine") or {}
        per_m = ", ".join(f"{m}: {r['s_per_image']:.3f}" for m, r in engine.items()) or "–"
        cost = _engine_cost(bench)
        versus = "" if name == "base" or cost is None or base is None else f"{cost / base - 1:+.1%}"
        step = (bench.get("transformer") or {}).get(str(bench.get("n", 16))) or {}
        decode = (bench.get("decode_ms_per_image") or {}).get("family_decode")
        peak = max((r.get("peak_gib") or 0 for r in engine.values()), default=None) or None
        pipeline = ((bench.get("pipeline") or {}).get(str(bench.get("n", 16))) or {}).get("s_per_image")
        flags = " ".join(ENGINE[name].flags if name in ENGINE else combo_flags or [])
        lines.append(f"| {name} | {flags or '–'} | {per_m} | {versus} | {_f(step.get('ms_per_sample_step'), '.2f')} | "
                     f"{_f(decode, '.1f')} | {_f(peak, '.1f')} | {_f(pipeline, '.3f')} | {_status(result.get('rc'))} |")
    return "\n".join(lines)


def _ordered(found: dict, levers: dict):
    order = list(levers) + ["combo"]
    return sorted(found.items(), key=lambda item: order.index(item[0]) if item[0] in order else len(order))


def _steady_span(result: dict) -> str:
    rollouts = result.get("steady_rollouts") or []
    if not rollouts:
        return "first only" if result.get("first") else "–"
    return str(rollouts[0]) if len(rollouts) == 1 else f"{rollouts[0]}–{rollouts[-1]}"


def report(directory: Path) -> str:
    """Both tables for what ran under `directory`; a `combo` row shows the flags its run was given
    (`KIND-combo.flags`, else the combination the directory's results give now)."""
    parts = []
    for kind, title, table in (
            ("train", "Training loop, `diffrl bench-train --recipe sd3-grpo --compile` + flags (steady state: median of "
                      "the rollouts after the first):", train_table),
            ("engine", "Engine alone, `benchmarks/family_rollout.py --compile` + flags (a group of 16; median of the "
                       "repeats):", engine_table)):
        found = results(directory, kind)
        if not found:
            continue
        combo_flags, reasons = combination(directory, kind) if "combo" in found else (None, [])
        used = directory / f"{kind}-combo.flags"  # what the combo run was given (the script writes it)
        if used.exists():
            combo_flags = [f for f in used.read_text().split() if f not in ENGINE_LEVER_FLAGS]
            reasons.append("the combo run had: " + (" ".join(combo_flags) or "no flag beside --compile"))
        parts += [title, "", table(found, combo_flags), ""]
        if reasons:
            parts += ["combo: " + "; ".join(reasons), ""]
    return "\n".join(parts) if parts else f"no results under {directory}"


# ---------------------------------------------------------------------------------------------- the SDPA choice
def sdpa_choice(batch: int = 32, tokens: int = 1024 + 333, heads: int = 24, head_dim: int = 64) -> dict:
    """Which SDPA kernel torch picks for SD3.5-M's joint attention at 512² (bf16, no mask) on this device, and
    which kernels can run it at all."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (torch.randn(batch, heads, tokens, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    chosen = SDPBackend(torch._fused_sdp_choice(q, k, v)).name
    usable = {}
    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):
        try:
            with sdpa_kernel([backend]):
                torch.nn.functional.scaled_dot_product_attention(q[:1], k[:1], v[:1])
            usable[backend.name] = True
        except RuntimeError:
            usable[backend.name] = False
    return {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
            "auto_picks": chosen, "usable": usable}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    flags = sub.add_parser("flags", help="a configuration's flags, one per line")
    flags.add_argument("kind", choices=sorted(LEVERS))
    flags.add_argument("name")
    flags.add_argument("--dir", type=Path, default=Path("runs/speed-levers"))
    table = sub.add_parser("table", help="the results under --dir as markdown tables")
    table.add_argument("--dir", type=Path, default=Path("runs/speed-levers"))
    table.add_argument("--out", type=Path, default=None)
    sub.add_parser("sdpa", help="the SDPA kernel torch picks for SD3.5-M's attention here")
    args = parser.parse_args(argv)
    if args.command == "flags":
        for flag in flags_of(args.kind, args.name, args.dir):
            print(flag)
    elif args.command == "table":
        text = report(args.dir)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
    else:
        print(json.dumps(sdpa_choice()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
