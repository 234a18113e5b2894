"""The image-to-video recipes (issue 44): `wan22-i2v-grpo-pickscore` and `ltx23-i2v-grpo-pickscore` resolve to the
settings they cite, run two rollouts on the CPU (their CPU variants, shrunk by flags) on a tiny random checkpoint of
their image-to-video mode with a `.jsonl` set of first frames, where the reward sees each prompt's own first frame,
and stop at start-up in one line, naming the prompt file's row, where a checkpoint or a prompt set cannot give image
to video (a row without a first frame under an image-to-video run, a first frame on a text-to-video checkpoint)."""

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse
from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.models.random_checkpoints.ltx2 import save_random_checkpoint as save_ltx_checkpoint
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint as save_wan_checkpoint
from diffrl.recipes import recipe_config
from family_checks import random_png, save_ltx2_i2v_checkpoint, write_conditioned_prompt_set

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
    return random_png(seed, size)


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


def _train(capsys, recipe: str, model_dir: Path, prompts: Path, out: Path, size: list[str],
           extra: tuple[str, ...] = ()) -> tuple[int, str]:
    code = cli_main(["train", "--recipe", recipe, "--model-path", str(model_dir), "--prompt-data", str(prompts),
                     "--reward", "test_i2v_recipes:brightness_seeing_the_first_frame", *size, *SHRINK, *extra,
                     "--output-dir", str(out)])
    return code, capsys.readouterr().err


def _one_error_line(err: str) -> str:
    """The run's stderr ends in its one error line; what comes before is the loaders' progress bars."""
    lines = err.replace("\r", "\n").splitlines()
    assert "Traceback" not in err and [line for line in lines if line.startswith("error:")] == lines[-1:], err
    return lines[-1]


@pytest.mark.parametrize("recipe, extra", [
    ("wan22-i2v-grpo-pickscore", ()), ("ltx23-i2v-grpo-pickscore", ()),
    # LTX-2.3's GPU shape: a prompt's videos in one request, several pairs per micro-batch
    ("ltx23-i2v-grpo-pickscore", ("--rollout-microgroup-size", "2", "--micro-batch-size", "2"))])
def test_the_recipe_trains_two_rollouts_on_first_frames(recipe, extra, request, tmp_path, capsys):
    """The recipe's CPU variant, shrunk: two Flow-GRPO rollouts whose trainer replays the engine's log-probs, and
    the reward sees each prompt's own first frame beside every one of its videos."""
    wan = recipe.startswith("wan")
    model_dir = request.getfixturevalue("wan_i2v_dir" if wan else "ltx_i2v_dir")
    prompts, frames = _first_frames(tmp_path / "data", (20, 36) if wan else (60, 100))
    SEEN.clear()
    code, err = _train(capsys, recipe, model_dir, prompts, tmp_path / "run", WAN_SIZE if wan else LTX_SIZE, extra)
    assert code == 0, err
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    flags = json.loads((tmp_path / "run" / "config.json").read_text())["flags"]
    assert flags["recipe"] == recipe and flags["diffusion_sde_type"] == ("sde" if wan else "cps")
    assert flags["rollout_microgroup_size"] == (2 if extra else 1)
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
        ltx, t2v = recipe_config("ltx23-i2v-grpo-pickscore", device), recipe_config("ltx23-grpo-pickscore", device)
        ltx.check()
        # Text to video's settings on each size (on a GPU its batching, compilation and the text encoder in host
        # memory between encodes, for an 80 GB card); only the rows' first frames, and the run's saying it needs
        # them, differ.
        assert ltx.model.offload_text_encoder == ltx.model.compile == (device == "cuda")
        assert ltx.replace(recipe=None, condition_images="auto") == t2v.replace(recipe=None)
        r = ltx.rollout
        assert (r.diffusion_sde_type, r.diffusion_guidance_scale, r.rollout_microgroup_size) == (
            "cps", 1.0, 8 if device == "cuda" else 1)
        assert wan.task.condition_images == ltx.task.condition_images == "required"


def test_every_image_conditioned_real_model_recipe_requires_condition_images():
    """An editing or image-to-video recipe on rows without sources would train text-to-image (or -video) on a
    checkpoint that can do both: each says it needs a condition image in every row, on both sizes."""
    from diffrl.recipes import recipe_names

    conditioned = [n for n in recipe_names() if any(k in n for k in ("edit", "i2v", "kontext"))
                   and not n.startswith("shapes-") and not n.endswith(("-gpu", "-cpu"))]
    assert {"wan22-i2v-grpo-pickscore", "ltx23-i2v-grpo-pickscore", "flux1-kontext-grpo-pickscore",
            "qwen-image-edit-grpo-pickscore", "flux2-dev-edit-grpo-pickscore",
            "flux3-klein-edit-nft-pickscore"} <= set(conditioned)
    for name in conditioned:
        for device in ("cpu", "cuda"):
            assert recipe_config(name, device).task.condition_images == "required", (name, device)


def test_a_text_to_video_only_checkpoint_or_a_set_without_first_frames_stops_in_one_line(wan_i2v_dir, ltx_i2v_dir,
                                                                                       tmp_path, capsys):
    """wan22-i2v on a Wan2.2 text-to-video checkpoint (no image conditioning): refused in one line naming the file's
    first row with a first frame, as an editing recipe on a text-to-image checkpoint. A .txt prompt set (text only)
    on an image-to-video checkpoint: the same, naming its first line and the .jsonl layout to write. Neither writes
    the run folder: both are refused at start-up, not at the first rollout."""
    prompts, _ = _first_frames(tmp_path / "data", (20, 36))
    t2v_dir = save_wan_checkpoint(tmp_path / "wan2.2-t2v-tiny")
    code, err = _train(capsys, "wan22-i2v-grpo-pickscore", t2v_dir, prompts, tmp_path / "t2v", WAN_SIZE)
    assert code == 2 and _one_error_line(err) == (
        f"error: prompt data {prompts}:1: this row names a condition image (a.png), but the wan2_2 checkpoint at "
        "--model-path is text-to-video only and takes none; drop the row's image/images key, or train a checkpoint "
        "that takes condition images")
    assert not (tmp_path / "t2v").exists()
    text_only = tmp_path / "text.txt"
    text_only.write_text("\n".join(PROMPTS) + "\n")
    for recipe, model_dir, size, family in (("wan22-i2v-grpo-pickscore", wan_i2v_dir, WAN_SIZE, "wan2_2"),
                                            ("ltx23-i2v-grpo-pickscore", ltx_i2v_dir, LTX_SIZE, "ltx2")):
        # auto: what the checkpoint says (the run's own --condition-images required: the next test)
        code, err = _train(capsys, recipe, model_dir, text_only, tmp_path / recipe,
                           [*size, "--condition-images", "auto"])
        assert code == 2 and _one_error_line(err).startswith(
            f"error: prompt data {text_only}:1: this row has no condition image, and the {family} checkpoint at "
            "--model-path is image to video and cannot run without one; a .txt prompt file holds text only: write "
            "the prompts as a .jsonl file"), err
        assert not (tmp_path / recipe).exists()


def _second_row_without_a_frame(folder: Path) -> Path:
    """A .jsonl set whose first row names its first frame and whose second does not."""
    folder.mkdir(parents=True)
    (folder / "a.png").write_bytes(png(0, (60, 100)))
    path = folder / "i2v.jsonl"
    path.write_text(json.dumps({"prompt": PROMPTS[0], "image": "a.png"}) + "\n\n"
                    + json.dumps({"prompt": PROMPTS[1]}) + "\n")
    return path


@pytest.mark.parametrize("checkpoint", ["ltx-t2v", "wan-i2v"])
def test_an_image_to_video_run_refuses_a_row_without_a_first_frame_naming_it(checkpoint, wan_i2v_dir, tmp_path,
                                                                            capsys):
    """Issue 44: a row without a first frame under an image-to-video run stops it at start-up in one line naming
    the file, the row's line (a blank line counts) and the key to add; the run folder is never made. On LTX-2's
    text-to-video checkpoint (LTX2Pipeline: it takes a first frame but does not need one) the run says it is image
    to video by --condition-images required, and is refused before the model loads; on a Wan2.2 I2V checkpoint
    the checkpoint says so."""
    prompts = _second_row_without_a_frame(tmp_path / "data")
    if checkpoint == "ltx-t2v":
        model_dir = save_ltx_checkpoint(tmp_path / "ltx-2.3-tiny")
        recipe, size, why = ("ltx23-i2v-grpo-pickscore", [*LTX_SIZE, "--condition-images", "required"],
                             "the run needs one in every row (--condition-images required, as the image-to-video "
                             "recipes set)")
        what = "its condition image"
    else:
        model_dir, recipe, size = wan_i2v_dir, "wan22-i2v-grpo-pickscore", [*WAN_SIZE, "--condition-images", "auto"]
        why = "the wan2_2 checkpoint at --model-path is image to video and cannot run without one"
        what = "its first frame"
    code, err = _train(capsys, recipe, model_dir, prompts, tmp_path / "run", size)
    assert code == 2 and _one_error_line(err) == (
        f'error: prompt data {prompts}:3: this row has no condition image, and {why}; add an "image" key naming '
        f"{what}, a path relative to {prompts.parent} (or to its images/ folder)")
    assert not (tmp_path / "run").exists()
    if checkpoint == "ltx-t2v":  # the same rows, each with its first frame, train under --condition-images required
        prompts, _ = _first_frames(tmp_path / "framed", (60, 100))
        code, err = _train(capsys, recipe, model_dir, prompts, tmp_path / "run", size)
        assert code == 0, err
        trained = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert len([r for r in trained if "train/loss" in r]) == 2
        assert json.loads((tmp_path / "run" / "config.json").read_text())["flags"]["condition_images"] == "required"


def test_held_out_rows_and_too_many_condition_images_are_refused_at_start_up(tmp_path):
    """The held-out rows a run evaluates are checked as the training rows; a row with more condition images than
    the checkpoint takes (LTX-2: one first frame) is refused naming it; --condition-images required needs rows."""
    from diffrl.tasks import build_task

    train, _ = _first_frames(tmp_path / "train", (20, 36))
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "a held-out cat", "image": "train/a.png"}) + "\n"
                        + json.dumps({"prompt": "a held-out dog"}) + "\n")
    flags = ["train", "--prompt-data", str(train), "--eval-prompt-data", str(held_out), "--eval-num-prompts", "2",
             "--reward", "test_i2v_recipes:brightness_seeing_the_first_frame"]
    with pytest.raises(ValueError, match=rf"^prompt data {held_out}:2: this row has no condition image, and the run "):
        build_task(parse([*flags, "--condition-images", "required"]))
    task = build_task(parse(flags))  # auto: what the checkpoint needs
    ltx = SimpleNamespace(name="ltx2", generates_video=True, requires_image_conditioning=False,
                          accepts_image_conditioning=True, max_condition_images=1)
    task.check_family(ltx)  # takes a first frame, needs none: both rows pass
    with pytest.raises(ValueError, match=rf"^prompt data {held_out}:2: this row has no condition image, and the "
                                         "ltx2 checkpoint at --model-path is image to video and cannot"):
        task.check_family(SimpleNamespace(**{**vars(ltx), "requires_image_conditioning": True}))
    two = tmp_path / "two.jsonl"
    two.write_text(json.dumps({"prompt": "a cat", "images": ["train/a.png", "train/images/b.png"]}) + "\n")
    with pytest.raises(ValueError, match=rf"^prompt data {two}:1: this row names 2 condition images; the ltx2 "
                                         "checkpoint at --model-path takes at most 1$"):
        build_task(parse(["train", "--prompt-data", str(two), "--reward", flags[-1]])).check_family(ltx)
    with pytest.raises(ValueError, match="--condition-images required checks the rows of --prompt-data"):
        build_task(parse(["train", "--condition-images", "required"]))


def test_the_recipes_parse_with_a_checkpoint_and_prompt_set(wan_i2v_dir, tmp_path):
    from diffrl.train.trainer import validate_config

    prompts, _ = _first_frames(tmp_path / "data", (20, 36))
    cfg = parse(["train", "--recipe", "wan22-i2v-grpo-pickscore", "--model-path", str(wan_i2v_dir), "--prompt-data",
                 str(prompts)])
    assert cfg.model.num_frames == 5 and cfg.rollout.diffusion_num_steps == 8
    validate_config(cfg)
