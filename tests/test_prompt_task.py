"""Training on a user's prompt set: the task seam, metadata to the reward, evaluation by the reward,
resume at the exact dataset position, and the CLI spellings of the published recipes."""

import json

import pytest
import torch

from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from test_trainer import tiny_config

from diffrl.train.trainer import Trainer

PROMPTS = [f"a photo of object {i}" for i in range(7)]


def _records(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def prompt_dir(tmp_path):
    """Flow-GRPO's layout with metadata: train_metadata.jsonl / test_metadata.jsonl, prompt under `input`."""
    d = tmp_path / "prompts"
    d.mkdir()
    (d / "train_metadata.jsonl").write_text("".join(json.dumps({"input": p, "value": i / 10}) + "\n"
                                                    for i, p in enumerate(PROMPTS)))
    (d / "test_metadata.jsonl").write_text("".join(json.dumps({"input": f"held out {i}", "value": 1 + i}) + "\n"
                                                   for i in range(3)))
    return d


def test_jsonl_metadata_reaches_the_reward_and_evaluation_scores_the_test_split(tiny_model_dir, tmp_path, prompt_dir):
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_model_dir, out, prompt_data=prompt_dir, input_key="input",
                                  reward="rewards_for_tests:from_metadata", eval_num_prompts=2,
                                  n_samples_per_eval_prompt=2, loss_type="nft"))
    assert trainer.task.name == "prompt_set"
    record = trainer.rollout_and_update(0)
    drawn = trainer.task.train.state_dict()
    assert drawn["position"] == 2  # two groups drew two prompts
    # The reward is each prompt's metadata `value`: the rollout mean is the mean over the drawn prompts.
    values = {p: i / 10 for i, p in enumerate(PROMPTS)}
    order = trainer.task.train._order(0)[:2]
    assert record["rollout/reward/raw_mean"] == pytest.approx(sum(values[PROMPTS[i]] for i in order) / 2)
    evaluated = trainer.evaluate(1)
    # First 2 test prompts × 2 seeds, scored by the same reward: values 1 and 2.
    assert evaluated["eval/reward"] == pytest.approx(1.5)
    rows = [json.loads(line) for line in (out / "eval" / "rollout-00001" / "records.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["held out 0", "held out 0", "held out 1", "held out 1"]
    assert [r["seed"] for r in rows] == [10_000, 10_001, 10_002, 10_003]
    assert all((out / "eval" / "rollout-00001" / r["file"]).is_file() for r in rows)


def test_resume_continues_the_prompt_order_exactly(tiny_model_dir, tmp_path, prompt_dir):
    """3 rollouts of 2 prompts walk 6 of 7 prompts; killed after 2 rollouts and resumed, the run draws
    the same prompts (the reward reads them) and the same losses as the uninterrupted one."""
    flags = dict(prompt_data=prompt_dir, input_key="input", reward="rewards_for_tests:from_metadata",
                 eval_num_prompts=1, eval_interval=10, loss_type="nft")
    straight, split = tmp_path / "straight", tmp_path / "split"
    Trainer(tiny_config(tiny_model_dir, straight, num_rollout=4, **flags)).train()
    Trainer(tiny_config(tiny_model_dir, split, num_rollout=2, checkpoint_interval=2, **flags)).train()
    resumed = Trainer(tiny_config(tiny_model_dir, split, num_rollout=4, resume=True, **flags))
    assert {k: v for k, v in resumed.task.train.state_dict().items() if k != "sha256"} == \
        {"epoch": 0, "position": 4, "size": 7}
    resumed.train()
    a = [r for r in _records(straight) if "rollout/reward/raw_mean" in r]
    b = [r for r in _records(split) if "rollout/reward/raw_mean" in r]
    assert [r["rollout/reward/raw_mean"] for r in a] == [r["rollout/reward/raw_mean"] for r in b]
    assert [r["train/loss"] for r in a] == pytest.approx([r["train/loss"] for r in b], rel=1e-6)
    assert resumed.task.train.state_dict()["epoch"] == 1  # 8 draws of 7 prompts crossed into a new order


def test_resume_refuses_prompt_files_edited_since_the_checkpoint(tiny_model_dir, tmp_path, prompt_dir, capsys):
    """Same number of prompts, other content: the train split, then the held-out split, is refused in
    one line naming the flag and the file; a checkpoint from before the fingerprints resumes."""
    flags = dict(prompt_data=prompt_dir, input_key="input", reward="rewards_for_tests:from_metadata",
                 eval_num_prompts=1, eval_interval=10, loss_type="nft")
    out = tmp_path / "run"
    trainer = Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, **flags))
    trainer.save_checkpoint()
    train_file, test_file = prompt_dir / "train_metadata.jsonl", prompt_dir / "test_metadata.jsonl"
    original_train, original_test = train_file.read_text(), test_file.read_text()
    train_file.write_text(original_train.replace("object 3", "object three"))
    with pytest.raises(ValueError, match=f"^--resume: --prompt-data {prompt_dir} is not the prompt set"):
        Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, **flags))
    train_file.write_text(original_train)
    test_file.write_text(original_test.replace('"value": 2', '"value": 5'))
    with pytest.raises(ValueError, match=rf"^--resume: --prompt-data {prompt_dir} \(its test split\) is not the held-out"):
        Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, **flags))
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, eval_num_prompts=0,
                        **{k: v for k, v in flags.items() if k != "eval_num_prompts"}))  # no evaluation: no check
    test_file.write_text(original_test)
    Trainer(tiny_config(tiny_model_dir, out, num_rollout=2, resume=True, **flags))


def test_a_real_family_trains_on_a_txt_file_with_the_ocr_reward(tmp_path):
    """The issue's first failure: an SD3 checkpoint, a .txt prompt file and the ocr reward."""
    pytest.importorskip("rapidocr_onnxruntime")
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint

    sd3_dir = save_random_checkpoint(tmp_path / "sd3-tiny", with_t5=False)
    prompts = tmp_path / "train.txt"
    prompts.write_text('a sign that says "OPEN"\na mug printed with "diffrl"\n')
    out = tmp_path / "run"
    code = cli_main(["train", "--recipe", "sd35-grpo-ocr", "--model-path", str(sd3_dir), "--prompt-data", str(prompts),
                     "--output-dir", str(out), "--num-rollout", "2", "--rollout-batch-size", "1",
                     "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2", "--global-batch-size", "2",
                     "--resolution", "32", "--diffusion-num-steps", "2", "--diffusion-sde-window-range", "0,2",
                     "--diffusion-num-sde-steps", "1", "--micro-batch-size", "2", "--device", "cpu"])
    assert code == 0
    records = [r for r in _records(out) if "rollout/reward/raw_mean" in r]
    assert len(records) == 2 and all(0.0 <= r["rollout/reward/raw_mean"] <= 1.0 for r in records)
    assert (out / "checkpoints" / "rollout-00002" / "lora" / "adapter_model.safetensors").is_file()


def test_the_demo_recipe_trains_on_a_prompt_file_with_any_reward(tmp_path):
    """`--recipe shapes-nft --prompt-data train.txt --eval-prompt-data test.txt --reward jpeg_compressibility`
    keeps the recipe's other settings and evaluates that reward on test.txt."""
    (tmp_path / "train.txt").write_text("a red circle\ntwo blue squares\n")
    (tmp_path / "test.txt").write_text("a green triangle\n")
    args = ["train", "--recipe", "shapes-nft", "--device", "cpu", "--prompt-data", str(tmp_path / "train.txt"),
            "--eval-prompt-data", str(tmp_path / "test.txt"), "--reward", "jpeg_compressibility"]
    cfg = parse(args)
    assert cfg.algorithm.loss_type == "nft" and cfg.rollout.diffusion_num_steps == 4 and cfg.optim.lr == 5e-5
    out = tmp_path / "run"
    small = ["--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
             "--rollout-microgroup-size", "2", "--global-batch-size", "4", "--micro-batch-size", "12",
             "--output-dir", str(out)]
    assert cli_main(args + small) == 0
    records = _records(out)
    assert "eval/reward" in records[0] and "eval/reward" in records[-1] and "eval/strict" not in records[-1]
    rows = [json.loads(line) for line in (out / "eval" / "rollout-00001" / "records.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in rows] == ["a green triangle"]
    assert records[-1]["eval/reward"] == pytest.approx(rows[0]["reward"]) and rows[0]["reward"] < 0  # −kB of the JPEG
    assert (out / "eval" / "rollout-00001" / "grid.png").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"images": 0}).Reload()
    assert [e.step for e in events.Images("eval/images")] == [0, 1]  # the evaluated images, each evaluation


def test_published_flag_spellings_are_accepted():
    cfg = parse(["train", "--diffusion-sde-window-range", "3,5", "--diffusion-microgroup-size", "4",
                 "--eval-prompt-data", "pickscore_test", "/data/test.jsonl", "--prompt-data", "/data/train.jsonl",
                 "--diffusion-eval-num-steps", "50", "--clip-grad", "0.5"])
    assert cfg.rollout.diffusion_sde_window_range == (3, 5) and cfg.rollout.rollout_microgroup_size == 4
    assert str(cfg.task.eval_prompt_data) == "/data/test.jsonl" and cfg.eval.eval_num_steps == 50
    assert cfg.optim.grad_clip == 0.5
    assert parse(["train", "--diffusion-sde-window-range=1,3"]).rollout.diffusion_sde_window_range == (1, 3)


def test_prompt_set_flags_are_checked_up_front(tmp_path, tiny_model_dir):
    with pytest.raises(ValueError, match="--eval-prompt-data needs --prompt-data"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "a", eval_prompt_data=tmp_path / "t.txt"))
    with pytest.raises(FileNotFoundError, match="no such file"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "b", prompt_data=tmp_path / "missing.txt"))
    assert cli_main(["train", "--prompt-data", str(tmp_path / "missing.txt"), "--output-dir", str(tmp_path / "c")]) == 2
    (tmp_path / "p.txt").write_text("x\n")
    with pytest.raises(ValueError, match="--train-categories"):
        Trainer(tiny_config(tiny_model_dir, tmp_path / "d", prompt_data=tmp_path / "p.txt", train_categories=("colors",)))


@pytest.mark.parametrize("prompt_set", [True, False], ids=["prompt_set", "shapes"])
def test_evaluation_uses_the_rollouts_negative_prompt(tiny_model_dir, tmp_path, prompt_dir, monkeypatch, prompt_set):
    """--negative-prompt is the unconditional side of CFG in rollouts and in held-out evaluation alike."""
    import diffrl.evaluation.sampling as sampling

    seen, real = [], sampling.generate

    def spy(*args, **kwargs):  # one negative prompt for all, or one per image (a prompt set's rows may carry theirs)
        negative = kwargs.get("negative_prompt")
        seen.extend([negative] if isinstance(negative, str) else negative)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampling, "generate", spy)
    import diffrl.evaluation.reward_eval as reward_eval
    import diffrl.evaluation.shapes as shapes_eval

    monkeypatch.setattr(reward_eval, "generate", sampling.generate)
    monkeypatch.setattr(shapes_eval, "generate", sampling.generate)
    task = dict(prompt_data=prompt_dir, input_key="input", reward="rewards_for_tests:from_metadata",
                eval_num_prompts=1) if prompt_set else dict(eval_images_per_category=1)
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", negative_prompt="blurry", **task))
    trainer.evaluate(0)
    assert seen and set(seen) == {"blurry"}


def test_a_reward_that_cannot_score_a_training_prompt_is_refused_before_the_model_loads(tmp_path):
    (tmp_path / "train.txt").write_text('a sign that says "OPEN"\na photo of a dog\n')
    with pytest.raises(ValueError, match=r"train.txt \(training prompts\), prompt 2: .*quotes no text"):
        Trainer(tiny_config(tmp_path / "no-model", tmp_path / "run", prompt_data=tmp_path / "train.txt", reward="ocr"))


def test_a_directory_without_a_test_split_trains_with_eval_num_prompts_0(tmp_path):
    """--eval-num-prompts 0 (documented: no evaluation) reads no test split, so a directory holding only
    train.txt trains; without it the refusal names the two ways out. It was refused either way."""
    from diffrl.tasks.base import EvalSettings
    from diffrl.tasks.prompt_set import PromptSetTask

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.txt").write_text("a cat\na dog\n")
    flags = dict(prompt_data=tmp_path / "data", reward="rewards_for_tests:darkness")
    cfg = tiny_config(tmp_path / "no-model", tmp_path / "run", eval_num_prompts=0, **flags)
    task = PromptSetTask(cfg.task, cfg.eval, EvalSettings.from_config(cfg))
    assert not task.evaluates and len(task.train.records) == 2
    cfg = tiny_config(tmp_path / "no-model", tmp_path / "run", **flags)
    with pytest.raises(FileNotFoundError, match=r"no test_metadata.jsonl or test.txt in it.*--eval-prompt-data.*"
                                                r"--eval-num-prompts 0"):
        PromptSetTask(cfg.task, cfg.eval, EvalSettings.from_config(cfg))


def test_train_num_prompts_keeps_the_first_prompts_in_file_order(tmp_path):
    """--train-num-prompts N (Flow-Factory's max_dataset_size): the first N training prompts, in file order, are the
    ones a run draws from (and resume's fingerprint covers)."""
    from diffrl.tasks.base import EvalSettings
    from diffrl.tasks.prompt_set import PromptSetTask

    (tmp_path / "train.txt").write_text("a cat\na dog\na bird\na fish\n")
    cfg = tiny_config(tmp_path / "no-model", tmp_path / "run", prompt_data=tmp_path / "train.txt", train_num_prompts=2,
                      reward="rewards_for_tests:darkness")
    task = PromptSetTask(cfg.task, cfg.eval, EvalSettings.from_config(cfg))
    assert [r.prompt for r in task.train.records] == ["a cat", "a dog"]
    assert {p.prompt for p in task.draw(0, 6)} == {"a cat", "a dog"}
    with pytest.raises(ValueError, match="--train-num-prompts 0 needs --prompt-data and a count >= 1"):
        tiny_config(tmp_path / "no-model", tmp_path / "run", prompt_data=tmp_path / "train.txt",
                    train_num_prompts=0).check()
