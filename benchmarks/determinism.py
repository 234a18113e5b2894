"""The cost of determinism: one training command run twice with --deterministic-mode and once without.

    python benchmarks/determinism.py --name demo --work-dir runs/determinism --out det_demo.json \
        -- --recipe shapes-nft-gpu --num-rollout 5
    python benchmarks/determinism.py --table det_demo.json det_sd35m.json

Each run is its own process (`python -m diffrl.cli.main train FLAGS --output-dir …`). The two deterministic
runs are compared bit for bit (`diffrl.utils.determinism.compare_runs`: metrics.jsonl without its wall-clock
fields, and every tensor of the last checkpoint); the plain run gives the cost: seconds per rollout (rollout +
training, steady state: the first rollout, which holds warm-up, is left out), deterministic over plain.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from diffrl.utils.determinism import compare_runs


def run(flags: list[str], folder: Path) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "diffrl.cli.main", "train", *flags, "--output-dir", str(folder)],
                          check=False, capture_output=True, text=True)
    wall = time.perf_counter() - start
    log = (done.stdout + done.stderr).replace("\r", "\n")
    (folder.parent / f"{folder.name}.log").write_text(log)
    result = {"folder": str(folder), "exit_code": done.returncode, "wall_s": round(wall, 1)}
    if done.returncode != 0:
        result["error_tail"] = [line for line in log.splitlines() if line.strip()][-15:]
        return result
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r for r in records if r.get("rollout", 0) >= 2 and "rollout/seconds" in r] or \
             [r for r in records if "rollout/seconds" in r]
    mean = lambda key: sum(r.get(key, 0.0) for r in steady) / max(1, len(steady))
    result.update(rollouts_timed=len(steady), rollout_s=mean("rollout/seconds"), train_s=mean("train/seconds"),
                  s_per_rollout=mean("rollout/seconds") + mean("train/seconds"),
                  final_reward=records[-1].get("rollout/reward/raw_mean"), final_loss=records[-1].get("train/loss"))
    return result


def measure(name: str, flags: list[str], work: Path) -> dict:
    runs = {tag: run([*flags, *(["--deterministic-mode"] if tag != "plain" else [])], work / f"{name}-{tag}")
            for tag in ("deterministic-1", "deterministic-2", "plain")}
    out = {"name": name, "flags": flags, "runs": runs}
    a, b, plain = (Path(runs[t]["folder"]) for t in ("deterministic-1", "deterministic-2", "plain"))
    if runs["deterministic-1"]["exit_code"] == 0 and runs["deterministic-2"]["exit_code"] == 0:
        same = compare_runs(a, b)
        for key in ("metric_differences", "tensor_differences"):  # the first ones say enough
            same[f"{key}_count"] = len(same[key])
            same[key] = same[key][:20]
        out["deterministic_vs_deterministic"] = same
        out["bit_identical"] = same["metrics_identical"] and same["weights_identical"]
        if runs["plain"]["exit_code"] == 0:
            vs_plain = compare_runs(a, plain)
            out["deterministic_vs_plain_identical"] = vs_plain["metrics_identical"] and vs_plain["weights_identical"]
            out["cost_ratio"] = runs["deterministic-1"]["s_per_rollout"] / runs["plain"]["s_per_rollout"]
    return out


def table(results: list[dict]) -> str:
    lines = ["| run | bit-identical (metrics, weights) | s/rollout deterministic (1, 2) | s/rollout plain | cost |",
             "|---|---|---|---|---|"]
    for r in results:
        runs, same = r["runs"], r.get("deterministic_vs_deterministic", {})
        s = {t: runs[t].get("s_per_rollout") for t in runs}
        fmt = lambda v: "failed" if v is None else f"{v:.2f}"
        cost = f"{r['cost_ratio']:.2f}×" if "cost_ratio" in r else "—"
        lines.append(f"| {r['name']} | {same.get('metrics_identical', '—')}, {same.get('weights_identical', '—')} "
                     f"({same.get('tensors_compared', 0)} tensors) | {fmt(s['deterministic-1'])}, "
                     f"{fmt(s['deterministic-2'])} | {fmt(s['plain'])} | {cost} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="run")
    parser.add_argument("--work-dir", type=Path, default=Path("runs/determinism"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--table", nargs="+", type=Path, help="print the table of these result files and exit")
    parser.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the `diffrl train` flags")
    args = parser.parse_args()
    if args.table:
        print(table([json.loads(p.read_text()) for p in args.table if p.exists()]))
        return
    flags = args.flags[1:] if args.flags[:1] == ["--"] else args.flags
    result = measure(args.name, flags, args.work_dir)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(table([result]))
    for tag, r in result["runs"].items():
        if r["exit_code"]:
            print(f"{args.name} {tag} failed ({r['exit_code']}):", *r["error_tail"], sep="\n  ")
    same = result.get("deterministic_vs_deterministic", {})
    for line in same.get("metric_differences", [])[:5] + same.get("tensor_differences", [])[:5]:
        print(f"  differs: {line}")


if __name__ == "__main__":
    main()
