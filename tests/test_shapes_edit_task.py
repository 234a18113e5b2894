"""The editing world as a task (`--world shapes-edit`): its prompts carry their rendered sources, the edit rewards
judge outputs against them on rendered ground truth, and Flow-GRPO trains a tiny FLUX.1 Kontext on it."""

import json

import numpy as np
import pytest
import torch

from diffrl.data.condition_images import CONDITION_IMAGES_KEY, decode_image, with_condition_images
from diffrl.data.shapes import apply_edit, sample_example
from diffrl.data.shapes.render import draw_objects
from diffrl.rewards import get_reward
from diffrl.tasks.base import EvalSettings
from diffrl.tasks.shapes_edit import ShapesEditTask
from diffrl.train.config import EvalConfig, TaskConfig

N = 12


def _unit(pixels: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(pixels).permute(2, 0, 1).float() / 255


def _wrong_object(example) -> np.ndarray:
    """The edit left undone and another object of the source removed instead."""
    named = {(example.edit.target.shape, example.edit.target.color)}
    other = next((o for o in example.source if (o.shape, o.color) not in named), None)
    if other is None:
        return draw_objects((), example.size)
    return draw_objects(apply_edit(example.source, f"remove the {other.color} {other.shape}",
                                   np.random.default_rng(0)), example.size)


def test_task_prompts_carry_their_sources_and_the_rewards_judge_them_exactly():
    """The task's first rollout is train examples 0..N-1 (instruction, kind, source as its condition image); through
    the reward interface (metadata as the rollout manager builds it) the ground-truth target passes strictly, while
    the source left unchanged, the edit done to another object and a blank image fail; partial credit gives the
    unchanged source half (edit not done, everything kept)."""
    task = ShapesEditTask(TaskConfig(world="shapes-edit", reward="shapes_edit"), EvalConfig(),
                          EvalSettings(num_steps=2, guidance_scale=1.0, resolution=64))
    records = task.draw(0, N)
    examples = [sample_example(i, "train", size=64) for i in range(N)]
    assert [r.prompt for r in records] == [e.instruction for e in examples]
    assert {r.metadata["edit_kind"] for r in records} == {"recolor", "move", "remove", "add"}
    for record, example in zip(records, examples, strict=True):
        assert np.array_equal(decode_image(record.images[0].read(), "source").permute(1, 2, 0).numpy(),
                              example.source_image())
    metadata = [with_condition_images(r.metadata, [i.read() for i in r.images]) for r in records]
    prompts = [r.prompt for r in records]
    strict, partial = get_reward("shapes_edit_strict"), get_reward("shapes_edit")

    def outputs(make):
        return torch.stack([_unit(make(e)) for e in examples])

    assert strict(outputs(lambda e: e.target_image()), prompts, metadata) == [1.0] * N
    for wrong in (lambda e: e.source_image(), _wrong_object, lambda e: draw_objects((), 64)):
        assert strict(outputs(wrong), prompts, metadata) == [0.0] * N
    assert partial(outputs(lambda e: e.source_image()), prompts, metadata) == [0.5] * N
    with pytest.raises(ValueError, match="has no source image"):
        strict(outputs(lambda e: e.target_image()), prompts, [r.metadata for r in records])
    assert all(CONDITION_IMAGES_KEY in m for m in metadata)


def test_the_world_is_chosen_by_flag_and_refuses_text_to_image_rewards(tmp_path):
    from diffrl.cli.main import parse
    from diffrl.tasks import build_task

    cfg = parse(["train", "--world", "shapes-edit", "--reward", "shapes_edit", "--resolution", "64",
                 "--output-dir", str(tmp_path / "run")])
    assert isinstance(build_task(cfg), ShapesEditTask)
    with pytest.raises(ValueError, match="pass --reward shapes_edit"):
        TaskConfig(world="shapes-edit").check()


def test_the_world_refuses_exactly_the_registrys_text_to_image_shapes_rewards():
    """The config keeps no list of its own: `--world shapes-edit` refuses the rewards the registry scores with the
    shapes verifier on text-to-image prompts (`SHAPES_TEXT_TO_IMAGE_REWARDS`), and those are every registered reward
    that reads the verifier's verdicts, so a shapes reward added to one place and not the other fails here."""
    import inspect

    from diffrl import rewards

    verifier_scored = {name for name, fn in rewards._REWARDS.items() if "_shapes_verdicts(" in inspect.getsource(fn)}
    assert verifier_scored == rewards.SHAPES_TEXT_TO_IMAGE_REWARDS
    assert {"shapes", "shapes_strict", "white_background"} <= verifier_scored

    def refused(name: str) -> bool:
        try:
            TaskConfig(world="shapes-edit", reward=name).check()
        except ValueError as err:
            return "judges text-to-image" in str(err)
        return False

    assert {name for name in rewards._REWARDS if refused(name)} == verifier_scored
    assert not refused("shapes_edit") and not refused("shapes_edit_strict")


def test_flow_grpo_trains_a_tiny_kontext_on_the_editing_world(tmp_path):
    """Two rollouts of Flow-GRPO on a tiny random FLUX.1 Kontext, rewarded by the edit verifier against each
    prompt's source; a held-out evaluation scores one example of each edit kind strictly."""
    from diffrl.models.random_checkpoints.flux1 import save_random_checkpoint
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    model = save_random_checkpoint(tmp_path / "flux1-kontext-tiny", kontext=True)
    cfg = TrainConfig.flat(
        output_dir=tmp_path / "run", model_path=model, world="shapes-edit", reward="shapes_edit", loss_type="flow_grpo",
        num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=4,
        num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=2, diffusion_sde_window_range=(0, 2),
        resolution=64, diffusion_guidance_scale=1.0, lr=1e-3, device="cpu", use_lora=True, lora_rank=2,
        eval_images_per_category=1, eval_interval=2, checkpoint_interval=10)
    Trainer(cfg).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    rewards = [r["rollout/reward/raw_mean"] for r in records if "rollout/reward/raw_mean" in r]
    assert len(rewards) == 2 and all(0.0 <= x <= 1.0 for x in rewards)
    evaluated = [r for r in records if "eval/strict" in r]
    assert evaluated and {"eval/score", "eval/strict/recolor", "eval/strict/add"} <= evaluated[-1].keys()


def test_an_undecodable_image_gets_the_same_one_line_error_each_time():
    # PIL's own message names the buffer's memory address; the error a client sees must not change per call.
    errors = set()
    for _ in range(3):
        with pytest.raises(ValueError, match="^image: not a decodable image") as caught:
            decode_image(b"certainly not an image", "image")
        errors.add(str(caught.value))
    assert len(errors) == 1 and "0x" not in errors.pop()
