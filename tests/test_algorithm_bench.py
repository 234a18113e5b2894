"""benchmarks/algorithm_bench.py: runs grouped by method over seeds, their figures, table and plot."""

import json

import pytest
from benchmark_scripts import load_benchmark


def _run(root, name, loss_type, seed, evals, rewards, delta_e=None, report=None):
    """A fake run folder: evals [(rollout, elapsed s, strict)], the first at rollout 0; rewards by rollout 1…;
    delta_e {rollout: ΔE}; report: an eval128-best/report.json overall strict accuracy."""
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"tree": {}, "flags": {"loss_type": loss_type, "seed": seed}}))
    by_rollout = {rollout: (t, strict) for rollout, t, strict in evals}
    delta_e = delta_e or {}
    records = [{"rollout": 0, "eval/strict": by_rollout[0][1], "val/strict": 0.5,
                **({"eval/background_delta_e": delta_e[0]} if 0 in delta_e else {})}]
    for rollout, reward in enumerate(rewards, 1):
        record = {"rollout": rollout, "rollout/reward/raw_mean": reward, "rollout/seconds": 2.0 + rollout,
                  "train/seconds": 1.0, "time/elapsed_s": 10.0 * rollout}
        if rollout in by_rollout:
            record["time/elapsed_s"], record["eval/strict"] = by_rollout[rollout]
            if rollout in delta_e:
                record["eval/background_delta_e"] = delta_e[rollout]
        records.append(record)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if report is not None:
        (path / "eval128-best").mkdir()
        (path / "eval128-best" / "report.json").write_text(json.dumps({"categories": {}, "overall_strict": report}))
    return path


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    root.mkdir()
    # nft, seed 0: 0.90 at rollout 2 (20 s), 0.95 at rollout 4 (40 s); a final report.
    _run(root, "nft-s0", "nft", 0, [(0, None, 0.80), (2, 20.0, 0.91), (4, 40.0, 0.96), (6, 60.0, 0.94)],
         [0.5, 0.6, 0.7, 0.8, 0.85, 0.9], delta_e={0: 1.0, 6: 3.0}, report=0.955)
    # nft, seed 1: 0.90 at rollout 4 (40 s), never 0.95; no report (final = last evaluation).
    _run(root, "nft-s1", "nft", 1, [(0, None, 0.80), (2, 20.0, 0.85), (4, 40.0, 0.92), (6, 60.0, 0.93)],
         [0.5, 0.55, 0.6, 0.7, 0.75, 0.8], delta_e={0: 1.0, 6: 5.0})
    # grpo: never 0.90.
    _run(root, "grpo-guard-s0", "flow_grpo", 0, [(0, None, 0.82), (3, 30.0, 0.86), (6, 60.0, 0.88)],
         [0.5, 0.52, 0.55, 0.56, 0.58, 0.6])
    return root


def test_figures_grouping_table_and_plot(runs, tmp_path, monkeypatch):
    bench = load_benchmark("algorithm_bench", monkeypatch)
    out = tmp_path / "out"
    # One run folder named directly, the others through their parent (the same run twice counts once).
    bench.main([str(out), str(runs / "nft-s0"), str(runs)])
    summary = json.loads((out / "algorithms.json").read_text())["methods"]
    assert list(summary) == ["nft", "grpo-guard"]  # -s0/-s1 into one method, best mean final first

    nft = summary["nft"]
    assert nft["loss_type"] == "nft" and nft["n_runs"] == 2 and nft["seeds"] == [0, 1]
    s0, s1 = nft["runs"]
    assert (s0["name"], s1["name"]) == ("nft-s0", "nft-s1")
    assert s0["rollouts"] == 6 and s0["wall_clock_s"] == 60.0
    assert s0["strict_start"] == 0.80
    assert s0["strict_best"] == 0.96 and s0["strict_best_rollout"] == 4
    assert s0["strict_last"] == 0.94
    assert s0["strict_final"] == 0.955 and s0["final_source"] == "eval128-best/report.json"
    assert s1["strict_final"] == 0.93  # no report: the last evaluation
    assert s0["time_to_0.90_s"] == 20.0 and s0["time_to_0.95_s"] == 40.0
    assert s1["time_to_0.90_s"] == 40.0 and s1["time_to_0.95_s"] is None
    assert s0["background_delta_e_start"] == 1.0 and s0["background_delta_e_last"] == 3.0
    assert s0["seconds_per_rollout"] == pytest.approx(6.5)  # median of (2 + k) + 1 over k = 1…6
    assert "rewards" not in s0

    assert nft["strict_best"] == pytest.approx({"mean": 0.945, "min": 0.93, "max": 0.96})
    assert nft["strict_last"] == pytest.approx({"mean": 0.935, "min": 0.93, "max": 0.94})
    assert nft["strict_final"] == pytest.approx({"mean": 0.9425, "min": 0.93, "max": 0.955})
    assert nft["time_to_0.90_s_median"] == 30.0 and nft["reached_0.90"] == 2
    assert nft["time_to_0.95_s_median"] == 40.0 and nft["reached_0.95"] == 1
    assert nft["background_delta_e_start"] == 1.0 and nft["background_delta_e_last"] == 4.0

    grpo = summary["grpo-guard"]
    assert grpo["loss_type"] == "flow_grpo" and grpo["n_runs"] == 1
    assert grpo["strict_final"]["mean"] == 0.88
    assert grpo["time_to_0.90_s_median"] is None and grpo["reached_0.90"] == 0
    assert grpo["background_delta_e_start"] is None

    table = (out / "algorithms.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| method")]
    assert [row.split(" | ")[0] for row in rows] == ["| nft", "| grpo-guard"]
    assert "0.945 (0.930–0.960)" in rows[0]  # best
    assert "0.935 (0.930–0.940) / 0.943 (0.930–0.955)" in rows[0]  # last / final
    assert "30 (2/2)" in rows[0] and "40 (1/2)" in rows[0]
    assert "1.00 → 4.00" in rows[0]
    assert "– (0/1)" in rows[1] and "– → –" in rows[1]
    assert f"python benchmarks/algorithm_bench.py {out}" in table
    assert (out / "algorithms.png").stat().st_size > 0


def test_method_label_strips_only_a_final_seed_suffix(monkeypatch):
    bench = load_benchmark("algorithm_bench", monkeypatch)
    assert bench.method_of("grpo-guard-s1") == "grpo-guard"
    assert bench.method_of("dance-s12") == "dance"
    assert bench.method_of("nft-stage4-seed1-2026-12-03") == "nft-stage4-seed1-2026-12-03"
    assert bench.method_of("nft-s0-long") == "nft-s0-long"
