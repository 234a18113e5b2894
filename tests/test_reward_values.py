"""A reward's values are checked where they are used: one finite number per image, else one line naming the reward.
A NaN reward trained nothing (every optimizer step skipped) and the run ended as a success; a wrong count said
"zip() argument 2 is shorter than argument 1"; a string said "could not convert string to float"."""

import pytest

from diffrl.cli.main import main
from diffrl.rewards import checked_rewards
from diffrl.train.trainer import Trainer
from test_trainer import tiny_config


def test_checked_rewards_accepts_numbers_and_names_what_is_wrong():
    import torch

    assert checked_rewards(torch.tensor([0.5, 1.0]), 2, "--reward r", ["a", "b"]) == [0.5, 1.0]
    with pytest.raises(ValueError, match=r"^--reward r returned 1 values for 2 images; a reward returns one number"):
        checked_rewards([0.5], 2, "--reward r", ["a", "b"])
    for bad in (float("nan"), float("inf"), "good", None):
        with pytest.raises(ValueError, match=r"^--reward r returned .* for image 1 \(prompt 'b'\); a reward must be a "
                                             r"finite number$"):
            checked_rewards([0.5, bad], 2, "--reward r", ["a", "b"])
    with pytest.raises(ValueError, match=r"^--reward r returned float, not one number per image$"):
        checked_rewards(0.5, 1, "--reward r", ["a"])


@pytest.mark.parametrize("reward, message", [
    ("rewards_for_tests:not_a_number", r"returned nan for image 0 \(prompt '.*'\); a reward must be a finite number"),
    ("rewards_for_tests:one_value", r"returned 1 values for 2 images"),
])
def test_a_rollout_with_bad_reward_values_stops_naming_the_reward(tiny_model_dir, tmp_path, reward, message):
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", reward=reward, eval_interval=10))
    with pytest.raises(ValueError, match=rf"^--reward {reward} {message}"):
        trainer.rollout_and_update(0)


def test_evaluate_with_a_nan_reward_is_one_line(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "prompts.txt").write_text("a red circle\n")
    assert main(["evaluate", "--model-path", str(tiny_model_dir), "--prompt-data", str(tmp_path / "prompts.txt"),
                 "--reward", "rewards_for_tests:not_a_number", "--num-steps", "2", "--device", "cpu",
                 "--output-dir", str(tmp_path / "eval")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: reward 'rewards_for_tests:not_a_number' returned nan for image 0 (prompt 'a red circle')")


def test_the_error_line_of_a_failed_run_is_not_glued_to_the_progress_bar(tiny_model_dir, tmp_path, capsys):
    """The bar was left open, so 'error: …' followed 'train nft: 0%|…' on one line."""
    assert main(["train", "--model-path", str(tiny_model_dir), "--reward", "rewards_for_tests:not_a_number",
                 "--device", "cpu", "--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
                 "--rollout-microgroup-size", "2", "--global-batch-size", "2", "--num-steps-per-rollout", "1",
                 "--diffusion-num-steps", "2", "--eval-images-per-category", "0",
                 "--output-dir", str(tmp_path / "run")]) == 2
    lines = capsys.readouterr().err.split("\n")
    assert any(line.startswith("error: --reward rewards_for_tests:not_a_number returned nan") for line in lines), lines


def test_a_prompt_set_the_shapes_reward_cannot_score_is_refused_up_front(tmp_path, capsys):
    """`shapes` is the reward a run gets without --reward: on another prompt set it failed at the first scoring
    ('cannot parse prompt …'), after the model loaded and a rollout was sampled."""
    (tmp_path / "prompts.txt").write_text("a red circle\na cat on a mat\n")
    assert main(["train", "--recipe", "shapes-grpo", "--device", "cpu", "--prompt-data", str(tmp_path / "prompts.txt"),
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"error: prompt data {tmp_path / 'prompts.txt'} (training prompts), prompt 2: cannot parse prompt 'a cat on a "
        "mat': unknown shape 'cat'; the shapes rewards score only the shapes world's prompts (pass --reward for this "
        "prompt set)")
    assert not (tmp_path / "run").exists()
