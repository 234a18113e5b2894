"""A run on a single prompt file, as a user brings one: it says that it has no held-out evaluation, and its
last line lists only the parts of the run folder that exist."""

import pytest

from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny")


def _run(sd3_dir, out, **flags):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    def reward(images, prompts, metadata=None):
        return [1.0 - float(image.mean()) for image in images]

    Trainer(TrainConfig.flat(
        output_dir=out, model_path=sd3_dir, num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
        rollout_microgroup_size=2, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
        diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), resolution=16, device="cpu", use_lora=True,
        lora_rank=2, reward="jpeg_compressibility", eval_images_per_category=0, eval_interval=1, eval_num_steps=2, checkpoint_interval=1, **flags),
        reward_fn=reward).train()


def test_a_single_prompt_file_says_it_has_no_held_out_evaluation(sd3_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\na green dog\n")
    _run(sd3_dir, tmp_path / "run", prompt_data=prompts)
    out = capsys.readouterr().out
    assert f"no held-out evaluation: --prompt-data {prompts} is a single file" in out
    assert "--eval-prompt-data FILE" in out
    last = [line for line in out.splitlines() if line.startswith("run folder:")][-1]
    assert not (tmp_path / "run" / "eval").exists() and "eval/" not in last and "checkpoints/" in last


def test_a_held_out_file_is_evaluated_without_the_note(sd3_dir, tmp_path, capsys):
    prompts, held_out = tmp_path / "prompts.txt", tmp_path / "test.txt"
    prompts.write_text("a red cat\na green dog\n")
    held_out.write_text("a blue bird\n")
    _run(sd3_dir, tmp_path / "run", prompt_data=prompts, eval_prompt_data=held_out)
    out = capsys.readouterr().out
    assert "no held-out evaluation" not in out
    assert "eval/" in [line for line in out.splitlines() if line.startswith("run folder:")][-1]


def test_lora_targets_that_match_nothing_are_refused_naming_the_flag(sd3_dir, tmp_path):
    """PEFT's own 'Target modules {...} not found in the base model' named neither the flag nor the family."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red cat\n")
    with pytest.raises(ValueError, match=r"^--lora-target-modules attn.to_nope: no module of the sd3 transformer"):
        _run(sd3_dir, tmp_path / "run", prompt_data=prompts, lora_target_modules=("attn.to_nope",))


def test_an_output_dir_that_is_a_file_is_refused_naming_the_flag(sd3_dir, tmp_path):
    """It failed with a NotADirectoryError traceback."""
    prompts, taken = tmp_path / "prompts.txt", tmp_path / "run"
    prompts.write_text("a red cat\n")
    taken.write_text("notes\n")
    for resume in (False, True):
        with pytest.raises(FileExistsError, match=rf"^--output-dir {taken} is a file, not a run folder"):
            _run(sd3_dir, taken, prompt_data=prompts, resume=resume)
    assert taken.read_text() == "notes\n"
