"""miles-diffusion's launch lines run as written: the training arguments of its four shipped diffusion scripts
(radixark/miles_diffusion `scripts/run-diffusion-grpo-{ocr,pickscore}-{2,4}gpu-flowgrpo-aligned.sh`, with the hub
ids and dataset paths as placeholders) and the flags the seeds' recipes use, each accepted (mapped or a true no-op)
or refused by name with the reason (`diffrl/cli/miles_flags.py`, docs/coming-from-miles.md)."""

import json

import pytest

from diffrl.cli.main import main, parse
from diffrl.cli.miles_flags import FLAGS, translate
from diffrl.recipes import recipe_config

SCRIPTS = {
    "ocr-2gpu": ["--train-backend", "fsdp", "--rollout-function-path", "miles.rollout.sglang_diffusion_rollout.generate_rollout", "--hf-checkpoint", "{model}", "--prompt-data", "{prompts}", "--input-key", "input", "--rollout-batch-size", "16", "--n-samples-per-prompt", "16", "--num-rollout", "100000", "--diffusion-microgroup-size", "16", "--micro-batch-size-sample", "4", "--micro-batch-size-tstep", "2", "--diffusion-train-iter-order", "sample_major", "--gradient-checkpointing", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "2", "--colocate", "--use-lora", "--lora-rank", "64", "--lora-alpha", "128", "--diffusion-init-lora-weight", "gaussian", "--lr", "3e-4", "--adam-beta2", "0.999", "--diffusion-clip-range", "1e-4", "--weight-decay", "1e-4", "--use-miles-router", "--sglang-server-concurrency", "4", "--update-weight-buffer-size", "2147483648", "--diffusion-model", "{model}", "--diffusion-reward", "ocr:1.0", "--advantage-estimator", "grpo", "--globalize-reward-std", "--rm-type", "ocr", "--fsdp-master-dtype", "fp32", "--fsdp-reduce-dtype", "fp32", "--diffusion-forward-dtype", "bf16", "--diffusion-num-steps", "10", "--diffusion-eval-num-steps", "50", "--num-steps-per-rollout", "2", "--diffusion-guidance-scale", "4.0", "--diffusion-true-cfg-scale", "4.0", "--diffusion-noise-level", "1.2", "--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.sde_window", "--diffusion-sde-window-size", "2", "--diffusion-sde-window-range", "3,5", "--diffusion-debug-mode", "--apply-sgld-monkey-patches", "--diffusion-height", "512", "--diffusion-width", "512", "--save", "{save}", "--save-interval", "10", "--eval-prompt-data", "ocr_test", "{eval_prompts}", "--eval-interval", "30", "--skip-eval-before-train"],
    "ocr-4gpu": ["--train-backend", "fsdp", "--rollout-function-path", "miles.rollout.sglang_diffusion_rollout.generate_rollout", "--hf-checkpoint", "{model}", "--prompt-data", "{prompts}", "--input-key", "input", "--rollout-batch-size", "32", "--n-samples-per-prompt", "16", "--num-rollout", "100000", "--diffusion-microgroup-size", "16", "--micro-batch-size-sample", "4", "--micro-batch-size-tstep", "2", "--diffusion-train-iter-order", "sample_major", "--gradient-checkpointing", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "4", "--colocate", "--use-lora", "--lora-rank", "64", "--lora-alpha", "128", "--diffusion-init-lora-weight", "gaussian", "--lr", "3e-4", "--adam-beta2", "0.999", "--diffusion-clip-range", "1e-4", "--weight-decay", "1e-4", "--use-miles-router", "--sglang-server-concurrency", "4", "--update-weight-buffer-size", "2147483648", "--diffusion-model", "{model}", "--diffusion-reward", "ocr:1.0", "--advantage-estimator", "grpo", "--globalize-reward-std", "--rm-type", "ocr", "--fsdp-master-dtype", "fp32", "--fsdp-reduce-dtype", "fp32", "--diffusion-forward-dtype", "bf16", "--diffusion-num-steps", "10", "--diffusion-eval-num-steps", "50", "--num-steps-per-rollout", "2", "--diffusion-guidance-scale", "4.0", "--diffusion-true-cfg-scale", "4.0", "--diffusion-noise-level", "1.2", "--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.sde_window", "--diffusion-sde-window-size", "2", "--diffusion-sde-window-range", "3,5", "--diffusion-debug-mode", "--apply-sgld-monkey-patches", "--diffusion-height", "512", "--diffusion-width", "512", "--save", "{save}", "--save-interval", "10", "--eval-prompt-data", "ocr_test", "{eval_prompts}", "--eval-interval", "30", "--skip-eval-before-train"],
    "pickscore-2gpu": ["--train-backend", "fsdp", "--rollout-function-path", "miles.rollout.sglang_diffusion_rollout.generate_rollout", "--hf-checkpoint", "{model}", "--prompt-data", "{prompts}", "--input-key", "input", "--rollout-batch-size", "16", "--n-samples-per-prompt", "16", "--num-rollout", "100000", "--diffusion-microgroup-size", "16", "--micro-batch-size-sample", "4", "--micro-batch-size-tstep", "2", "--diffusion-train-iter-order", "sample_major", "--gradient-checkpointing", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "2", "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "3", "--colocate", "--use-lora", "--lora-rank", "64", "--lora-alpha", "128", "--diffusion-init-lora-weight", "gaussian", "--lr", "3e-4", "--adam-beta2", "0.999", "--diffusion-clip-range", "1e-4", "--weight-decay", "1e-4", "--use-miles-router", "--sglang-server-concurrency", "4", "--update-weight-buffer-size", "2147483648", "--diffusion-model", "{model}", "--diffusion-reward", "pickscore:1.0", "--advantage-estimator", "grpo", "--globalize-reward-std", "--rm-type", "pickscore", "--pickscore-num-workers", "1", "--pickscore-num-gpus-per-worker", "1.0", "--pickscore-batch-size", "8", "--pickscore-processor-path", "{processor}", "--pickscore-model-path", "{pickscore}", "--fsdp-master-dtype", "fp32", "--fsdp-reduce-dtype", "fp32", "--diffusion-forward-dtype", "bf16", "--diffusion-num-steps", "10", "--diffusion-eval-num-steps", "50", "--num-steps-per-rollout", "2", "--diffusion-guidance-scale", "4.0", "--diffusion-true-cfg-scale", "4.0", "--diffusion-noise-level", "1.2", "--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.sde_window", "--diffusion-sde-window-size", "2", "--diffusion-sde-window-range", "3,5", "--diffusion-debug-mode", "--apply-sgld-monkey-patches", "--diffusion-height", "512", "--diffusion-width", "512", "--save", "{save}", "--save-interval", "10", "--eval-prompt-data", "pickscore_test", "{eval_prompts}", "--eval-interval", "30", "--skip-eval-before-train"],
    "pickscore-4gpu": ["--train-backend", "fsdp", "--rollout-function-path", "miles.rollout.sglang_diffusion_rollout.generate_rollout", "--hf-checkpoint", "{model}", "--prompt-data", "{prompts}", "--input-key", "input", "--rollout-batch-size", "32", "--n-samples-per-prompt", "16", "--num-rollout", "100000", "--diffusion-microgroup-size", "8", "--micro-batch-size-sample", "8", "--micro-batch-size-tstep", "1", "--diffusion-train-iter-order", "sample_major", "--gradient-checkpointing", "--actor-num-gpus-per-node", "4", "--rollout-num-gpus", "4", "--rollout-num-gpus-per-engine", "1", "--num-gpus-per-node", "5", "--colocate", "--use-lora", "--lora-rank", "64", "--lora-alpha", "128", "--diffusion-init-lora-weight", "gaussian", "--lr", "3e-4", "--adam-beta2", "0.999", "--diffusion-clip-range", "1e-4", "--weight-decay", "1e-4", "--use-miles-router", "--sglang-server-concurrency", "4", "--update-weight-buffer-size", "2147483648", "--diffusion-model", "{model}", "--diffusion-reward", "pickscore:1.0", "--advantage-estimator", "grpo", "--globalize-reward-std", "--rm-type", "pickscore", "--pickscore-num-workers", "1", "--pickscore-num-gpus-per-worker", "1.0", "--pickscore-batch-size", "8", "--pickscore-processor-path", "{processor}", "--pickscore-model-path", "{pickscore}", "--fsdp-master-dtype", "fp32", "--fsdp-reduce-dtype", "fp32", "--diffusion-forward-dtype", "bf16", "--diffusion-num-steps", "10", "--diffusion-eval-num-steps", "50", "--num-steps-per-rollout", "2", "--diffusion-guidance-scale", "4.0", "--diffusion-true-cfg-scale", "4.0", "--diffusion-noise-level", "1.2", "--diffusion-step-strategy-path", "miles.rollout.step_strategy_hub.sde_window", "--diffusion-sde-window-size", "2", "--diffusion-sde-window-range", "3,5", "--apply-sgld-monkey-patches", "--diffusion-height", "512", "--diffusion-width", "512", "--save", "{save}", "--save-interval", "10", "--eval-prompt-data", "pickscore_test", "{eval_prompts}", "--eval-interval", "30", "--skip-eval-before-train"],
}
WANDB = ["--use-wandb", "--wandb-project", "miles-diffusion-grpo", "--wandb-group", "run", "--wandb-key", "KEY",
         "--diffusion-log-images", "8", "--diffusion-log-image-interval", "10", "--disable-wandb-random-suffix"]
ONE_GPU = {"--actor-num-gpus-per-node": "1", "--rollout-num-gpus": "1", "--num-gpus-per-node": "1"}


def _filled(args, tmp_path, **layout):
    """A script's arguments with local paths for its placeholders (and, given, other GPU counts)."""
    model, prompts = tmp_path / "qwen-image", tmp_path / "train.jsonl"
    prompts.write_text(json.dumps({"input": 'a sign that says "hello"'}) + "\n")
    values = dict(model=str(model), prompts=str(prompts), eval_prompts=str(prompts), save=str(tmp_path / "save"),
                  pickscore=str(tmp_path / "pickscore"), processor=str(tmp_path / "clip"))
    out = [a.format(**values) for a in args]
    for flag, value in layout.items():
        out[out.index(flag) + 1] = value
    return out


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_every_flag_of_the_shipped_scripts_is_accepted_or_refused_by_name(script, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "KEY")
    args = _filled(SCRIPTS[script] + WANDB, tmp_path)
    # As written: a multi-GPU layout on one process is refused, naming the layout and the launch line that runs it.
    with pytest.raises(ValueError, match=r"--actor-num-gpus-per-node \(miles-diffusion\): a layout of \d trainer GPUs: "
                                         r"launch it as `torchrun --nproc-per-node \d"):
        translate(args)
    # Under torchrun with the trainer's GPU count it is diffrl's own layout: every other flag is then translated.
    gpus = args[args.index("--actor-num-gpus-per-node") + 1]
    monkeypatch.setenv("WORLD_SIZE", gpus)
    miles = translate(args)
    left = [a for a in miles.args if a.startswith("--")]
    assert not set(left) & (set(FLAGS) | {"--hf-checkpoint", "--micro-batch-size-sample", "--diffusion-reward",
                                         "--rm-type", "--wandb-key", "--colocate"})
    noted = " ".join(miles.notes)
    for flag in (a for a in args if a.startswith("--") and a not in left):
        assert flag in noted, f"{flag} is translated without a start-up line"


def test_the_resolved_config_is_the_recipes_where_they_describe_the_same_run(tmp_path, monkeypatch):
    """The 4-GPU PickScore script is qwen-image-grpo-pickscore (the recipe follows it): every setting both name."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    cfg = parse(["train", *_filled(SCRIPTS["pickscore-4gpu"], tmp_path), "--device", "cpu"])
    cfg.check()  # consistent as a whole (the batch sizes, the layout under torchrun)
    recipe = recipe_config("qwen-image-grpo-pickscore", "cpu")
    same = ["lr", "adam_beta2", "weight_decay", "diffusion_clip_range", "lora_rank", "lora_alpha", "use_lora",
            "diffusion_num_steps", "eval_num_steps", "diffusion_guidance_scale", "diffusion_noise_level",
            "diffusion_sde_window_range", "diffusion_num_sde_steps", "globalize_reward_std", "rollout_batch_size",
            "n_samples_per_prompt", "rollout_microgroup_size", "num_steps_per_rollout", "micro_batch_size",
            "mixed_precision", "gradient_checkpointing", "height", "width"]
    ours, theirs = cfg.as_flat_dict(), recipe.as_flat_dict()
    ours_size = (ours["height"], ours["width"])
    theirs.update(height=theirs["resolution"], width=theirs["resolution"])  # the recipe says 512 as --resolution
    assert ours_size == (512, 512)
    assert {k: ours[k] for k in same} == {k: theirs[k] for k in same}
    assert cfg.task.reward.startswith("pickscore@") and ",processor=" in cfg.task.reward
    assert cfg.engine.engine_concurrency == 4 and cfg.eval.eval_before_train is False
    assert cfg.checkpoint.checkpoint_interval == 10 and cfg.task.input_key == "input"


@pytest.mark.parametrize(("miles", "diffrl"), [
    (["--sglang-server-concurrency", "4"], ["--engine-concurrency", "4"]),
    (["--diffusion-microgroup-size", "8"], ["--rollout-microgroup-size", "8"]),
    (["--diffusion-true-cfg-scale", "4.0"], ["--diffusion-guidance-scale", "4.0"]),
    (["--micro-batch-size-sample", "4", "--micro-batch-size-tstep", "2"], ["--micro-batch-size", "8"]),
    (["--diffusion-height", "512", "--diffusion-width", "768"], ["--height", "512", "--width", "768"]),
    (["--diffusion-eval-num-steps", "50"], ["--eval-num-steps", "50"]),
    (["--fsdp-master-dtype", "fp32"], []),
    (["--diffusion-forward-dtype", "bf16"], ["--mixed-precision", "bf16"]),
    (["--hf-checkpoint", "/m/qwen"], ["--model-path", "/m/qwen"]),
    (["--save", "/runs/x", "--save-interval", "10"], ["--output-dir", "/runs/x", "--checkpoint-interval", "10"]),
    (["--diffusion-reward", "pickscore:1.0,ocr:0.5"], ["--reward", "multi:pickscore=1.0,ocr=0.5"]),
    (["--pickscore-reward-colocate"], ["--reward-colocate"]),
    (["--diffusion-init-lora-weight", "gaussian"], []),
    (["--diffusion-train-iter-order", "timestep_major"], []),
    (["--rollout-fetch-in-parser", "--rollout-parser-num-workers", "8"], []),
    (["--diffusion-task", "t2i"], []),
    (["--skip-eval-before-train"], ["--no-eval-before-train"]),
    (["--extra-args", "--sglang-server-concurrency 2 --lr 1e-4"], ["--engine-concurrency", "2", "--lr", "1e-4"]),
])
def test_the_seeds_flags_resolve_to_the_documented_setting(miles, diffrl):
    out = translate(miles)
    assert out.args == diffrl and len(out.notes) >= 1


@pytest.mark.parametrize(("miles", "reason"), [
    (["--train-backend", "megatron"], "diffrl accepts fsdp here"),
    (["--fsdp-master-dtype", "bf16"], "fp32 masters"),
    (["--diffusion-init-lora-weight", "kaiming"], "start Gaussian"),
    (["--diffusion-task", "i2v"], "reads each prompt row's condition images from --prompt-data"),
    (["--diffusion-true-cfg-scale", "4", "--diffusion-guidance-scale", "3"], "one CFG scale"),
    (["--rm-type", "hps", "--diffusion-reward", "ocr:1"], "names no reward"),
    (["--wandb-key", "secret"], "set WANDB_API_KEY"),
    (["--diffusion-sde-window-size"], "expects 1 value"),
    (["--rollout-patch-group"], "no such setting: a rollout's prompt groups go to the engines as microgroups"),
])
def test_what_diffrl_does_not_do_is_refused_in_one_line(miles, reason, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(ValueError, match=reason):
        translate(miles)


def test_a_shipped_launch_line_runs_one_rollout_on_one_machine(tmp_path, capsys):
    """The 2-GPU OCR script as written, on one CPU: its layout made one GPU's, its batch made small (flags after
    it override, as on any command line), on a tiny Qwen-Image checkpoint."""
    from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint

    args = _filled(SCRIPTS["ocr-2gpu"], tmp_path, **ONE_GPU)
    save_random_checkpoint(tmp_path / "qwen-image")
    small = ["--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--diffusion-microgroup-size", "2",
             "--micro-batch-size-sample", "2", "--diffusion-num-steps", "2", "--diffusion-sde-window-range", "0,2",
             "--diffusion-height", "64", "--diffusion-width", "64", "--num-rollout", "1", "--device", "cpu",
             "--no-gradient-checkpointing", "--eval-num-prompts", "0", "--lora-rank", "2"]
    assert main(["train", *args, *small]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "miles-diffusion flag --sglang-server-concurrency 4 → --engine-concurrency 4" in out
    records = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert any("rollout/reward/raw_mean" in r for r in records)


def test_the_page_names_every_flag_it_translates():
    from pathlib import Path

    from diffrl.cli.miles_flags import _COMBINED

    page = (Path(__file__).parents[1] / "docs/coming-from-miles.md").read_text()
    missing = [flag for flag in (*FLAGS, *_COMBINED) if f"`{flag}" not in page and f", {flag}" not in page]
    assert not missing, f"docs/coming-from-miles.md does not name {missing}"


@pytest.mark.slow  # torchrun with two gloo ranks; the default run covers the same line on one process above
def test_a_two_gpu_launch_line_runs_as_laid_out_under_torchrun(tmp_path):
    """The 2-GPU OCR script with its layout as written, launched as its layout asks (`torchrun --nproc-per-node 2`,
    two gloo ranks on a CPU): --colocate is each rank's own engine, one rollout runs, rank 0 writes the run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint

    save_random_checkpoint(tmp_path / "qwen-image")
    small = ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--diffusion-microgroup-size", "2",
             "--micro-batch-size-sample", "2", "--diffusion-num-steps", "2", "--diffusion-sde-window-range", "0,2",
             "--diffusion-height", "64", "--diffusion-width", "64", "--num-rollout", "1", "--device", "cpu",
             "--no-gradient-checkpointing", "--eval-num-prompts", "0", "--lora-rank", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           "29561", "-m", "diffrl.cli.main", "train", *_filled(SCRIPTS["ocr-2gpu"], tmp_path), *small],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--colocate: nothing to set (under torchrun each rank's engine shares its process and GPU)" in done.stdout
    records = [json.loads(line) for line in (tmp_path / "save" / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in records] == [0, 1]
