"""benchmarks/recipe_runs.py on the video recipes at tiny size on CPU (`--tiny`: the family's tiny random checkpoint,
a tiny PickScore): three rollouts and their updates through the recipe's own settings, the JSON with positive
seconds per sample and MFU fields; the microgroup sweep; the cuts it records."""

import json

import pytest
import torch
from benchmark_scripts import load_benchmark

from diffrl.recipes import recipe_config

# Per recipe: a size of its tiny checkpoint, and steps and samples cut to CPU size (the SDE window keeps room for
# the recipe's SDE steps).
TINY = {
    "wan22-grpo-pickscore": (["--height", "32", "--width", "32", "--num-frames", "1"],
                             {"diffusion_num_steps": 4, "n_samples_per_prompt": 4}),
    "ltx23-grpo-pickscore": (["--height", "64", "--width", "96", "--num-frames", "9"],
                             {"diffusion_num_steps": 4, "diffusion_sde_window_range": [0, 4], "n_samples_per_prompt": 2}),
    "cosmos3-grpo": (["--height", "16", "--width", "32", "--num-frames", "5"],
                     {"diffusion_num_steps": 4, "diffusion_sde_window_range": [0, 4], "n_samples_per_prompt": 2}),
}


@pytest.fixture
def recipe_runs(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # the script sets it: restored afterwards
    yield load_benchmark("recipe_runs", monkeypatch)
    torch.use_deterministic_algorithms(False)  # the video recipes run in deterministic mode


def _run(script, tmp_path, recipe, *extra):
    size, flags = TINY[recipe]
    out = tmp_path / f"{recipe}.json"
    script.main(["--recipe", recipe, "--checkpoint", str(tmp_path / "checkpoint"), "--tiny", "--device", "cpu",
                 "--work-dir", str(tmp_path / "work"), "--rollout-batch-size", "1", "--flags", json.dumps(flags),
                 "--out", str(out), *size, *extra])
    return json.loads(out.read_text())


# LTX-2.3's run (about 2 minutes on 2 cores) is the costly one: its recipe runs in tests/test_ltx2.py by default.
@pytest.mark.parametrize("recipe", [pytest.param(r, marks=pytest.mark.slow) if r.startswith("ltx") else r
                                    for r in sorted(TINY)])
def test_a_video_recipe_runs_end_to_end_at_tiny_size(recipe_runs, tmp_path, recipe):
    report = _run(recipe_runs, tmp_path, recipe)
    rows = report["rollouts"]
    assert [row["rollout"] for row in rows] == [0, 1, 2] and {row["kind"] for row in rows} == {"main"}
    assert all(row["seconds_per_sample"] > 0 and row["train_pairs"] > 0 for row in rows)
    assert all(row["rollout_mfu"] > 0 and row["train_mfu"] > 0 for row in rows)
    for row in rows:  # end to end: both phases' work over both phases' seconds
        both = row["rollout_mfu"] * row["rollout_s"] + row["train_mfu"] * row["train_s"]
        assert row["end_to_end_mfu"] == pytest.approx(both / (row["rollout_s"] + row["train_s"]))
    assert report["seconds_per_sample"] > 0 and report["gflop_per_forward"] > 0
    assert report["rollout_mfu"] > 0 and report["train_mfu"] > 0 and report["stopped"] is None
    assert "max_memory_gib" in report and "microgroups" not in report
    # What differs from the recipe is on record: size, frames, groups (their optimizer batch follows) and flags.
    cuts = report["cuts"]
    assert cuts["rollout_batch_size"][1] == 1 and cuts["diffusion_num_steps"][1] == 4
    steps_per_rollout = recipe_config(recipe).optim.num_steps_per_rollout  # the recipe's optimizer steps stay
    assert cuts["global_batch_size"][1] == report["samples_per_rollout"] // steps_per_rollout
    assert report["num_frames"] == int(TINY[recipe][0][5])
    if recipe == "wan22-grpo-pickscore":  # the square --resolution gives way to --height/--width
        assert cuts["resolution"] == [480, None] and cuts["height"] == [None, 32]
        # Both experts load from one expert's files.
        assert (tmp_path / "checkpoint" / "transformer_2").is_symlink()
    else:
        assert "resolution" not in cuts and cuts["num_frames"][1] == report["num_frames"]


def test_the_microgroup_sweep_times_each_size(recipe_runs, tmp_path):
    report = _run(recipe_runs, tmp_path, "cosmos3-grpo", "--num-rollout", "1", "--microgroups", "2", "1")
    kinds = [(row["kind"], row["microgroup"]) for row in report["rollouts"]]
    assert kinds == [("main", 1), ("sweep", 2), ("sweep", 2), ("sweep", 1), ("sweep", 1)]
    sweep = {entry["microgroup"]: entry for entry in report["microgroups"]}
    assert set(sweep) == {1, 2} and all(e["rollouts"] == 2 and e["seconds_per_sample"] > 0 for e in sweep.values())
    assert report["fastest_microgroup"] == min(sweep, key=lambda m: sweep[m]["seconds_per_sample"])


def test_no_rollout_starts_past_stop_by(recipe_runs, tmp_path):
    """A deadline already past lets the first rollout run (there is no estimate yet) and stops the next ones."""
    # Wan2.2's recipe: LTX-2.3's GPU size compiles, which costs this test a minute of inductor on 2 cores.
    report = _run(recipe_runs, tmp_path, "wan22-grpo-pickscore", "--microgroups", "2", "--stop-by", "1")
    m = report["rollout_microgroup_size"]  # the recipe's (its GPU size: what the benchmark measures)
    assert m == recipe_config("wan22-grpo-pickscore", "cuda").rollout.rollout_microgroup_size
    assert len(report["rollouts"]) == 1 and report["stopped"] == f"before main rollout at microgroup {m}: --stop-by"
    assert report["microgroups"] == [{"microgroup": m, "rollouts": 1, "seconds_per_sample":
                                      report["rollouts"][0]["seconds_per_sample"], "peak_gib": None}]


def test_the_sweep_has_its_own_deadline(recipe_runs, tmp_path):
    """--sweep-stop-by past: the main rollouts run, the sweep does not."""
    report = _run(recipe_runs, tmp_path, "wan22-grpo-pickscore", "--num-rollout", "2", "--microgroups", "2",
                  "--sweep-stop-by", "1")
    assert [row["kind"] for row in report["rollouts"]] == ["main", "main"]
    assert report["stopped"] == "before sweep rollout at microgroup 2: --sweep-stop-by"
    assert [entry["microgroup"] for entry in report["microgroups"]] == [8] and report["fastest_microgroup"] == 8
