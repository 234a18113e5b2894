"""diffrl evaluate and diffrl compare judge either the shapes world or a prompt set (--prompt-data with --reward): a
flag of the other kind was silently ignored (`--num-seeds 4` with --prompt-data evaluated one image per prompt); it is
refused in one line naming the flag and what this kind takes instead, before any model loads."""

import pytest

from diffrl.cli.main import main


@pytest.mark.parametrize("argv, message", [
    (["evaluate", "--prompt-data", "P", "--reward", "jpeg_compressibility", "--num-seeds", "4"],
     "--num-seeds is for the shapes world, not --prompt-data: with --prompt-data use --n-samples-per-eval-prompt"),
    (["evaluate", "--prompt-data", "P", "--reward", "jpeg_compressibility", "--split", "train"],
     "--split is for the shapes world, not --prompt-data"),
    (["evaluate", "--n-samples-per-eval-prompt", "4"],
     "--n-samples-per-eval-prompt goes with --prompt-data and --reward (without them the shapes world is used); "
     "the shapes world's is --num-seeds"),
    (["evaluate", "--negative-prompt", "blurry"],
     "--negative-prompt goes with --prompt-data and --reward (without them the shapes world is used)"),
    (["evaluate", "--num-seeds", "2", "--images-per-category", "8"],
     "--images-per-category sets the seeds per prompt itself: pass it or --num-seeds, not both"),
    (["compare", "--trained", "T", "--prompt-data", "P", "--reward", "jpeg_compressibility", "--num-seeds", "4"],
     "--num-seeds is for the shapes world, not --prompt-data: with --prompt-data use --n-samples-per-eval-prompt"),
    (["compare", "--trained", "T", "--prompt-data", "P", "--reward", "jpeg_compressibility",
      "--base-guidance-scale", "2"], "--base-guidance-scale is for the shapes world, not --prompt-data: with "
     "--prompt-data use --guidance-scale (the base with CFG; without CFG it runs at 1)"),
    (["compare", "--trained", "T", "--num-frames", "3"],
     "--num-frames goes with --prompt-data and --reward (without them the shapes world is used)"),
])
def test_a_flag_of_the_other_kind_of_evaluation_is_refused(tmp_path, capsys, argv, message):
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    subs = {"P": str(tmp_path / "prompts.txt"), "T": "diffrl/assets/demo-shapes"}
    out = tmp_path / "out"
    assert main([subs.get(a, a) for a in argv] + ["--output-dir", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not out.exists()


@pytest.mark.parametrize("flags, message", [
    (["--prompt-data", "P", "--category-sampling", "adaptive"],
     "--category-sampling adaptive draws shapes categories; a --prompt-data set has none"),
    (["--prompt-data", "P", "--val-images-per-category", "4"],
     "--val-images-per-category scores shapes train prompts to keep checkpoints/best"),
    (["--input-key", "caption"], "--input-key caption picks the prompt of a --prompt-data .jsonl file"),
    (["--n-samples-per-eval-prompt", "4"], "--n-samples-per-eval-prompt 4 is for --prompt-data; the shapes world's"),
])
def test_train_refuses_a_flag_that_its_task_would_ignore(tmp_path, capsys, flags, message):
    """Shapes-world flags with --prompt-data, and prompt-set flags without it, were silently ignored by diffrl train."""
    (tmp_path / "prompts.txt").write_text("a red cat\n")
    argv = ["train", "--recipe", "shapes-nft", "--device", "cpu", "--reward", "jpeg_compressibility",
            "--output-dir", str(tmp_path / "run"), *[str(tmp_path / "prompts.txt") if f == "P" else f for f in flags]]
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().startswith(f"error: {message}")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("argv, message", [
    (["train", "--recipe", "shapes-nft", "--diffusion-sde-window-range", "0,2"],
     "--diffusion-sde-window-range sets the SDE steps of Flow-GRPO and its relatives; --loss-type nft does not read "
     "it (drop it, or use --loss-type flow_grpo or grpo_guard)"),
    (["train", "--recipe", "shapes-grpo", "--loss-type", "sft", "--diffusion-clip-range=1e-3"],
     "--diffusion-clip-range sets the clipped policy ratio; --loss-type sft does not read it "
     "(drop it, or use --loss-type flow_grpo or grpo_guard or awm or dgpo)"),
    (["train", "--recipe", "shapes-nft", "--dpo-beta", "500"],
     "--dpo-beta sets --loss-type dpo's own settings; --loss-type nft does not read it (drop it, or use --loss-type "
     "dpo)"),
    (["bench-train", "--recipe", "shapes-grpo", "--nft-ema-max", "0.3"],
     "--nft-ema-max sets DiffusionNFT's loss and old policy; --loss-type flow_grpo does not read it "
     "(drop it, or use --loss-type nft)"),
])
def test_a_flag_only_another_objective_reads_is_refused(tmp_path, capsys, argv, message):
    """An NFT run given Flow-GRPO's SDE window (as docs/recipes.md's dry run passes it to a GRPO recipe) ignored it."""
    assert main([*argv, "--device", "cpu", "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not (tmp_path / "run").exists()


def test_a_recipes_own_values_for_another_objective_are_kept_when_switching_loss_type():
    """sd35-grpo-ocr sets an SDE window; --loss-type nft on it is accepted (nothing on the command line is ignored)."""
    from diffrl.cli.main import parse

    cfg = parse(["train", "--recipe", "sd35-grpo-ocr", "--loss-type", "nft", "--device", "cpu"])
    assert cfg.algorithm.loss_type == "nft" and cfg.rollout.diffusion_sde_window_range == (0, 9)


@pytest.mark.parametrize("flag, value", [("--diffusion-guidance-scale", "-1"), ("--diffusion-noise-level", "-0.5"),
                                         ("--eval-guidance-scale", "-2"), ("--lr", "-1")])
def test_a_negative_scale_or_rate_is_refused_naming_the_flag(tmp_path, capsys, flag, value):
    """A negative CFG scale reached the engine's request schema after the model loaded and the run folder was made
    (a pydantic ValidationError of four lines); a negative --lr reached torch ('Invalid learning rate: -1.0')."""
    assert main(["train", "--recipe", "shapes-grpo", "--device", "cpu", flag, value,
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {flag} must be >= 0, got {float(value)}"
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flags, message", [
    (["--grad-clip", "-1"], "--grad-clip must be > 0 (inf: no clipping), got -1.0"),
    (["--diffusion-kl-beta", "-0.1"], "--diffusion-kl-beta must be >= 0, got -0.1"),
    (["--diffusion-clip-range", "0"], "--diffusion-clip-range must be > 0, got 0.0"),
    (["--diffusion-adv-clip-max", "-1"], "--diffusion-adv-clip-max must be > 0, got -1.0"),
    (["--use-ema", "--ema-decay", "2"], "--ema-decay must be in [0, 1], got 2.0"),
    (["--lr-schedule", "cosine", "--lr-min-ratio", "2"], "--lr-min-ratio must be in [0, 1], got 2.0"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0, got -1.0"),
    (["--time-budget-minutes", "-1"], "--time-budget-minutes must be > 0, got -1.0"),
    (["--rollout-microgroup-size", "0"], "--rollout-microgroup-size must be >= 1"),
    (["--engine-max-batch-outputs", "0"], "--engine-max-batch-outputs must be >= 1, got 0"),
    (["--eval-log-images", "-1"], "--eval-log-images must be >= 0, got -1"),
])
def test_values_that_would_train_silently_wrong_are_refused(tmp_path, capsys, flags, message):
    """Accepted before: a negative --grad-clip flipped the gradient (torch clamps the clip coefficient only from
    above), a negative KL pushed away from the reference, --lr-min-ratio 2 made the cosine schedule rise, a negative
    --time-budget-minutes stopped after one rollout, --eval-log-images -1 logged all but one image."""
    assert main(["train", "--recipe", "shapes-grpo", "--device", "cpu", *flags,
                 "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {message}"
    assert not (tmp_path / "run").exists()
