"""Compiled Flow-GRPO on the image-conditioned families (editing and image to video), at bf16 autocast as their GPU
recipes would run: the in-process engine samples in the trainer's compiled graph with the condition images folded
into the conditioning, so the trainer's replay runs the graphs the rollout compiled (it compiles none of its own:
a graph of its own is what drifts on a GPU) and its first pass replays the rollout's log-probs exactly
(|Δ log p| 0, clipfrac 0); every kind of block ran compiled. On a CPU the inference graph happens to replay exactly
too, so the shared graphs are the check that the mechanism holds; the GPU figures are measured on the GPU."""

from pathlib import Path

import pytest
import torch

from diffrl.cli.main import parse
from diffrl.train.trainer import Trainer
from family_checks import save_ltx2_i2v_checkpoint, write_conditioned_prompt_set
from test_compile import needs_compiler
from test_forward_graph import _graphs_per_kind


def _png(seed: int, size: tuple[int, int]) -> bytes:
    from test_flux2_flux3_edit import png

    return png(seed, size)


def _kontext(path: Path) -> Path:
    from diffrl.models.random_checkpoints.flux1 import save_random_checkpoint

    return save_random_checkpoint(path, kontext=True)


def _qwen_edit(path: Path) -> Path:
    from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint

    return save_random_checkpoint(path, edit="QwenImageEditPlusPipeline")


def _flux3(path: Path) -> Path:
    from diffrl.models.random_checkpoints.flux3_image import save_random_checkpoint

    return save_random_checkpoint(path)


def _flux2_klein(path: Path) -> Path:
    from test_flux2_flux3_edit import save_flux2, tiny_flux2

    return save_flux2(path, tiny_flux2("klein"))


def _wan_i2v(path: Path) -> Path:
    from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint

    return save_random_checkpoint(path, image_to_video=True)


def _wan21_i2v(path: Path) -> Path:
    from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint

    return save_random_checkpoint(path, image_to_video=True, clip_image=True)


# checkpoint builder, the condition images' size (height, width), the run's size and step flags
IMAGE = ["--height", "32", "--width", "48", "--diffusion-num-steps", "2", "--diffusion-guidance-scale", "2.0",
         "--diffusion-sde-window-range", "0", "2"]
CASES = {
    "flux1-kontext": (_kontext, (32, 48), IMAGE),
    "qwen-image-edit-plus": (_qwen_edit, (32, 48), IMAGE),
    "flux3-image-edit": (_flux3, (64, 96), IMAGE),
    "flux2-klein-edit": (_flux2_klein, (64, 96), IMAGE),
    "wan2.2-i2v": (_wan_i2v, (20, 36), ["--height", "16", "--width", "32", "--num-frames", "5",
                                        "--diffusion-num-steps", "2", "--diffusion-guidance-scale", "4.5",
                                        "--diffusion-sde-window-range", "0", "2"]),
    "wan2.1-i2v": (_wan21_i2v, (20, 36), ["--height", "16", "--width", "32", "--num-frames", "5",
                                          "--diffusion-num-steps", "2", "--diffusion-guidance-scale", "4.5",
                                          "--diffusion-sde-window-range", "0", "2"]),
    "ltx-2.3-i2v": (save_ltx2_i2v_checkpoint, (60, 100),
                    ["--height", "64", "--width", "96", "--num-frames", "9", "--diffusion-num-steps", "3",
                     "--diffusion-sde-type", "cps", "--diffusion-noise-level", "0.8", "--diffusion-guidance-scale",
                     "1.0", "--diffusion-sde-window-range", "0", "3", "--diffusion-num-sde-steps", "2"]),
}


# Qwen-Image wraps its modulation (`img_mod`) row-wise (models/batch_invariance.py): one path for rows that share a
# timestep, another for mixed ones. Its replay ran the second (a graph of its own) until the trainer's micro-batches
# held one trained step each (`Objective.micro_batch_key`); this case is the check.
@pytest.mark.slow  # about a minute of inductor per family on 2 cores
@needs_compiler
@pytest.mark.parametrize("case", sorted(CASES))
def test_compiled_conditioned_replay_is_exact(case, tmp_path):
    build, size, flags = CASES[case]
    prompts = write_conditioned_prompt_set(tmp_path / "data", "set", ("make the cat red", "the dog runs"),
                                           _png(0, size), _png(1, size))
    assert_compiled_replay_exact(build(tmp_path / f"{case}-tiny"), ["--prompt-data", str(prompts), *flags], tmp_path)


def assert_compiled_replay_exact(model_dir: Path, flags: list[str], tmp_path: Path) -> None:
    """One rollout of compiled LoRA Flow-GRPO at bf16 (2 prompts × 2 samples) and its update: the engine samples in
    the trainer's graph, the replay compiles no graph of its own, every block kind ran compiled, and the first pass
    is exact."""
    torch._dynamo.reset()
    cfg = parse(["train", "--model-path", str(model_dir), "--loss-type", "flow_grpo",
                 "--num-rollout", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
                 "--rollout-microgroup-size", "2", "--global-batch-size", "4", "--num-steps-per-rollout", "1",
                 "--micro-batch-size", "4", "--use-lora", "--lora-rank", "2", "--lr", "1e-3", "--device", "cpu",
                 "--reward", "jpeg_compressibility", "--eval-interval", "10", "--checkpoint-interval", "10",
                 "--compile", "--mixed-precision", "bf16", "--output-dir", str(tmp_path / "run"), *flags])
    trainer = Trainer(cfg)
    assert trainer.engine.config.forward_graph == "training"  # --engine-forward-graph auto's pick
    family, update, after_rollout = trainer.policy.family, trainer.update, {}

    def counted_update(*args, **kwargs):
        after_rollout.update(_graphs_per_kind(family))
        return update(*args, **kwargs)

    trainer.update = counted_update
    record = trainer.rollout_and_update(0)
    assert after_rollout and _graphs_per_kind(family) == after_rollout  # the replay compiled no graph of its own
    assert record["compile/uncompiled_block_kinds"] == 0.0
    assert record["train/log_prob_mean_abs_diff"] == 0.0 and record["train/first_pass_clipfrac"] == 0.0
    assert record["train/grad_norm"] > 0
