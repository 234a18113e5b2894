"""Checks every model family must pass, shared by the per-family test files."""

import json
from pathlib import Path

import torch

from diffrl.cli.main import main as cli_main
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models.checkpoint import load_model


def assert_sample_k_is_the_same_in_any_microgroup(family, **request) -> None:
    """The rollout contract (docs/architecture.md, "Rollout contract"): output i of a request seeded s equals a
    one-output request seeded s + i, bit for bit on CPU (images and SDE log-probs)."""
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    request = dict(prompt="a red cat", num_inference_steps=3, rollout=True, rollout_sde_step_indices=[0, 1], **request)
    together = engine.generate(RolloutRequest(seed=10, num_outputs_per_prompt=4, **request))
    for i, output in enumerate(together):
        alone = engine.generate(RolloutRequest(seed=10 + i, num_outputs_per_prompt=1, **request))[0]
        assert torch.equal(alone.generated_output, output.generated_output)
        assert torch.equal(alone.rollout_log_probs, output.rollout_log_probs)


def engine_images(family, prompt, negative, cfg, seed, steps, height, width) -> torch.Tensor:
    """Two outputs of one engine request (seeds `seed`, `seed + 1`): the engine's side of a pipeline-equality test."""
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt=prompt, negative_prompt=negative, seed=seed,
                                             num_outputs_per_prompt=2, num_inference_steps=steps,
                                             guidance_scale=cfg, height=height, width=width))
    return torch.stack([o.generated_output for o in outputs])


def pipeline_images(family, prompt, negative, cfg, noise, steps, height, width) -> torch.Tensor:
    """The family's diffusers pipeline from the same initial `noise`, for a pipeline whose `guidance_scale` is the
    engine's CFG scale (on above 1, with the negative prompt): the other side of a pipeline-equality test."""
    return family.reference_pipeline()(
        prompt=prompt, negative_prompt=negative if cfg > 1 else None, guidance_scale=cfg, latents=noise,
        num_inference_steps=steps, height=height, width=width, num_images_per_prompt=len(noise), output_type="pt",
        **family.reference_pipeline_kwargs()).images


def run_training(model_dir: Path, out: Path, loss_type: str, lora: bool, guidance: float,
                 video: dict | None = None, extra_flags: tuple[str, ...] = ()) -> list[dict]:
    """`diffrl train` on a tiny checkpoint of any family: one rollout, one update, a checkpoint that
    loads back with the update in it (LoRA adapters trained, or full weights moved). `video`: a video
    family's `resolution` and `num_frames` (its held-out shapes evaluation, which scores images, is off).
    Returns the run's metric records."""
    flags = ["train", "--model-path", str(model_dir), "--loss-type", loss_type, "--num-rollout", "1",
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2",
             "--global-batch-size", "4", "--num-steps-per-rollout", "1", "--micro-batch-size", "4",
             "--diffusion-num-steps", "2", "--diffusion-guidance-scale",
             str(guidance if loss_type == "flow_grpo" else 1.0), "--lr", "1e-3", "--eval-interval", "10",
             # Flow-GRPO's SDE window: another objective refuses the flag (it would not read it).
             *(["--diffusion-sde-window-range", "0", "2"] if loss_type == "flow_grpo" else []),
             "--eval-images-per-category", "0" if video else "1", "--checkpoint-interval", "1", "--device", "cpu",
             "--reward", "rewards_for_tests:darkness", "--output-dir", str(out),
             *(["--use-lora", "--lora-rank", "2"] if lora else ["--no-use-lora"]),
             *([f"--{k.replace('_', '-')}={v}" for k, v in video.items()] if video else []), *extra_flags]
    # In this process (as test_resume_faults and test_determinism call it): a `python -m diffrl.cli.main` child
    # spent ~15 s of the test importing torch and diffusers again. The module entry point and a run in its own
    # process stay covered by test_parallel.py and test_resume_faults.py's kill -9 test.
    assert cli_main(flags) == 0  # the CLI's exit status; its error is in the captured stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert trained and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4  # the trainer replays the engine's steps
    model = load_model(model_dir, out / "checkpoints" / "rollout-00001")
    weights = model.transformer.state_dict()
    if lora:
        assert any("lora_B" in name and w.abs().max() > 0 for name, w in weights.items())
    else:
        base = load_model(model_dir).transformer.state_dict()
        assert any(not torch.equal(w, base[name]) for name, w in weights.items())
    return records


def write_conditioned_prompt_set(folder: Path, name: str, prompts: tuple[str, str], first: bytes, second: bytes) -> Path:
    """A tiny prompt set whose rows carry condition images: `name`.jsonl beside its two PNGs, the first named by
    `image`, the second by `images` and found under images/ (Flow-Factory's layout)."""
    (folder / "images").mkdir(parents=True)
    (folder / "a.png").write_bytes(first)
    (folder / "images" / "b.png").write_bytes(second)
    rows = [{"prompt": prompts[0], "image": "a.png"}, {"prompt": prompts[1], "images": ["b.png"]}]
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def save_ltx2_i2v_checkpoint(path: Path) -> Path:
    """A tiny random LTX-2.3 checkpoint saved as LTX2ImageToVideoPipeline (the model index's pipeline class)."""
    from diffrl.models.random_checkpoints.ltx2 import save_random_checkpoint

    path = save_random_checkpoint(path)
    index = json.loads((path / "model_index.json").read_text())
    index["_class_name"] = "LTX2ImageToVideoPipeline"
    (path / "model_index.json").write_text(json.dumps(index))
    return path


def assert_registry_finds(family_cls, checkpoint_dir: Path, tmp_path: Path, names: tuple[str, ...], monkeypatch) -> None:
    """The registry picks `family_cls` for its checkpoint; for empty folders named as its checkpoints are (the name
    alone decides); for a copy under a name no family matches, its model index naming no family (the transformer
    class decides); and by its own name."""
    import shutil

    from diffrl.models.registry import resolve_family

    monkeypatch.delenv("DIFFRL_MODEL_FAMILY", raising=False)
    assert resolve_family(None, checkpoint_dir) is family_cls
    for name in names:
        (tmp_path / name).mkdir()
        assert resolve_family(None, tmp_path / name) is family_cls
    neutral = tmp_path / "my-model"
    shutil.copytree(checkpoint_dir, neutral)
    index = json.loads((neutral / "model_index.json").read_text())
    index.get("diffrl", {}).pop("family", None)
    (neutral / "model_index.json").write_text(json.dumps(index))
    assert resolve_family(None, neutral) is family_cls
    assert resolve_family(family_cls.name) is family_cls


def random_png(seed: int, size: tuple[int, int]) -> bytes:
    """A random RGB picture of `size` (height, width) as PNG bytes: a condition image for the editing and
    image-to-video tests."""
    import io

    import numpy as np
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()
