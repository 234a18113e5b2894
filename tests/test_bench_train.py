"""`diffrl bench-train`: a short training run on the shipped demo model, then the loop's cost table, whose
numbers are the run's own metrics; steady state is the median of the rollouts after the first."""

import json
import math
from pathlib import Path

import pytest

from diffrl.cli.bench_train import format_table, train_forward_equivalents, training_table
from diffrl.cli.main import main as cli_main
from diffrl.cli.main import parse

# 2 prompts × 2 samples, 3 steps: a rollout and its training take well under a second on 2 CPU cores.
TINY = ["--device", "cpu", "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-microgroup-size", "2", "--global-batch-size", "4", "--micro-batch-size", "4",
        "--diffusion-num-steps", "3", "--reward", "rewards_for_tests:darkness"]
SAMPLES = 4


def _rollouts(run):
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "rollout/seconds" in r]


def test_flow_grpo_table_is_the_runs_own_metrics(tmp_path, capsys):
    run, out = tmp_path / "run", tmp_path / "bench.json"
    assert cli_main(["bench-train", "--recipe", "shapes-grpo", *TINY, "--diffusion-sde-window-range", "0,3",
                     "--diffusion-num-sde-steps", "2",
                     "--diffusion-guidance-scale", "2", "--use-lora", "--output-dir", str(run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    first, second = _rollouts(run)
    assert not (run / "checkpoints").exists() and not (run / "eval").exists()  # neither was asked for
    for got, r in ((results["first"], first), (results["steady"], second)):  # steady: the median of one
        sample_s = (r["rollout/seconds"] + r["train/seconds"]) / SAMPLES
        assert got["sample_s"] == pytest.approx(sample_s) and got["rollout_image_s"] == pytest.approx(
            r["rollout/seconds"] / SAMPLES)
        assert got["train_pair_ms"] == pytest.approx(1000 * r["train/seconds"] / r["train/pairs"])
        assert got["trained_steps_per_sample"] == r["train/pairs"] / SAMPLES == 2  # the 2 SDE steps
        assert got["first_pass_log_prob_abs_diff"] == r["train/log_prob_mean_abs_diff"] == 0.0  # fp32 on CPU
        assert got["first_pass_clipfrac"] == r["train/first_pass_clipfrac"] == 0.0
        assert all(math.isfinite(got[k]) and got[k] > 0 for k in ("sample_s", "rollout_image_s", "train_pair_ms"))
        flops = results["flops"]  # CFG in rollout and trainer alike; LoRA's backward ≈ one forward
        assert flops["rollout_step_gflop"] == flops["train_forward_gflop"] > 0 and flops["backward_factor"] == 1
        per_pair = 2 * flops["train_forward_gflop"]  # forward + backward
        assert got["sample_gflop"] == pytest.approx(3 * flops["rollout_step_gflop"] + 2 * per_pair)
        assert got["peak_gib"] is None and got["mfu"] is None  # CPU
    steady, warm = results["steady"], results["first"]
    def num(v):  # as the table prints: 3 significant digits, no exponent from 100 up
        return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"

    row = f"| sample (its rollout + its 2 trained steps) | {num(steady['sample_s'])} s | {num(warm['sample_s'])} s |"
    assert row in printed
    assert f"| train pair | {num(steady['train_pair_ms'])} ms | {num(warm['train_pair_ms'])} ms |" in printed
    assert "| peak GPU memory | n/a (CPU) | n/a (CPU) |" in printed and "median of rollout 2 |" in printed
    assert "first-pass clipfrac (clip range 0.0001) | 0 | 0 |" in printed and "LoRA, input gradients only" in printed


def test_nft_table_says_na_where_its_loss_has_no_ratio_and_cleans_up(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli_main(["bench-train", "--recipe", "shapes-nft", *TINY, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert not Path(results["config"]["output_dir"]).exists()  # the temporary run folder is gone
    assert results["steady"]["sample_s"] > 0 and results["steady"]["first_pass_clipfrac"] is None
    assert "| first-pass clipfrac | n/a (nft has no ratio) | n/a (nft has no ratio) |" in printed
    assert "| first-pass mean \\|Δ log p\\| rollout vs trainer | n/a (nft has no ratio) |" in printed
    assert "1 forward(s) without gradients" in printed and "full finetune" in printed  # NFT's old policy
    assert "its 2 trained steps" in printed  # int(0.99 × 3) timesteps per sample
    assert "the run folder was temporary" in printed


def test_defaults_a_short_run_without_evaluation_that_flags_override():
    cfg = parse(["bench-train", "--recipe", "shapes-nft", "--device", "cpu"])
    assert cfg.train.rollout.num_rollout == 3 and cfg.train.eval.eval_images_per_category == 0
    assert cfg.train.algorithm.loss_type == "nft" and cfg.out is None and not cfg.checkpoints
    cfg = parse(["bench-train", "--num-rollout", "5", "--eval-images-per-category", "2", "--diffusion-sde-window-range",
                 "0,3", "--out", "t.json", "--checkpoints"])
    assert cfg.train.rollout.num_rollout == 5 and cfg.train.eval.eval_images_per_category == 2
    assert cfg.train.rollout.diffusion_sde_window_range == (0, 3) and str(cfg.out) == "t.json" and cfg.checkpoints


def test_refuses_ray_placement_and_resume(capsys):
    assert cli_main(["bench-train", "--device", "cpu", "--ray-engines", "1"]) == 2
    assert "not with Ray placement" in capsys.readouterr().err
    assert cli_main(["bench-train", "--device", "cpu", "--resume", "--output-dir", "x"]) == 2
    assert "--resume" in capsys.readouterr().err


def _record(k, rollout_s, train_s=None, pairs=8, **extra):
    r = {"rollout": k, "rollout/seconds": rollout_s, "rollout/images_per_s": 4 / rollout_s, **extra}
    if train_s is not None:
        r.update({"train/seconds": train_s, "train/pairs": pairs, "train/pairs_per_s": pairs / train_s})
    return r


def test_table_takes_medians_after_the_first_rollout_and_an_mfu_on_a_gpu():
    records = [{"rollout": 0}, _record(1, 40.0, 60.0, **{"memory/peak_gib": 30.0}),
               _record(2, 1.0, 2.0, **{"memory/peak_gib": 20.0}), _record(3, 3.0, 4.0, **{"memory/peak_gib": 22.0}),
               _record(4, 2.0, None), _record(5, 5.0, 1.0, **{"memory/peak_gib": 21.0})]
    flops = {"rollout_gflop_per_sample": 1000.0, "train_gflop_per_pair": 500.0, "how": "counted"}
    table = training_table(records, flops, peak_tflops=1.0)
    assert table["first"]["sample_s"] == 25.0 and table["steady_rollouts"] == [2, 3, 4, 5]
    steady = table["steady"]
    # Rollout 4 trained nothing: it counts for the rollout image, not for the sample or the pair.
    assert steady["rollout_image_s"] == pytest.approx(2.5 / 4) and steady["sample_s"] == 1.5
    assert steady["train_pair_ms"] == 250.0 and steady["peak_gib"] == 21.0
    # 2 pairs per sample: 1000 + 2 × 500 GFLOP in 1.5 s against 1 TFLOP/s.
    assert steady["sample_gflop"] == 2000.0 and steady["mfu"] == pytest.approx(2.0 / 1.5)
    text = format_table(table, "flow_grpo", on_gpu=True, peak_tflops=1.0, flops=flops)
    assert "| MFU, estimated (against 1 TFLOP/s) | 133.3% | 8.0% |" in text
    assert "| peak GPU memory | 21.0 GiB | 30.0 GiB |" in text and "median of rollouts 2–5" in text
    with pytest.raises(ValueError, match="no rollout"):
        training_table([{"rollout": 0}])


def test_model_flops_per_pair_count_what_the_model_needs_not_the_recompute():
    """MFU's FLOPs per train pair, in forwards: forward + backward (≈ 1 with LoRA, 2 for a full finetune) + the
    forwards without gradients (NFT's old policy, the KL reference); gradient checkpointing adds nothing."""
    def forwards(*flags):
        return train_forward_equivalents(parse(["train", *flags]))

    assert forwards("--recipe", "sd3-grpo") == 2  # LoRA Flow-GRPO without KL
    # No backward through CFG's unconditional half, and no forward of it either: the rollout hands it over.
    assert forwards("--recipe", "sd3-grpo", "--detach-uncond") == 1.0
    assert forwards("--recipe", "sd3-grpo", "--detach-uncond", "--no-reuse-rollout-uncond") == 1.5
    # Only the first of two optimizer steps holds the rollout's weights; engines elsewhere compute it.
    assert forwards("--recipe", "sd3-grpo", "--detach-uncond", "--num-steps-per-rollout", "2",
                    "--global-batch-size", "32") == 1.25
    assert forwards("--recipe", "sd3-grpo", "--detach-uncond", "--engine-urls", "http://127.0.0.1:1") == 1.5
    assert forwards("--recipe", "flux3-klein-nft-pickscore", "--detach-uncond") == 3  # NFT trains without CFG
    assert forwards("--recipe", "sd35-grpo-ocr") == 3  # + the KL reference
    assert forwards("--recipe", "flux3-klein-grpo-hps") == 3  # full finetune: a backward of 2
    assert forwards("--recipe", "flux3-klein-nft-pickscore") == 3  # LoRA + NFT's old policy
    assert (forwards("--recipe", "flux3-klein-nft-pickscore", "--no-gradient-checkpointing")
            == forwards("--recipe", "flux3-klein-nft-pickscore"))


def test_table_says_one_trained_step_in_the_singular():
    """A recipe training one step per sample (--diffusion-num-sde-steps 1) read 'its 1 trained steps'."""
    from diffrl.cli.bench_train import format_table

    row = {"trained_steps_per_sample": 1, "samples": 2, "sample_s": 0.5}
    text = format_table({"first": row, "steady": dict(row), "steady_rollouts": [2]}, on_gpu=False)
    assert "| sample (its rollout + its 1 trained step) |" in text
    row["trained_steps_per_sample"] = 9
    text = format_table({"first": row, "steady": None, "steady_rollouts": []}, on_gpu=False)
    assert "| sample (its rollout + its 9 trained steps) |" in text


def test_model_flops_per_pair_follow_each_methods_objective():
    """Every method's forwards per train pair, as its objective runs them: a preference pair holds 2 samples and a
    group row the whole group; the ODE methods train the conditional velocity alone, the SDE methods the CFG one."""
    from diffrl.cli.bench_train import trains_with_cfg

    def cfg(*flags):
        return parse(["train", "--recipe", "sd35-grpo-pickscore", "--kl-type", "v-based", *flags])

    lora = 1 + 1  # a LoRA pair's forward and its backward
    kl = 1  # the recipe's KL β 0.01: one reference forward
    assert train_forward_equivalents(cfg("--loss-type", "nft")) == lora + kl + 1  # + the old policy
    assert train_forward_equivalents(cfg("--loss-type", "awm")) == lora + kl  # one optimizer step per rollout
    assert train_forward_equivalents(cfg("--loss-type", "awm", "--num-steps-per-rollout", "2",
                                         "--global-batch-size", "32")) == lora + kl + 0.5
    assert train_forward_equivalents(cfg("--loss-type", "dpo")) == 2 * (lora + 1)  # two samples, the base each
    assert train_forward_equivalents(cfg("--loss-type", "dgpo")) == 16 * (lora + 1)  # a group of 16
    assert train_forward_equivalents(cfg("--loss-type", "crd")) == 16 * (lora + kl + 1)  # + the old snapshot
    assert train_forward_equivalents(cfg("--loss-type", "sft", "--diffusion-kl-beta", "0")) == lora
    assert trains_with_cfg(cfg("--loss-type", "grpo_guard")) and not trains_with_cfg(cfg("--loss-type", "awm"))
