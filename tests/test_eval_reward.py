"""`--eval-reward`: a held-out judge beside the trained reward in `diffrl train`, `evaluate` and `compare`, with the
standardized gains of both since the first evaluation and their gap in the run's metrics and report."""

import json

import pytest

from diffrl.cli.main import main, parse
from diffrl.evaluation.reward_eval import evaluate_with_reward, reward_components, score_components
from diffrl.data.prompts import load_prompts
from diffrl.tasks.prompt_set import PromptSetTask
from diffrl.train.trainer import Trainer

PROMPTS = ["a red circle", "a blue square", "a green triangle", "two squares", "a yellow circle", "a purple square"]


@pytest.fixture
def prompt_dir(tmp_path):
    folder = tmp_path / "prompts"
    folder.mkdir()
    (folder / "train.txt").write_text("\n".join(PROMPTS) + "\n")
    (folder / "test.txt").write_text("\n".join(PROMPTS[:4]) + "\n")
    return folder


def test_the_judge_scores_the_images_the_reward_scored(tiny_family, prompt_dir):
    family = tiny_family
    records = load_prompts(prompt_dir, "test", "prompt")
    result = evaluate_with_reward(family, records, "rewards_for_tests:darkness", seeds_per_prompt=2, num_steps=2,
                                  guidance_scale=1.0, batch_size=3, judge="multi:jpeg_compressibility=1,shapes=2")
    prompts = [r["prompt"] for r in result.rows]
    totals, parts = score_components(reward_components("multi:jpeg_compressibility=1,shapes=2"), result.images,
                                     prompts, [{"seed": r["seed"]} for r in result.rows])
    assert [r["judge"] for r in result.rows] == totals and [r["judges"] for r in result.rows] == parts
    assert result.summary["eval/judge"] == pytest.approx(sum(totals) / len(totals))
    assert set(result.summary) >= {"eval/reward", "eval/judge", "eval/judge/jpeg_compressibility", "eval/judge/shapes"}


def test_standardized_gains_and_the_gap_by_hand(prompt_dir):
    cfg = parse(["train", "--prompt-data", str(prompt_dir), "--reward", "rewards_for_tests:darkness",
                 "--eval-reward", "jpeg_compressibility", "--device", "cpu"])
    task = PromptSetTask(cfg.task, cfg.eval, settings=None)
    first = [{"reward": r, "judge": j} for r, j in ((0.0, 1.0), (2.0, 3.0))]  # means 1 and 2, spreads 1 and 1
    assert task._gains(first) == {"eval/reward_gain_sd": 0.0, "eval/judge_gain_sd": 0.0, "eval/hacking_gap_sd": 0.0}
    later = [{"reward": r, "judge": j} for r, j in ((3.0, 2.0), (3.0, 2.5))]  # reward mean 3 (+2 sd), judge 2.25
    assert task._gains(later) == {"eval/reward_gain_sd": 2.0, "eval/judge_gain_sd": 0.25, "eval/hacking_gap_sd": 1.75}
    restored = PromptSetTask(cfg.task, cfg.eval, settings=None)
    restored.load_state_dict(json.loads(json.dumps(task.state_dict())))  # a checkpoint keeps the first evaluation
    assert restored._gains(later) == task._gains(later)


def test_a_run_logs_the_judge_and_its_report_shows_both(tiny_model_dir, prompt_dir, tmp_path):
    run = tmp_path / "run"
    cfg = parse(["train", "--prompt-data", str(prompt_dir), "--reward", "rewards_for_tests:darkness",
                 "--eval-reward", "jpeg_compressibility", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-microgroup-size", "2", "--global-batch-size", "4", "--num-steps-per-rollout", "1",
                 "--diffusion-num-steps", "2", "--num-rollout", "2", "--eval-interval", "1", "--eval-num-prompts", "4",
                 "--device", "cpu", "--model-path", str(tiny_model_dir), "--output-dir", str(run), "--loss-type", "nft"])
    Trainer(cfg).train()
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval/judge" in r]
    assert len(evals) >= 2 and evals[0]["eval/hacking_gap_sd"] == 0.0
    assert all({"eval/reward", "eval/judge", "eval/reward_gain_sd", "eval/judge_gain_sd"} <= set(r) for r in evals)
    report = (run / "report.md").read_text()
    assert "held-out judge (--eval-reward)" in report and "judge" in report.split("since the first evaluation")[1]


def test_evaluate_reads_the_runs_judge_and_the_shapes_world_refuses_one(tiny_model_dir, prompt_dir, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["evaluate", "--model-path", str(tiny_model_dir), "--prompt-data", str(prompt_dir), "--reward",
                 "rewards_for_tests:darkness", "--eval-reward", "jpeg_compressibility", "--num-steps", "2",
                 "--device", "cpu", "--output-dir", str(out)]) == 0
    summary = json.loads((out / "report.json").read_text())
    assert "eval/judge" in summary and "judge jpeg_compressibility" in capsys.readouterr().out
    with pytest.raises(ValueError, match="--eval-reward judges a --prompt-data run"):
        parse(["train", "--eval-reward", "jpeg_compressibility", "--device", "cpu"]).check()


def test_compare_judges_every_column(tiny_model_dir, prompt_dir, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--base", str(tiny_model_dir), "--trained", str(tiny_model_dir), "--prompt-data",
                 str(prompt_dir), "--reward", "rewards_for_tests:darkness", "--eval-reward", "jpeg_compressibility",
                 "--guidance-scale", "2", "--num-steps", "1", "--device", "cpu", "--output-dir", str(out)]) == 0
    summaries = json.loads((out / "report.json").read_text())["summaries"]
    assert all("eval/judge" in summaries[c] for c in ("base_cfg", "base_nocfg", "trained"))
    assert summaries["base_cfg"]["eval/judge"] == summaries["trained"]["eval/judge"]  # the same model, the same CFG
    assert "judge (--eval-reward jpeg_compressibility)" in capsys.readouterr().out
