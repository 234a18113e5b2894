"""Evaluation by any reward on a prompt set (diffrl.evaluation.reward_eval), and `diffrl evaluate` /
`diffrl compare` with --prompt-data and --reward."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.cli.main import main as cli_main
from diffrl.data.prompts import PromptRecord, load_prompts
from diffrl.evaluation.compare import reward_outcome
from diffrl.evaluation.reward_eval import evaluate_with_reward, reward_components, tag_name
from diffrl.evaluation.sampling import generate
from diffrl.rewards import get_reward
from diffrl.utils.images import to_uint8

PROMPTS = ["a red circle", "two blue squares", "a green triangle to the left of a yellow circle"]
STEPS = 2


def _records(n=len(PROMPTS)):
    return [PromptRecord(p, {"row": i}) for i, p in enumerate(PROMPTS[:n])]


def _jsonl(rows):
    return [json.loads(line) for line in rows.read_text().splitlines()]


def test_every_image_written_with_its_seed_and_the_summary_is_the_mean(tiny_family, tmp_path):
    out = tmp_path / "eval"
    result = evaluate_with_reward(tiny_family, _records(), "rewards_for_tests:darkness", seeds_per_prompt=2,
                                  seed=500, num_steps=STEPS, guidance_scale=3.0, batch_size=4, out_dir=out)
    rows = _jsonl(out / "records.jsonl")
    assert rows == result.rows and len(rows) == 6 and result.images.shape == (6, 3, 64, 64)
    assert [r["seed"] for r in rows] == list(range(500, 506))
    assert [r["prompt"] for r in rows] == [p for p in PROMPTS for _ in range(2)]
    assert [r["metadata"] for r in rows] == [{"row": i} for i in range(3) for _ in range(2)]
    summary = json.loads((out / "report.json").read_text())
    assert summary["eval/reward"] == pytest.approx(np.mean([r["reward"] for r in rows]), abs=1e-12)
    assert summary["eval/reward/darkness"] == pytest.approx(np.mean([r["rewards"]["darkness"] for r in rows]))
    assert summary["n_images"] == 6 and summary["n_prompts"] == 3
    for k, row in enumerate(rows):  # the file on disk is the image that was scored
        on_disk = np.asarray(Image.open(out / row["file"]))
        np.testing.assert_array_equal(on_disk, to_uint8(result.images[k : k + 1])[0])
        assert row["reward"] == pytest.approx(1.0 - float(result.images[k].mean()))
    assert sorted(p.name for p in (out / "images").iterdir()) == [f"{k:05d}.png" for k in range(6)]
    assert (out / "grid.png").is_file()
    assert not [p for p in out.rglob(".*")]  # no temporary file left behind
    # Image k alone, from its prompt and seed, is the image the evaluation made (CPU: exactly).
    k = 3
    alone = generate(tiny_family, [rows[k]["prompt"]], [rows[k]["seed"]], num_steps=STEPS, guidance_scale=3.0)
    torch.testing.assert_close(alone[0], result.images[k], rtol=0, atol=1e-6)
    other = generate(tiny_family, [rows[k]["prompt"]], [rows[k]["seed"] + 1], num_steps=STEPS, guidance_scale=3.0)
    assert (other[0] - result.images[k]).abs().max() > 1e-3  # the check above can fail


def test_multi_reward_reports_each_component_and_the_weighted_total(tiny_family):
    spec = "multi:rewards_for_tests:darkness=2,jpeg_compressibility=0.5"
    result = evaluate_with_reward(tiny_family, _records(2), spec, num_steps=STEPS, guidance_scale=1.0, out_dir=None)
    assert set(result.summary) == {"eval/reward", "eval/reward/darkness", "eval/reward/jpeg_compressibility",
                                   "eval/hue_spread", "eval/chroma"}
    for row in result.rows:
        parts = row["rewards"]
        assert row["reward"] == pytest.approx(2 * parts["darkness"] + 0.5 * parts["jpeg_compressibility"])
    # The total is what training's `multi:` reward gives the same images.
    import asyncio

    trained_on = asyncio.run(get_reward(spec)(result.images, [r["prompt"] for r in result.rows], None))
    assert [r["reward"] for r in result.rows] == pytest.approx(trained_on)
    assert result.summary["eval/reward/jpeg_compressibility"] == pytest.approx(
        np.mean([r["rewards"]["jpeg_compressibility"] for r in result.rows]))


def test_component_names_are_tag_safe():
    assert tag_name("pickscore@/x/y") == "pickscore"
    assert tag_name("rewards_for_tests:darkness") == "darkness"
    assert tag_name("ocr") == "ocr"
    assert [c.name for c in reward_components("multi:jpeg_compressibility=1,jpeg_incompressibility=-1")] == \
        ["jpeg_compressibility", "jpeg_incompressibility"]
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        reward_components("multi:nope=1")


def test_jsonl_metadata_and_the_seed_reach_the_reward(tiny_family, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "value": 0.25 * i}) + "\n" for i, p in enumerate(PROMPTS)))
    records = load_prompts(data)
    result = evaluate_with_reward(tiny_family, records, "multi:rewards_for_tests:from_metadata=1,rewards_for_tests:seed_of=0",
                                  seeds_per_prompt=2, seed=7, num_steps=STEPS, guidance_scale=1.0, out_dir=tmp_path / "o")
    assert [r["rewards"]["from_metadata"] for r in result.rows] == [0.0, 0.0, 0.25, 0.25, 0.5, 0.5]
    assert [r["rewards"]["seed_of"] for r in result.rows] == [float(s) for s in range(7, 13)]
    assert result.summary["eval/reward"] == pytest.approx(0.25)
    assert [r["metadata"] for r in _jsonl(tmp_path / "o" / "records.jsonl")][::2] == [{"value": 0.25 * i} for i in range(3)]


def test_an_interrupted_evaluation_leaves_no_records_or_summary(tiny_family, tmp_path):
    out = tmp_path / "eval"
    tiny_family.transformer.train()
    evaluate_with_reward(tiny_family, _records(1), "rewards_for_tests:darkness", num_steps=STEPS, guidance_scale=1.0,
                         out_dir=out)
    assert (out / "report.json").is_file()
    calls = []

    def fails_on_the_second_batch(images, prompts, metadata=None):
        calls.append(len(images))
        if len(calls) == 2:
            raise RuntimeError("reward server went away")
        return [0.0] * len(images)

    (out / "summary.json").write_text("{}")  # as a folder written before the one naming scheme holds it
    with pytest.raises(RuntimeError, match="went away"):
        evaluate_with_reward(tiny_family, _records(), fails_on_the_second_batch, num_steps=STEPS, guidance_scale=1.0,
                             batch_size=2, out_dir=out)
    # The earlier run's finished files are gone (under the old names too) and nothing claims the broken run finished.
    assert not (out / "report.json").exists() and not (out / "records.jsonl").exists()
    assert not (out / "summary.json").exists()
    assert (out / "images" / "00001.png").is_file() and not [p for p in out.rglob(".*")]  # the first batch's images
    calls.clear()
    evaluate_with_reward(tiny_family, _records(), fails_on_the_second_batch, num_steps=STEPS, guidance_scale=1.0,
                         batch_size=4, out_dir=out)
    assert len(_jsonl(out / "records.jsonl")) == 3 and (out / "report.json").is_file()
    evaluate_with_reward(tiny_family, _records(1), "rewards_for_tests:darkness", num_steps=STEPS, guidance_scale=1.0,
                         out_dir=out)  # a shorter rerun into the same folder: only its own images remain
    assert sorted(p.name for p in (out / "images").iterdir()) == ["00000.png"]
    assert tiny_family.transformer.training  # evaluation samples in eval mode and gives the model back as it was


def test_evaluate_command_with_prompt_data(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "eval"
    code = cli_main(["evaluate", "--model-path", str(tiny_model_dir), "--prompt-data", str(data),
                     "--reward", "multi:rewards_for_tests:darkness=1,jpeg_compressibility=0.1", "--num-prompts", "2",
                     "--n-samples-per-eval-prompt", "2", "--num-steps", str(STEPS), "--guidance-scale", "2.5",
                     "--device", "cpu", "--output-dir", str(out)])
    assert code == 0
    rows = _jsonl(out / "records.jsonl")
    assert [(r["prompt"], r["seed"]) for r in rows] == [(p, 10_000 + k) for k, p in
                                                        enumerate([PROMPTS[0]] * 2 + [PROMPTS[1]] * 2)]
    summary = json.loads((out / "report.json").read_text())
    assert summary["config"]["guidance_scale"] == 2.5
    assert summary["eval/reward/darkness"] == pytest.approx(np.mean([r["rewards"]["darkness"] for r in rows]))
    assert len(list((out / "images").iterdir())) == 4 and (out / "grid.png").is_file()
    assert "eval/reward/jpeg_compressibility" in capsys.readouterr().out
    # Bad input: one line naming the flag, exit code 2.
    for flags, message in [(["--reward", "jpeg_compressibility"], "--prompt-data"),
                           (["--prompt-data", str(data)], "--reward"),
                           (["--prompt-data", str(tmp_path / "missing.txt"), "--reward", "jpeg_compressibility"],
                            "no such file"),
                           (["--prompt-data", str(data), "--reward", "jpeg_compressibility", "--num-prompts", "0"],
                            "--num-prompts")]:
        assert cli_main(["evaluate", "--model-path", str(tiny_model_dir), "--device", "cpu", *flags]) == 2
        assert message in capsys.readouterr().err


def test_compare_command_by_reward(tiny_model_dir, tiny_family, tmp_path):
    with torch.no_grad():  # a "trained" model: the base with its weights moved
        for p in tiny_family.transformer.parameters():
            p.add_(0.5 * torch.randn_like(p))
    tiny_family.save(tmp_path / "trained")
    # Prompts that favour dark images, bright ones, or neither: the trained model's images move one way,
    # so the comparison holds a win, a loss and a tie (the sign reaches the reward as jsonl metadata).
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "sign": s}) + "\n" for p, s in zip(PROMPTS, (1, -1, 0))))
    out = tmp_path / "cmp"
    margin = 0.001
    code = cli_main(["compare", "--base", str(tiny_model_dir), "--trained", str(tmp_path / "trained"),
                     "--prompt-data", str(data), "--reward", "rewards_for_tests:signed_darkness", "--tie-margin", str(margin),
                     "--n-samples-per-eval-prompt", "2", "--guidance-scale", "3", "--num-steps", str(STEPS),
                     "--device", "cpu", "--output-dir", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    assert report["guidance_scales"] == {"base_cfg": 3.0, "base_nocfg": 1.0, "trained": 3.0}
    # Per-prompt means recomputed from each column's own records, and the outcomes they imply.
    means = {}
    for column in ("base_cfg", "base_nocfg", "trained"):
        rows = _jsonl(out / column / "records.jsonl")
        assert [r["seed"] for r in rows] == list(range(10_000, 10_006))  # the same seeds in every column
        means[column] = [np.mean([r["reward"] for r in rows if r["prompt_index"] == i]) for i in range(3)]
    assert len(report["prompts"]) == 3
    for i, row in enumerate(report["prompts"]):
        for column in means:
            assert row[column] == pytest.approx(means[column][i])
        for base in ("base_cfg", "base_nocfg"):
            diff = means["trained"][i] - means[base][i]
            expected = "tie" if abs(diff) <= margin else ("win" if diff > 0 else "loss")
            assert row[f"vs_{base}"] == expected
    for base in ("base_cfg", "base_nocfg"):
        counts = report["totals"][f"vs_{base}"]
        assert sum(counts.values()) == 3
        assert counts == {o: sum(r[f"vs_{base}"] == o for r in report["prompts"]) for o in ("win", "tie", "loss")}
    assert {r["vs_base_cfg"] for r in report["prompts"]} == {"win", "tie", "loss"}  # every rule was exercised
    table = (out / "report.md").read_text()
    assert all(p in table for p in PROMPTS) and f"{report['totals']['vs_base_cfg']['win']} wins" in table
    grid = Image.open(out / "side_by_side.png")
    assert grid.width < grid.height  # three columns, six rows (prompt × seed)


def test_compare_base_against_itself_ties_with_cfg(tiny_model_dir, tmp_path):
    data = tmp_path / "prompts.txt"
    data.write_text("\n".join(PROMPTS[:2]) + "\n")
    out = tmp_path / "cmp"
    assert cli_main(["compare", "--base", str(tiny_model_dir), "--trained", str(tiny_model_dir), "--prompt-data",
                     str(data), "--reward", "rewards_for_tests:darkness", "--tie-margin", "0", "--num-steps", str(STEPS),
                     "--device", "cpu", "--output-dir", str(out)]) == 0
    totals = json.loads((out / "report.json").read_text())["totals"]
    assert totals["vs_base_cfg"] == {"win": 0, "tie": 2, "loss": 0}  # same model, same CFG, same seeds
    assert totals["mean_reward"]["base_cfg"] == totals["mean_reward"]["trained"]
    assert sum(totals["vs_base_nocfg"].values()) == 2
    assert cli_main(["compare", "--base", str(tiny_model_dir), "--trained", str(tiny_model_dir), "--prompt-data",
                     str(data), "--reward", "rewards_for_tests:darkness", "--guidance-scale", "1", "--device", "cpu",
                     "--output-dir", str(out)]) == 2


def test_reward_outcome_rules():
    assert reward_outcome(0.5, 0.52, 0.01) == "win"
    assert reward_outcome(0.5, 0.48, 0.01) == "loss"
    assert reward_outcome(0.5, 0.505, 0.01) == "tie"
    assert reward_outcome(0.5, 0.75, 0.25) == "tie"  # the margin itself is a tie (values exact in binary)
    assert reward_outcome(0.5, 0.5, 0.0) == "tie"


def test_evaluate_a_lora_checkpoint_of_another_family(tmp_path):
    """`diffrl evaluate --checkpoint` applies a run's LoRA (PEFT format under lora/) to an sd3 base."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from diffrl.models.checkpoint import load_model
    from diffrl.models.lora import LoraSpec, add_lora
    from diffrl.models.random_checkpoints.sd3 import save_random_checkpoint
    from diffrl.models.sd3 import SD3Family

    base_dir = save_random_checkpoint(tmp_path / "sd3-tiny")
    family = SD3Family.load(base_dir)
    add_lora(family.transformer, LoraSpec(rank=2, alpha=2, target_modules=list(SD3Family.lora_target_modules)))
    with torch.no_grad():
        for name, p in family.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    lora_dir = tmp_path / "run" / "checkpoints" / "rollout-00001" / "lora"
    lora_dir.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in get_peft_model_state_dict(family.transformer).items()},
              str(lora_dir / "adapter_model.safetensors"))
    family.transformer.peft_config["default"].save_pretrained(str(lora_dir))
    data = tmp_path / "prompts.txt"
    data.write_text("a red cat\n")
    out = tmp_path / "eval"
    assert cli_main(["evaluate", "--model-path", str(base_dir), "--checkpoint", str(lora_dir.parent), "--prompt-data",
                     str(data), "--reward", "rewards_for_tests:darkness", "--num-steps", str(STEPS), "--guidance-scale",
                     "4.5", "--device", "cpu", "--output-dir", str(out)]) == 0
    row = _jsonl(out / "records.jsonl")[0]
    expected = generate(family, ["a red cat"], [row["seed"]], num_steps=STEPS, guidance_scale=4.5)
    assert row["reward"] == pytest.approx(1.0 - float(expected[0].mean()), abs=1e-6)
    without = generate(load_model(base_dir), ["a red cat"], [row["seed"]], num_steps=STEPS, guidance_scale=4.5)
    assert abs(row["reward"] - (1.0 - float(without[0].mean()))) > 1e-4  # the adapter changed the image


def test_a_video_is_written_as_an_animated_png_with_every_frame(tmp_path):
    from diffrl.evaluation.reward_eval import _write_sample

    video = torch.rand(3, 5, 8, 12, generator=torch.Generator().manual_seed(0))  # [C, F, H, W]
    path = _write_sample(video, tmp_path / "00000.png")
    with Image.open(path) as apng:
        assert apng.n_frames == 5
        for f in range(5):
            apng.seek(f)
            np.testing.assert_array_equal(np.asarray(apng.convert("RGB")), to_uint8(video[:, f][None])[0])


@pytest.mark.parametrize("fps", [16, 24, 30])
def test_a_video_keeps_identical_consecutive_frames_each_lasting_one_over_fps(tmp_path, fps):
    from diffrl.evaluation.reward_eval import _write_sample

    still = torch.rand(3, 1, 8, 12, generator=torch.Generator().manual_seed(1))
    moved = torch.rand(3, 1, 8, 12, generator=torch.Generator().manual_seed(2))
    video = torch.cat([still, still, still, moved, moved, still], dim=1)  # [C, 6, H, W], runs of equal frames
    path = _write_sample(video, tmp_path / "00000.png", fps=fps)
    with Image.open(path) as apng:
        assert apng.n_frames == 6
        total = 0.0
        for f in range(6):
            apng.seek(f)
            np.testing.assert_array_equal(np.asarray(apng.convert("RGB")), to_uint8(video[:, f][None])[0])
            assert apng.info["duration"] == pytest.approx(1000 / fps, abs=1e-6)
            total += apng.info["duration"]
        assert total == pytest.approx(6 * 1000 / fps, abs=1e-6)


def test_a_video_frame_grid_shows_each_video_as_a_row_of_evenly_spaced_frames(tmp_path):
    from diffrl.evaluation.reward_eval import save_frame_grid

    videos = torch.zeros(3, 3, 15, 8, 12)
    for f in range(15):
        videos[:, :, f] = f / 14  # frame f is one grey level
    path = save_frame_grid(videos, tmp_path / "frames.png", limit=2, frames=4)
    with Image.open(path) as grid:
        pixels = np.asarray(grid.convert("L"))
    pad, cell_w, cell_h = 2, 12 * 2, 8 * 2  # save_grid's layout: cells upscaled 2×, 2 px apart
    assert pixels.shape[1] == 4 * (cell_w + pad) + pad  # four frames per row
    levels = [int(pixels[pad + cell_h // 2, pad + c * (cell_w + pad) + cell_w // 2]) for c in range(4)]
    assert levels == [round(255 * f / 14) for f in (0, 5, 9, 14)], levels  # the first video's frames 0, 5, 9, 14
