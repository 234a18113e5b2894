"""`--eval-resolution` / `--eval-height --eval-width` / `--eval-num-frames`: held-out samples at another size than
the rollouts (published recipes roll out small and evaluate at the model's own size)."""

import pytest

from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
from diffrl.train.config import TrainConfig
from diffrl.train.trainer import Trainer, validate_config


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sd3-tiny", with_t5=False)


def _config(sd3_dir, out, prompts, **flags) -> TrainConfig:
    return TrainConfig.flat(
        output_dir=out, model_path=sd3_dir, num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
        rollout_microgroup_size=2, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
        diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), resolution=16, device="cpu", use_lora=True,
        lora_rank=2, reward="jpeg_compressibility", prompt_data=prompts, eval_prompt_data=prompts, eval_interval=1,
        eval_num_steps=2, checkpoint_interval=1, **flags)


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red cat\na green dog\n")
    return path


def _spy(monkeypatch) -> list:
    import diffrl.tasks.prompt_set as prompt_set

    seen, real = [], prompt_set.evaluate_with_reward

    def spy(*args, **kwargs):
        result = real(*args, **kwargs)
        seen.append((kwargs["resolution"], kwargs["height"], kwargs["width"], tuple(result.images.shape[-2:])))
        return result

    monkeypatch.setattr(prompt_set, "evaluate_with_reward", spy)
    return seen


def test_held_out_images_take_the_eval_size_and_rollouts_keep_theirs(sd3_dir, prompts, tmp_path, monkeypatch):
    seen = _spy(monkeypatch)
    trainer = Trainer(_config(sd3_dir, tmp_path / "square", prompts, eval_resolution=32))
    trainer.evaluate(0)
    assert seen == [(32, None, None, (32, 32))]
    record = trainer.rollout_and_update(0)
    assert record["train/pairs"] > 0
    seen.clear()
    Trainer(_config(sd3_dir, tmp_path / "wide", prompts, eval_height=16, eval_width=32)).evaluate(0)
    assert seen == [(None, 16, 32, (16, 32))]
    seen.clear()
    Trainer(_config(sd3_dir, tmp_path / "same", prompts)).evaluate(0)
    assert seen == [(16, None, None, (16, 16))]  # without the flags: the rollouts' size


def test_rollouts_keep_their_size_beside_a_larger_evaluation(sd3_dir, prompts, tmp_path, monkeypatch):
    import diffrl.engine.engine as engine_module

    sizes, real = [], engine_module.Engine.plan

    def spy(self, req, *args, **kwargs):
        sizes.append((req.height, req.width))
        return real(self, req, *args, **kwargs)

    monkeypatch.setattr(engine_module.Engine, "plan", spy)
    Trainer(_config(sd3_dir, tmp_path / "run", prompts, eval_resolution=32)).rollout_and_update(0)
    assert sizes and set(sizes) == {(16, 16)}


@pytest.mark.parametrize("flags, message", [
    ({"eval_resolution": 48, "eval_height": 32, "eval_width": 32}, "--eval-resolution 48 is the square shorthand"),
    ({"eval_height": 32}, "--eval-height and --eval-width go together"),
    ({"eval_resolution": 0}, "--eval-resolution must be > 0"),
    ({"eval_num_frames": 0}, "--eval-num-frames must be >= 1"),
])
def test_contradictory_eval_sizes_are_refused_by_name(sd3_dir, prompts, tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        validate_config(_config(sd3_dir, tmp_path / "run", prompts, **flags))


def test_a_size_or_frame_count_the_family_cannot_make_is_refused_before_training(sd3_dir, prompts, tmp_path):
    with pytest.raises(ValueError, match="--eval-resolution 18: "):
        Trainer(_config(sd3_dir, tmp_path / "odd", prompts, eval_resolution=18))
    with pytest.raises(ValueError, match="--eval-num-frames 5: the sd3 family generates images"):
        Trainer(_config(sd3_dir, tmp_path / "video", prompts, eval_num_frames=5))


def test_recipes_evaluate_at_the_published_size_on_a_gpu_and_at_the_rollouts_on_a_cpu():
    from diffrl.recipes import recipe_overrides

    published = {"z-image-grpo-pickscore": (1024, None), "z-image-turbo-grpo-pickscore": (None, None),
                 "flux2-klein-grpo-pickscore": (1024, None), "flux1-kontext-grpo-pickscore": (512, None),
                 "qwen-image-edit-grpo-pickscore": (1024, None), "wan22-i2v-grpo-pickscore": (720, 21)}
    for name, (resolution, frames) in published.items():
        gpu, cpu = recipe_overrides(f"{name}-gpu"), recipe_overrides(name, device="cpu")
        assert (gpu.get("eval_resolution"), gpu.get("eval_num_frames")) == (resolution, frames), name
        assert "eval_resolution" not in cpu and "eval_num_frames" not in cpu, name
