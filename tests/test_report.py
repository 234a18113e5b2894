"""The run's one-page report (report.md) is made of its config.json and metrics.jsonl only."""

import json

from diffrl.train.report import write_report


def _run_folder(tmp_path, records, flags):
    (tmp_path / "config.json").write_text(json.dumps({"tree": {}, "flags": flags}))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path


def test_report_states_settings_outcome_every_evaluation_and_steady_costs(tmp_path):
    records = [{"rollout": 0, "eval/reward": 0.25, "eval/reward/ocr": 0.25}]
    for k, seconds in zip(range(1, 5), (30.0, 2.0, 4.0, 3.0)):  # rollout 1 pays the warm-up
        records.append({"rollout": k, "rollout/reward/raw_mean": 0.1 * k, "rollout/seconds": seconds,
                        "rollout/images_per_s": 64 / seconds, "train/seconds": 1.0, "train/pairs_per_s": 500.0,
                        "time/elapsed_s": 40.0 + k})
    records[2]["eval/reward"] = records[2]["eval/reward/ocr"] = 0.5
    records[4].update({"eval/reward": 0.75, "eval/reward/ocr": 0.75})
    flags = {"recipe": "sd35-grpo-ocr", "diffusion_model_family": "sd3", "loss_type": "flow_grpo", "reward": "ocr",
             "prompt_data": "/d/ocr", "use_lora": False, "lora_rank": 32, "diffusion_sde_window_range": [0, 9],
             "num_rollout": 10, "model_path": None}
    path = write_report(_run_folder(tmp_path, records, flags))
    text = path.read_text()
    assert path.name == "report.md" and "4 of 10 rollouts in 44 s" in text
    assert "| recipe (`--recipe`) | `sd35-grpo-ocr` |" in text and "| SDE window (`--diffusion-sde-window-range`) | 0, 9 |" in text
    assert "LoRA rank" not in text and "(`--model-path`)" not in text  # a full finetune; a setting left unset
    assert "reward: first 2 rollouts 0.150" in text  # the console's summary
    for rollout, value in ((0, "0.25"), (2, "0.5"), (4, "0.75")):
        assert f"| {rollout} | {value} | {value} |" in text
    assert "| rollout seconds | 3.00 |" in text  # the median of rollouts 2-4: the warm-up's 30 s is left out
    assert not list(tmp_path.glob(".*tmp*"))  # written atomically: no temporary left


def test_report_states_a_video_runs_size_and_frames(tmp_path):
    """A video run (the LTX-2.3 recipe's 57 frames of 512 × 768, PickScore on 3) says what it sampled."""
    flags = {"recipe": "ltx23-grpo-pickscore", "height": 512, "width": 768, "num_frames": 57, "reward_frames": 3}
    text = write_report(_run_folder(tmp_path, [{"rollout": 0}], flags)).read_text()
    for line in ("| height (`--height`) | 512 |", "| width (`--width`) | 768 |",
                 "| frames per video (`--num-frames`) | 57 |", "| frames the reward sees (`--reward-frames`) | 3 |"):
        assert line in text


def test_report_states_the_second_experts_cfg_scale(tmp_path):
    """A Wan2.2 run (wan22-grpo-pickscore: CFG 4.0, the low-noise expert's 3.0) gives both scales; one without a
    second scale shows no row for it."""
    (tmp_path / "wan").mkdir(), (tmp_path / "ltx").mkdir()
    flags = {"recipe": "wan22-grpo-pickscore", "diffusion_guidance_scale": 4.0, "diffusion_guidance_scale_2": 3.0}
    text = write_report(_run_folder(tmp_path / "wan", [{"rollout": 0}], flags)).read_text()
    assert "| CFG scale (`--diffusion-guidance-scale`) | 4.0 |" in text
    assert "| low-noise expert's CFG scale (`--diffusion-guidance-scale-2`) | 3.0 |" in text
    text = write_report(_run_folder(tmp_path / "ltx", [{"rollout": 0}], {"diffusion_guidance_scale": 1.0})).read_text()
    assert "--diffusion-guidance-scale-2" not in text


def test_report_of_a_run_that_has_not_finished_a_rollout(tmp_path):
    text = write_report(_run_folder(tmp_path, [{"rollout": 0, "eval/strict": 0.5}], {"num_rollout": 3})).read_text()
    assert "0 of 3 rollouts" in text and "no rollout finished yet" in text and "## Cost" not in text


def test_report_cost_wording_fits_every_run_length(tmp_path):
    """A two-rollout run said 'Medians of rollouts 2–2'; a one-rollout run showed no cost at all."""
    def text_for(n):
        records = [{"rollout": k, "rollout/reward/raw_mean": 0.5, "rollout/seconds": 10.0 * k} for k in range(1, n + 1)]
        (tmp_path / str(n)).mkdir()
        return write_report(_run_folder(tmp_path / str(n), records, {"num_rollout": n})).read_text()

    one, two, three = text_for(1), text_for(2), text_for(3)
    assert "Rollout 1, the run's only one (its warm-up included):" in one and "| rollout seconds | 10.00 |" in one
    assert "Rollout 2 (rollout 1 holds the warm-up and is left out):" in two and "| per rollout | value |" in two
    assert "| rollout seconds | 20.00 |" in two
    assert "Medians of rollouts 2–3 (rollout 1 holds the warm-up and is left out):" in three
    assert "| rollout seconds | 25.00 |" in three
    assert all("2–2" not in t and "Medians of rollouts" not in t for t in (one, two))


def test_report_names_a_narrowing_of_the_held_out_images_hues(tmp_path):
    records = [{"rollout": 0, "eval/reward": 0.3, "eval/hue_spread": 0.64, "eval/chroma": 17.0}]
    records += [{"rollout": k, "rollout/reward/raw_mean": 0.4, "time/elapsed_s": 10.0 * k} for k in (1, 2)]
    records[-1].update({"eval/reward": 0.6, "eval/hue_spread": 0.07, "eval/chroma": 67.0})
    text = write_report(_run_folder(tmp_path, records, {"num_rollout": 2})).read_text()
    assert "`eval/hue_spread` 0.64 → 0.07" in text and "| `eval/chroma` |" in text
    records[-1]["eval/hue_spread"] = 0.5  # a little narrower: nothing to say
    assert "hues narrowed" not in write_report(_run_folder(tmp_path, records, {"num_rollout": 2})).read_text()
