"""The console summary and report.md of a run too short for a trend: one rollout, no held-out split."""

from diffrl.train.report import render_report
from diffrl.train.trainer import run_summary


def test_one_rollout_without_evaluation_is_summarized(tmp_path):
    records = [{"rollout": 0}, {"rollout": 1, "rollout/reward/raw_mean": 0.19, "time/elapsed_s": 1.0}]
    assert run_summary(records) == "reward: rollout 1 0.190"
    report = render_report(tmp_path / "run", {"num_rollout": 1}, records)
    assert "no rollout finished yet" not in report and "- reward: rollout 1 0.190" in report


def test_one_held_out_evaluation_is_summarized():
    records = [{"rollout": 0, "eval/reward": 0.25}, {"rollout": 1, "rollout/reward/raw_mean": 0.5}]
    assert run_summary(records).splitlines() == ["reward: rollout 1 0.500", "held-out reward: rollout 0 0.250"]


def test_nothing_finished_says_so(tmp_path):
    assert run_summary([{"rollout": 0}]) == ""
    assert "- no rollout finished yet" in render_report(tmp_path / "run", {"num_rollout": 3}, [{"rollout": 0}])


def test_two_or_three_rollouts_compare_the_first_and_the_last():
    """Windows of one rollout printed '± 0.000' and 'first 1 rollouts'."""
    records = [{"rollout": k, "rollout/reward/raw_mean": v} for k, v in ((1, 0.1), (2, 0.2), (3, 0.4))]
    assert run_summary(records[:2]) == "reward: rollout 1 0.100 → rollout 2 0.200"
    assert run_summary(records).splitlines()[0] == "reward: rollout 1 0.100 → rollout 3 0.400"
    many = records + [{"rollout": 4, "rollout/reward/raw_mean": 0.5}]
    assert run_summary(many).splitlines()[0].startswith("reward: first 2 rollouts 0.150 ± 0.050")
