"""The rollout's samples do not depend on the number of ranks, and benchmarks/scaling.py's table, plan and
world handling: gloo ranks on CPU with the tiny demo model."""

import json
import os
import sys
import time
from pathlib import Path

import pytest
from benchmark_scripts import BENCHMARKS, load_benchmark

from diffrl.cli.main import parse
from diffrl.train.parallel import Parallel
from diffrl.train.trainer import validate_config, validate_parallel

TESTS = Path(__file__).resolve().parent

# Flow-GRPO with CFG and an SDE window: images, trajectories and log-probs all come back to compare.
TINY_GRPO = ["--loss-type", "flow_grpo", "--n-samples-per-prompt", "3", "--rollout-microgroup-size", "2",
             "--num-steps-per-rollout", "1", "--micro-batch-size", "64", "--diffusion-num-steps", "3",
             "--diffusion-sde-window-range", "0", "3", "--diffusion-num-sde-steps", "2",
             "--diffusion-guidance-scale", "2.0", "--no-use-lora", "--eval-images-per-category", "1"]


@pytest.fixture
def scaling(monkeypatch):
    return load_benchmark("scaling", monkeypatch)


def _world(n, seconds, samples=64):
    return {"world_size": n, "seconds_per_rollout": seconds, "samples_per_rollout": samples}


def test_efficiency_is_samples_per_s_over_n_times_one_gpus(scaling):
    rows = scaling.efficiency_rows([_world(8, 20.0), _world(1, 128.0), _world(2, 70.0), {"world_size": 4}])
    assert [r["world_size"] for r in rows] == [1, 2, 8]  # the unmeasured world is left out, ascending
    assert rows[0]["samples_per_s"] == pytest.approx(0.5) and rows[0]["efficiency"] == pytest.approx(1.0)
    assert rows[1]["speedup"] == pytest.approx(128 / 70) and rows[1]["efficiency"] == pytest.approx(128 / 70 / 2)
    assert rows[2]["samples_per_s"] == pytest.approx(3.2) and rows[2]["efficiency"] == pytest.approx(0.8)
    # Without one GPU, against the smallest world measured.
    rows = scaling.efficiency_rows([_world(2, 64.0), _world(4, 40.0)])
    assert rows[1]["efficiency"] == pytest.approx(64 / 40 / 2)
    report = {"recipe": "r", "groups": 8, "samples_per_group": 8, "step": "rollout only", "device": "cuda",
              "worlds": [_world(1, 128.0), _world(8, 20.0), {"world_size": 4, "skipped": "budget"}],
              "cuts": ["rollouts per world 2 → 1"]}
    table = scaling.markdown(report)
    assert "| 8 | 20.00 | 3.200 | 6.40× | 80% |" in table
    assert "| 4 | not measured: budget" in table and "rollouts per world 2 → 1" in table


def test_the_plan_cuts_rollouts_then_groups_to_fit_the_budget(scaling):
    gpus = [8, 4, 2, 1]
    # 8 groups × 8 samples at 2 s per sample: 128 s per rollout on one GPU, 240 s for one of each world.
    assert scaling.plan(gpus, 8, 2, 8, 10_000, 0, 10, 2.0) == (8, 2, [])
    groups, rollouts, cuts = scaling.plan(gpus, 16, 2, 8, 40 + 240 + 5, 0, 10, 2.0)
    assert (groups, rollouts) == (8, 1) and cuts == ["rollouts per world 2 → 1", "groups per rollout 16 → 8"]
    groups, rollouts, cuts = scaling.plan(gpus, 8, 1, 8, 100, 0, 10, 2.0)
    assert (groups, rollouts) == (8, 1) and "still exceeds --budget-s" in cuts[-1]  # groups stay a multiple of 8


def test_published_layouts_fit_one_node_and_their_batches_split(scaling):
    for recipe, layout in scaling.PUBLISHED_LAYOUTS.items():
        assert scaling.layout_gpus(layout) <= 8, recipe
        cfg = parse(["train", "--recipe", recipe, "--device", "cuda", "--output-dir", "/tmp/x",
                     *scaling.layout_flags(layout)])
        validate_parallel(cfg, Parallel(rank=0, world_size=layout.ranks))  # the recipe's own batch splits
        assert cfg.task.reward_device == (f"cuda:{layout.ranks}" if layout.reward == "own" else None)
    cmd = scaling.launch_command(4, ["--recipe", "qwen-image-grpo-pickscore"], python="python")
    assert cmd[:6] == ["python", "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4"]


@pytest.mark.parametrize("world_size", [2, 4])
def test_batch_arithmetic_per_world_size_is_kept_or_refused_naming_the_flag(world_size):
    flags = ["train", *TINY_GRPO, "--device", "cpu", "--output-dir", "/tmp/x", "--num-steps-per-rollout", "2"]
    ok = parse([*flags, "--rollout-batch-size", "4", "--global-batch-size", "6"])
    validate_config(ok)  # 4 × 3 = 6 × 2
    if world_size == 2:
        validate_parallel(ok, Parallel(rank=0, world_size=2))  # 2 groups and 3 samples per optimizer step per rank
    else:
        with pytest.raises(ValueError, match=r"--global-batch-size = 6 must be divisible by the number of ranks \(4\)"):
            validate_parallel(ok, Parallel(rank=0, world_size=4))
    uneven = parse([*flags, "--rollout-batch-size", "2", "--global-batch-size", "3"])
    validate_config(uneven)
    with pytest.raises(ValueError, match=rf"--rollout-batch-size = 2 must be divisible by the number of ranks "
                                         rf"\({world_size}\)" if world_size == 4 else "--global-batch-size = 3"):
        validate_parallel(uneven, Parallel(rank=0, world_size=world_size))
    with pytest.raises(ValueError, match="--rollout-batch-size × --n-samples-per-prompt"):
        validate_config(parse([*flags, "--rollout-batch-size", "4", "--global-batch-size", "4"]))


def _scaling_run(scaling, tmp_path, monkeypatch, gpus, *extra):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", f"{TESTS}:{BENCHMARKS.parent}")
    out = tmp_path / "scaling.json"
    report = scaling.main(["--checkpoint", str(tmp_path / "tiny-demo"), "--device", "cpu", "--gpus", *gpus,
                           "--groups", "4", "--work-dir", str(tmp_path / "work"), "--reward",
                           "rewards_for_tests:darkness", "--out", str(out), "--md", str(tmp_path / "scaling.md"),
                           *extra, "--", *TINY_GRPO])
    assert json.loads(out.read_text())["table"] == json.loads(json.dumps(report["table"]))
    return report


# Four gloo ranks on a 2-core CI machine cost most of the test's time: the default run checks 1 against 2 ranks.
@pytest.mark.parametrize("largest", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_the_same_samples_at_one_two_and_four_ranks(scaling, tiny_model_dir, tmp_path, monkeypatch, largest):
    """Two rollouts of 4 groups × 3 samples at 1, 2 and 4 gloo ranks (the trainer's own sharding of the groups):
    every (rollout, group, sample) has the same seed (the rollout contract's formula, docs/architecture.md, with the
    run-global group index),
    the same bits of image, trajectory latents and log-probs, and the same reward."""
    world_sizes = [n for n in (1, 2, 4) if n <= largest]
    report = _scaling_run(scaling, tmp_path, monkeypatch, [str(n) for n in world_sizes], "--rollouts", "2",
                          "--budget-s", "900")
    assert report["cuts"] == [] and report["rollouts_per_world"] == 2
    worlds = {w["world_size"]: w for w in report["worlds"]}
    assert sorted(worlds) == world_sizes and all(w.get("seconds_per_rollout") for w in worlds.values()), worlds
    samples = {int(n): s for n, s in report["samples"].items()}
    keys = [(s["rollout"], s["group"], s["index"]) for s in samples[1]]
    assert keys == [(k, g, i) for k in (0, 1) for g in range(4 * k, 4 * k + 4) for i in range(3)]
    assert [s["seed"] for s in samples[1]] == [g * 3 + i for _, g, i in keys]  # rollout_seed 0
    assert {s["rank"] for s in samples[largest] if s["rollout"] == 1} == set(range(largest))  # each rank had groups
    per_rank = 4 // largest  # a rollout's 4 groups, dealt to the ranks in contiguous shares
    assert {(s["group"], s["rank"]) for s in samples[largest] if s["rollout"] == 1} == {
        (g, (g - 4) // per_rank) for g in range(4, 8)}
    for n in world_sizes[1:]:
        same = worlds[n]["same_samples"]
        assert {k: v for k, v in same.items() if k != "first_rollout"} == {
            "total": 24, "missing": 0, "seeds": 24, "images": 24, "latents": 24, "log_probs": 24, "rewards": 24}, (n, same)
        assert same["first_rollout"]["images"] == same["first_rollout"]["total"] == 12
        assert [s["image"] for s in samples[n]] == [s["image"] for s in samples[1]]
    assert samples[1][0]["latents"] is not None and samples[1][0]["log_probs"] is not None
    # The same rewards give the same curve; curves are compared only for runs that train (--train).
    assert report["reward_curves"][str(largest)] == report["reward_curves"]["1"] and len(report["reward_curves"]["1"]) == 2
    assert "curves_agreement" not in report
    table = (tmp_path / "scaling.md").read_text()
    assert f"| {largest} |" in table and "seeds 24/24; image bits 24/24, rewards 24/24" in table


def test_worlds_refused_or_out_of_budget_are_not_run(scaling, tiny_model_dir, tmp_path, monkeypatch):
    report = _scaling_run(scaling, tmp_path, monkeypatch, ["3"], "--rollouts", "1")
    (world,) = report["worlds"]
    assert world["world_size"] == 3 and "--rollout-batch-size = 4 must be divisible by the number of ranks (3)" in \
        world["skipped"]
    assert report["table"] == []
    # A world that the budget cannot hold is skipped before it starts, and said.
    report = _scaling_run(scaling, tmp_path, monkeypatch, ["2"], "--rollouts", "2", "--budget-s", "5")
    assert "rollouts per world 2 → 1" in report["cuts"] and "still exceeds --budget-s" in report["cuts"][-1]
    (world,) = report["worlds"]
    assert world["skipped"].startswith("budget: needs ~")
    assert "not measured: budget" in (tmp_path / "scaling.md").read_text()


def test_sample_comparison_counts_every_rollout_and_the_first_apart(scaling):
    def row(k, g, i, image, reward=0.5):
        return {"rollout": k, "group": g, "index": i, "seed": 3 * g + i, "image": image, "reward": reward}

    ref = [row(0, 0, 0, "a"), row(0, 0, 1, "b"), row(1, 1, 0, "c"), row(1, 1, 1, "d")]
    other = [row(0, 0, 0, "a"), row(0, 0, 1, "b"), row(1, 1, 0, "x", 0.4), row(1, 1, 1, "d"), row(2, 2, 0, "e")]
    same = scaling.compare_samples(ref, other)
    assert (same["total"], same["missing"], same["seeds"], same["images"], same["rewards"]) == (5, 1, 4, 3, 3)
    assert same["first_rollout"]["images"] == same["first_rollout"]["total"] == 2
    world = {"world_size": 2, "seconds_per_rollout": 1.0, "samples_per_rollout": 4, "same_samples": same}
    report = {"recipe": "r", "groups": 2, "samples_per_group": 2, "device": "cpu", "cuts": [],
              "worlds": [world], "step": "rollout + update"}
    assert "seeds 4/5; first rollout: image bits 2/2, rewards 2/2" in scaling.markdown(report)
    report["step"] = "rollout only"
    assert "seeds 4/5; image bits 3/5, rewards 3/5" in scaling.markdown(report)


def test_reward_curves_are_compared_rollout_by_rollout_in_standard_errors(scaling):
    def samples(means):  # four samples per rollout, at its mean ± 0.1
        return [{"rollout": k, "reward": m + d} for k, m in enumerate(means) for d in (-0.1, 0.1, -0.1, 0.1)]

    curves = scaling.reward_curves({"8": samples([0.5, 0.52, 0.9]), "2": samples([0.5, 0.5, 0.5])})
    assert [round(r["mean"], 6) for r in curves["8"]] == [0.5, 0.52, 0.9]
    se = (4 * 0.01 / 3 / 4) ** 0.5  # the sample variance over n, square-rooted
    assert curves["2"][0]["se"] == pytest.approx(se)
    agreement = scaling.curves_agreement(curves, "8", "2")
    # Rollout 0: equal; rollout 1: 0.02 apart, 0.24 standard errors; rollout 2: 0.4 apart, far outside.
    assert agreement["z"][0] == 0 and agreement["z"][1] == pytest.approx(0.02 / (2 ** 0.5 * se))
    assert (agreement["rollouts"], agreement["within_2_se"]) == (3, 2)
    assert agreement["max_abs_z"] == pytest.approx(0.4 / (2 ** 0.5 * se))
    assert agreement["second_half_mean"] == pytest.approx([0.71, 0.5])  # rollouts 1 and 2
    report = {"recipe": "r", "groups": 1, "samples_per_group": 4, "device": "cpu", "cuts": [], "worlds": [],
              "step": "rollout + update", "curves_agreement": agreement}
    assert "Reward curves, 8 against 2 GPUs: 2 of 3 rollouts' mean rewards within 2 standard errors" in \
        scaling.markdown(report)


def test_a_world_past_its_time_is_killed_with_its_children(scaling, tmp_path):
    """torchrun's ranks are children of torchrun: killing torchrun alone would leave them holding their GPUs."""
    pid_file = tmp_path / "child.pid"
    rc, log = scaling.run_world(["bash", "-c", f"echo started; sleep 60 & echo $! > {pid_file}; wait"],
                                dict(os.environ), 2.0, tmp_path / "log.txt")
    assert rc == "timeout" and "started" in log
    status = Path(f"/proc/{pid_file.read_text().strip()}/status")

    def gone() -> bool:  # gone, or a zombie awaiting its reaper
        try:
            return "\tZ" in status.read_text()
        except FileNotFoundError:
            return True

    # A SIGKILL is delivered asynchronously: on a loaded machine the child can still read as running for a moment.
    deadline = time.monotonic() + 5.0
    while not gone() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone()
    rc, log = scaling.run_world([sys.executable, "-c", "print('done')"], dict(os.environ), 30.0, tmp_path / "log2.txt")
    assert rc == 0 and log.strip() == "done"
