"""Compare RL algorithms over `diffrl train` run folders, grouped by method across seeds.

    python benchmarks/algorithm_bench.py OUT_DIR RUN_DIR...

A RUN_DIR is a run folder (it holds metrics.jsonl) or a parent folder whose run folders are taken. The method
of a run is its folder's name less a trailing seed suffix `-s<digits>` (`nft-s0`, `nft-s1` → `nft`). Per run:
rollouts done, wall clock (the last `time/elapsed_s`: rollouts + training, evaluations excluded), held-out
strict accuracy at rollout 0, the best and the last over its evaluations, the final figure (the overall strict
accuracy of the sweep's final evaluation, `eval<N>-best/report.json`, else the last checkpoint's
`eval<N>-rollout-NNNNN/report.json`, else the last evaluation), the wall clock to reach 0.90 / 0.95 held-out
(the `time/elapsed_s` of the first evaluation at or above it, as scripts/summarize_runs.py counts it), the
background ΔE76 at rollout 0 and at the last evaluation, and the median seconds per rollout (rollout +
training). Per method: the mean and min–max over runs, and the median time to each level over the runs that
reached it with how many did.

Writes OUT_DIR/algorithms.json (everything), OUT_DIR/algorithms.md (one table row per method, best mean
final first, and the command line) and OUT_DIR/algorithms.png (held-out strict accuracy against wall clock,
one color per method and one line per run, seed 1 dashed; rollout reward against rollout).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # diffrl, when run as a script from anywhere
from diffrl.train.metrics import read_metrics  # noqa: E402

TARGETS = (0.90, 0.95)
SEED_SUFFIX = re.compile(r"-s(\d+)$")
EVAL_DIR = re.compile(r"^eval(\d+)-(best|rollout-(\d+))$")


def _key(target: float) -> str:
    return f"time_to_{target:.2f}_s"


def method_of(name: str) -> str:
    """The run folder's name less a final `-s<digits>`."""
    return SEED_SUFFIX.sub("", name)


def final_reports(path: Path) -> dict[str, float]:
    """Every final evaluation's overall strict accuracy, by report (relative to the run folder), in the order
    the final figure is taken: the checkpoint the run selects by validation and ships (`eval<N>-best`) before
    its last one (`eval<N>-rollout-<highest>`), the most images per category first."""
    found = []
    for report in path.glob("eval*/report.json"):
        match = EVAL_DIR.match(report.parent.name)
        if not match:
            continue
        try:
            strict = json.loads(report.read_text()).get("overall_strict")
        except (OSError, ValueError):
            continue
        if isinstance(strict, (int, float)):
            images, which, rollout = match.groups()
            found.append(((int(images), which == "best", int(rollout or -1)), float(strict), report))
    found.sort(key=lambda f: f[0], reverse=True)
    return {str(report.relative_to(path)): strict for _, strict, report in found}


def load_run(path) -> dict:
    """One run folder's figures (see the module docstring), its evaluations as [rollout, elapsed s, strict]
    and its rollout rewards as [rollout, raw mean]."""
    path = Path(path)
    records, _ = read_metrics(path / "metrics.jsonl")
    config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
    flags = config.get("flags", config)  # config.json is {tree, flags, …} (flat before)
    seed = flags.get("seed")
    if seed is None and SEED_SUFFIX.search(path.name):
        seed = int(SEED_SUFFIX.search(path.name).group(1))
    evals = [r for r in records if "eval/strict" in r]
    trained = [r for r in records if "rollout/seconds" in r or "rollout/reward/raw_mean" in r]
    elapsed = [r["time/elapsed_s"] for r in records if "time/elapsed_s" in r]
    per_rollout = [r["rollout/seconds"] + r.get("train/seconds", 0.0) for r in records if "rollout/seconds" in r]
    start = next((r for r in records if r["rollout"] == 0 and "eval/strict" in r), None)
    strict = [r["eval/strict"] for r in evals]
    reports = final_reports(path)
    final, source = next(((value, report) for report, value in reports.items()), (None, None))
    run = {
        "name": path.name,
        "path": str(path),
        "method": method_of(path.name),
        "loss_type": flags.get("loss_type"),
        "seed": seed,
        "rollouts": max((r["rollout"] for r in trained), default=0),
        "wall_clock_s": elapsed[-1] if elapsed else 0.0,
        "strict_start": start["eval/strict"] if start else None,
        "strict_best": max(strict) if strict else None,
        "strict_best_rollout": max(evals, key=lambda r: r["eval/strict"])["rollout"] if evals else None,
        "strict_last": strict[-1] if strict else None,
        "strict_last_rollout": evals[-1]["rollout"] if evals else None,
        "strict_final": final if final is not None else (strict[-1] if strict else None),
        "final_source": source or ("metrics.jsonl (last evaluation)" if strict else None),
        "final_reports": reports,
    }
    for target in TARGETS:
        hit = next((r for r in evals if r["eval/strict"] >= target), None)
        run[_key(target)] = hit.get("time/elapsed_s", 0.0) if hit else None
        run[f"rollout_to_{target:.2f}"] = hit["rollout"] if hit else None
    run["background_delta_e_start"] = start.get("eval/background_delta_e") if start else None
    run["background_delta_e_last"] = evals[-1].get("eval/background_delta_e") if evals else None
    run["seconds_per_rollout"] = statistics.median(per_rollout) if per_rollout else None
    run["evaluations"] = [[r["rollout"], r.get("time/elapsed_s", 0.0), r["eval/strict"]] for r in evals]
    run["rewards"] = [[r["rollout"], r["rollout/reward/raw_mean"]] for r in records if "rollout/reward/raw_mean" in r]
    return run


def _spread(values: list) -> dict:
    values = [v for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values)}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(runs: list[dict]) -> dict:
    """Runs (load_run's) grouped by method, with each method's figures over its runs. Methods are ordered by
    mean final accuracy, best first (methods without one last)."""
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        grouped.setdefault(run["method"], []).append(run)
    methods = {}
    for name, members in grouped.items():
        members = sorted(members, key=lambda r: (r["seed"] is None, r["seed"] if isinstance(r["seed"], int) else 0,
                                                 r["name"]))
        losses = sorted({str(r["loss_type"]) for r in members if r["loss_type"] is not None})
        method = {
            "loss_type": "/".join(losses) or None,
            "n_runs": len(members),
            "seeds": [r["seed"] for r in members],
            "strict_start": _mean([r["strict_start"] for r in members]),
            "strict_best": _spread([r["strict_best"] for r in members]),
            "strict_last": _spread([r["strict_last"] for r in members]),
            "strict_final": _spread([r["strict_final"] for r in members]),
        }
        for target in TARGETS:
            reached = [r[_key(target)] for r in members if r[_key(target)] is not None]
            method[f"{_key(target)}_median"] = statistics.median(reached) if reached else None
            method[f"reached_{target:.2f}"] = len(reached)
        method["background_delta_e_start"] = _mean([r["background_delta_e_start"] for r in members])
        method["background_delta_e_last"] = _mean([r["background_delta_e_last"] for r in members])
        method["seconds_per_rollout"] = _mean([r["seconds_per_rollout"] for r in members])
        method["runs"] = members
        methods[name] = method
    order = sorted(methods, key=lambda m: (methods[m]["strict_final"]["mean"] is None,
                                           -(methods[m]["strict_final"]["mean"] or 0.0), m))
    return {"targets": list(TARGETS), "methods": {m: methods[m] for m in order}}


def _num(value, digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _range(spread: dict) -> str:
    if spread["mean"] is None:
        return "–"
    return f"{spread['mean']:.3f} ({spread['min']:.3f}–{spread['max']:.3f})"


def markdown(summary: dict, command: str) -> str:
    """One table row per method, in the summary's order (best mean final first), and the command under it."""
    head = ["method", "loss type", "runs (seeds)", "held-out strict at start", "best (mean, min–max)",
            "last / final (mean, min–max)"]
    head += [f"time to {t:.2f} s (median, k/n reached)" for t in TARGETS]
    head += ["background ΔE start → last (mean)", "s per rollout"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, m in summary["methods"].items():
        seeds = ", ".join("?" if s is None else str(s) for s in m["seeds"])
        times = [f"{_num(m[f'{_key(t)}_median'], 0)} ({m[f'reached_{t:.2f}']}/{m['n_runs']})" for t in TARGETS]
        row = [name, str(m["loss_type"] or "–"), f"{m['n_runs']} ({seeds})", _num(m["strict_start"], 3),
               _range(m["strict_best"]), f"{_range(m['strict_last'])} / {_range(m['strict_final'])}", *times,
               f"{_num(m['background_delta_e_start'], 2)} → {_num(m['background_delta_e_last'], 2)}",
               _num(m["seconds_per_rollout"], 0)]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", f"Made by: `{command}`", ""]
    return "\n".join(lines)


LINESTYLES = {0: "-", 1: "--", 2: "-.", 3: ":"}


def plot(summary_runs: dict, path) -> None:
    """summary_runs: method → its runs (load_run's). Left: held-out strict accuracy against wall clock in
    minutes, one color per method, one line per run (by seed: 0 solid, 1 dashed, 2 dash-dot), the 0.90 and 0.95
    levels dotted; right: rollout reward (raw mean) against rollout."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.4))
    colors = plt.get_cmap("tab20").colors  # distinct colors for up to 20 methods
    lowest = 1.0
    for i, (method, runs) in enumerate(summary_runs.items()):
        color = colors[i % len(colors)]
        for j, run in enumerate(runs):
            style = LINESTYLES.get(run["seed"], "-") if isinstance(run["seed"], int) else "-"
            label = method if j == 0 else None
            if run["evaluations"]:
                minutes = [t / 60 for _, t, _ in run["evaluations"]]
                strict = [s for _, _, s in run["evaluations"]]
                lowest = min(lowest, *strict)
                left.plot(minutes, strict, marker="o", ms=3, ls=style, color=color, label=label)
            if run["rewards"]:
                right.plot(*zip(*run["rewards"]), ls=style, color=color, alpha=0.8, label=label)
    for level in TARGETS:
        left.axhline(level, color="gray", ls=":", lw=1)
    bottom = 0.0 if lowest < 0.5 else round(lowest - 0.05, 1)  # scripts/plot_runs.py's rule
    left.set(xlabel="wall clock, rollouts + training (minutes)", ylabel="held-out strict accuracy", ylim=(bottom, 1))
    right.set(xlabel="rollout", ylabel="rollout reward (raw mean)")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="lower right", title="method (seed 1 dashed, 2 dash-dot)", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_folders(paths: list[str]) -> list[Path]:
    """The run folders among the arguments: a folder holding metrics.jsonl, or the ones a parent holds."""
    found = []
    for arg in paths:
        path = Path(arg)
        if (path / "metrics.jsonl").is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.iterdir() if (p / "metrics.jsonl").is_file())
        else:
            raise SystemExit(f"{arg}: not a folder")
    unique = list({p.resolve(): p for p in reversed(found)}.values())[::-1]  # each once, as named (no absolute paths)
    if not unique:
        raise SystemExit("no run folder (one holding metrics.jsonl) among " + " ".join(paths))
    return unique


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="where algorithms.json, algorithms.md and algorithms.png go")
    parser.add_argument("run_dirs", nargs="+", help="run folders, or folders holding run folders")
    args = parser.parse_args(argv)
    runs = [load_run(p) for p in run_folders(args.run_dirs)]
    summary = summarize(runs)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stored = {"targets": summary["targets"], "methods": {
        name: {**m, "runs": [{k: v for k, v in r.items() if k != "rewards"} for r in m["runs"]]}
        for name, m in summary["methods"].items()}}
    (out / "algorithms.json").write_text(json.dumps(stored, indent=2) + "\n")
    command = shlex.join(["python", "benchmarks/algorithm_bench.py", *argv])
    (out / "algorithms.md").write_text(markdown(summary, command))
    plot({name: m["runs"] for name, m in summary["methods"].items()}, out / "algorithms.png")
    print(markdown(summary, command))
    return summary


if __name__ == "__main__":
    main()
