"""The image-to-video recipes (issue 44): `wan22-i2v-grpo-pickscore` and `ltx23-i2v-grpo-pickscore` resolve to the
settings they cite, run two rollouts on the CPU (their CPU variants, shrunk by flags) on a tiny random checkpoint of
their image-to-video mode with a `.jsonl` set of first frames, where the reward sees each prompt's own first frame,
and stop in one line where a checkpoint or a prompt set cannot give image to video."""

import dataclasses
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint as save_wan_checkpoint
from diffrl.recipes import recipe_config
from family_checks import save_ltx2_i2v_checkpoint, write_conditioned_prompt_set

PROMPTS = ("the cat walks", "the dog runs")
# Each recipe's tiny run: the checkpoint's size, and flags that shrink the recipe's batch and steps (its SDE kind,
# noise, CFG, microgroup, reward frames and objective stay the recipe's). LoRA rank 2 and fp32: a tiny model on a CPU.
WAN_SIZE = ["--height", "16", "--width", "32", "--num-frames", "5", "--diffusion-num-steps", "2",
            "--eval-num-steps", "2"]  # the recipe's SDE step 1 (window 1..2) is the second of 2
LTX_SIZE = ["--height", "64", "--width", "96", "--num-frames", "9", "--diffusion-num-steps", "3", "--eval-num-steps",
            "3", "--diffusion-sde-window-range", "0", "3", "--diffusion-num-sde-steps", "2"]
SHRINK = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
          "--rollout-microgroup-size", "1", "--global-batch-size", "4", "--num-steps-per-rollout", "1",
          "--lora-rank", "2", "--lora-alpha", "4", "--mixed-precision", "no", "--device", "cpu"]


def png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


SEEN: dict[str, list[torch.Tensor]] = {}


def brightness_seeing_the_first_frame(images, prompts, metadata):
    """A reward that keeps each sample's first frame (its metadata's condition images) by prompt."""
    for prompt, meta in zip(prompts, metadata, strict=True):
        SEEN.setdefault(prompt, []).extend(meta[CONDITION_IMAGES_KEY])
    return [float(image.float().mean()) for image in images]


@pytest.fixture(scope="module")
def wan_i2v_dir(tmp_path_factory) -> Path:
    return save_wan_checkpoint(tmp_path_factory.mktemp("models") / "wan2.2-i2v-tiny", image_to_video=True)


@pytest.fixture(scope="module")
def ltx_i2v_dir(tmp_path_factory) -> Path:
    return save_ltx2_i2v_checkpoint(tmp_path_factory.mktemp("models") / "ltx-2.3-i2v-tiny")


def _first_frames(folder: Path, size: tuple[int, int]) -> tuple[Path, dict[str, bytes]]:
    """An image-to-video prompt set (first frames 4 px off the video's size: the family resizes them) and each
    prompt's first frame."""
    frames = {PROMPTS[0]: png(0, size), PROMPTS[1]: png(1, size)}
    return write_conditioned_prompt_set(folder, "i2v", PROMPTS, *frames.values()), frames


def _train(capsys, recipe: str, model_dir: Path, prompts: Path, out: Path, size: list[str]) -> tuple[int, str]:
    code = cli_main(["train", "--recipe", recipe, "--model-path", str(model_dir), "--prompt-data", str(prompts),
                     "--reward", "test_i2v_recipes:brightness_seeing_the_first_frame", *size, *SHRINK,
                     "--output-dir", str(out)])
    return code, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    """The run's stderr ends in its one error line; what comes before is the loaders' progress bars."""
    lines = err.replace("\r", "\n").splitlines()
    assert "Traceback" not in err and [line for line in lines if line.startswith("error:")] == lines[-1:], err
    return lines[-1]


@pytest.mark.parametrize("recipe", ["wan22-i2v-grpo-pickscore", "ltx23-i2v-grpo-pickscore"])
def test_the_recipe_trains_two_rollouts_on_first_frames(recipe, request, tmp_path, capsys):
    """The recipe's CPU variant, shrunk: two Flow-GRPO rollouts whose trainer replays the engine's log-probs, and
    the reward sees each prompt's own first frame beside every one of its videos."""
    wan = recipe.startswith("wan")
    model_dir = request.getfixturevalue("wan_i2v_dir" if wan else "ltx_i2v_dir")
    prompts, frames = _first_frames(tmp_path / "data", (20, 36) if wan else (60, 100))
    SEEN.clear()
    code, err = _train(capsys, recipe, model_dir, prompts, tmp_path / "run", WAN_SIZE if wan else LTX_SIZE)
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    flags = json.loads((tmp_path / "run" / "config.json").read_text())["flags"]
    assert flags["recipe"] == recipe and flags["diffusion_sde_type"] == ("sde" if wan else "cps")
    # 2 rollouts × 2 prompts × 2 samples, each scored with its prompt's first frame, decoded from the file.
    assert sorted(SEEN) == sorted(PROMPTS) and sum(map(len, SEEN.values())) == 8
    for prompt, seen in SEEN.items():
        source = torch.from_numpy(np.asarray(Image.open(io.BytesIO(frames[prompt])))).permute(2, 0, 1) / 255
        assert all(torch.equal(frame, source) for frame in seen)


def test_the_recipes_have_the_settings_they_cite():
    """wan22-i2v: Flow-Factory's examples/grpo/lora/wan22/i2v.yaml; ltx23-i2v: ltx23-grpo-pickscore's settings
    (miles_diffusion's LTX-2.3 run). One size on a CPU and a GPU, as every real-checkpoint recipe."""
    for device in ("cpu", "cuda"):
        wan = recipe_config("wan22-i2v-grpo-pickscore", device)
        wan.check()
        m, r, a, o = wan.model, wan.rollout, wan.algorithm, wan.optim
        assert (m.diffusion_model_family, a.loss_type, wan.task.reward, m.size(), m.num_frames) == (
            "wan2_2", "flow_grpo", "pickscore", (480, 480), 5)
        assert (r.diffusion_num_steps, r.diffusion_guidance_scale, r.diffusion_guidance_scale_2) == (8, 3.5, None)
        assert (r.diffusion_sde_type, r.diffusion_noise_level, r.diffusion_sde_window_range,
                r.diffusion_num_sde_steps) == ("sde", 0.9, (1, 2), 1)
        assert (r.rollout_batch_size, r.n_samples_per_prompt, o.global_batch_size, o.num_steps_per_rollout) == (
            48, 16, 384, 2)
        assert (o.lr, o.weight_decay, o.adam_beta2, o.grad_clip, o.micro_batch_size) == (1e-4, 1e-4, 0.999, 1.0, 1)
        assert (a.diffusion_clip_range, a.diffusion_adv_clip_max, a.diffusion_kl_beta, a.globalize_reward_std) == (
            1e-4, 5.0, 0.0, False)
        assert (m.lora_rank, m.lora_alpha, m.mixed_precision, wan.eval.eval_num_steps) == (64, 128.0, "bf16", 28)
        assert wan.task.reward_frames is None  # PickScore's mean over every frame
        ltx, t2v = recipe_config("ltx23-i2v-grpo-pickscore", device), recipe_config("ltx23-grpo-pickscore", "cpu")
        ltx.check()
        assert dataclasses.replace(ltx, recipe=None) == dataclasses.replace(t2v, recipe=None)
        r = ltx.rollout
        assert (r.diffusion_sde_type, r.diffusion_guidance_scale, r.rollout_microgroup_size) == ("cps", 1.0, 1)


def test_a_text_to_video_only_checkpoint_or_a_set_without_first_frames_stops_in_one_line(wan_i2v_dir, ltx_i2v_dir,
                                                                                       tmp_path, capsys):
    """wan22-i2v on a Wan2.2 text-to-video checkpoint (no image conditioning): refused in one line, as an editing
    recipe on a text-to-image checkpoint. A prompt set without first frames on an image-to-video checkpoint: the
    same."""
    prompts, _ = _first_frames(tmp_path / "data", (20, 36))
    t2v_dir = save_wan_checkpoint(tmp_path / "wan2.2-t2v-tiny")
    code, err = _train(capsys, "wan22-i2v-grpo-pickscore", t2v_dir, prompts, tmp_path / "t2v", WAN_SIZE)
    assert code == 2 and _one_error_line(err) == ("error: image_path: the wan2_2 family is text-to-video only; "
                                                  "image conditioning is refused")
    text_only = tmp_path / "text.txt"
    text_only.write_text("\n".join(PROMPTS) + "\n")
    for recipe, model_dir, size in (("wan22-i2v-grpo-pickscore", wan_i2v_dir, WAN_SIZE),
                                    ("ltx23-i2v-grpo-pickscore", ltx_i2v_dir, LTX_SIZE)):
        code, err = _train(capsys, recipe, model_dir, text_only, tmp_path / recipe, size)
        assert code == 2 and _one_error_line(err).startswith("error: image_path: "), err


def test_the_recipes_parse_with_a_checkpoint_and_prompt_set(wan_i2v_dir, tmp_path):
    from diffrl.train.trainer import validate_config

    prompts, _ = _first_frames(tmp_path / "data", (20, 36))
    cfg = parse(["train", "--recipe", "wan22-i2v-grpo-pickscore", "--model-path", str(wan_i2v_dir), "--prompt-data",
                 str(prompts)])
    assert cfg.model.num_frames == 5 and cfg.rollout.diffusion_num_steps == 8
    validate_config(cfg)
