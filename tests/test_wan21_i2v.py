"""Wan2.1 image-to-video (the wan2_2 family with a CLIP image encoder): the source's CLIP embeddings condition every
block beside the first-frame latents. Against diffusers' WanImageToVideoPipeline on a tiny random checkpoint built
in code, then through training, the wire and replay."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint
from diffrl.models.wan2_2 import Wan22Family
from diffrl.sampling import make_generators
from family_checks import random_png, write_conditioned_prompt_set

TOLERANCE = 1e-5  # fp32 on CPU through two code paths
HEIGHT, WIDTH, FRAMES = 16, 32, 5


@pytest.fixture(scope="module")
def wan21_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.1-i2v-tiny", image_to_video=True,
                                  clip_image=True)


@pytest.fixture(scope="module")
def wan21(wan21_dir) -> Wan22Family:
    return Wan22Family.load(wan21_dir)  # the text window must be 512: the transformer reads image tokens before it


pytestmark = pytest.mark.usefixtures("wan_i2v_prompt_clean")


def png(seed: int, size=(20, 36)) -> bytes:
    return random_png(seed, size)


def _source(seed: int) -> torch.Tensor:
    return torch.from_numpy(np.array(Image.open(io.BytesIO(png(seed))))).permute(2, 0, 1)


def test_the_checkpoint_loads_its_image_encoder_and_one_expert(wan21):
    assert wan21.image_encoder is not None and wan21.transformer.transformer_2 is None
    assert wan21.image_embed_shape == (5, 16)  # 2×2 patches of 14 px and the class token; CLIP's width
    assert wan21.requires_image_conditioning and wan21.max_condition_images == 1


def _engine_videos(wan21, negative, guidance) -> torch.Tensor:
    outputs = Engine(wan21, EngineConfig(max_outputs_per_request=4)).generate(RolloutRequest(
        prompt="a red cat", negative_prompt=negative, seed=3, num_outputs_per_prompt=2, num_inference_steps=4,
        guidance_scale=guidance, height=HEIGHT, width=WIDTH, num_frames=FRAMES, image_path=[png(0)]))
    return torch.stack([o.generated_output for o in outputs])


@pytest.mark.parametrize(("negative", "guidance"), [("", 1.0), ("blurry", 4.5)], ids=["no-cfg", "cfg"])
def test_engine_reproduces_the_diffusers_pipeline_with_clip_embeddings(wan21, negative, guidance):
    """ODE sampling through our engine gives WanImageToVideoPipeline's videos from the same noise and source; with
    CFG both halves see the image tokens, as in the pipeline."""
    ours = _engine_videos(wan21, negative, guidance)
    noise = wan21.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH, FRAMES).tokens
    # One video per call: the pipeline repeats the image embeddings per prompt, not per video (num_videos_per_prompt
    # above 1 fails there).
    reference = torch.cat([wan21.reference_pipeline()(
        image=Image.open(io.BytesIO(png(0))), prompt="a red cat", negative_prompt=negative if guidance > 1 else None,
        guidance_scale=guidance, latents=noise[i:i + 1], num_inference_steps=4, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, output_type="pt").frames for i in range(2)]).permute(0, 2, 1, 3, 4)
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    # The image tokens matter: the same first frame through another image encoder gives other videos.
    weight = next(p for n, p in wan21.image_encoder.named_parameters() if n.endswith("layers.0.mlp.fc1.weight"))
    weight.data.mul_(3.0)
    try:
        moved = _engine_videos(wan21, negative, guidance)
    finally:
        weight.data.div_(3.0)
    assert (moved - ours).abs().max() > 100 * TOLERANCE


def test_the_embeddings_travel_in_the_conditioning_and_on_the_wire(wan21):
    encoded = wan21.encode_condition_images([_source(0)], height=HEIGHT, width=WIDTH, num_frames=FRAMES)
    condition_values = (4 + 4) * 2 * 2 * 4
    assert encoded.shape == (1, condition_values + 5 * 16)
    cond = wan21.condition_on_images(wan21.encode_prompts(["a red cat", "a dog"]), encoded)
    text, condition, image_embeds = wan21.unpack_conditioning(cond, torch.zeros(2, 4, 2, 2, 4))
    assert text.shape[1] == 512 and condition.shape == (2, 8, 2, 2, 4)
    torch.testing.assert_close(image_embeds[0], wan21._clip_embeds(_source(0))[0], rtol=0, atol=0)
    wire = wan21.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    back, _ = Wan22Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds[:1])


def test_training_and_replay_on_an_image_to_video_prompt_set(wan21_dir, tmp_path):
    """Flow-GRPO with CFG and a LoRA adapter: the trainer's first pass replays the engine's steps from the
    conditioning (CLIP tokens included), on policy."""
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    prompts = write_conditioned_prompt_set(tmp_path / "data", "i2v", ("the cat walks", "the dog runs"), png(0), png(1))
    cfg = TrainConfig.flat(
        output_dir=tmp_path / "run", model_path=wan21_dir, prompt_data=prompts, loss_type="flow_grpo", num_rollout=2,
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=4,
        num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=2, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, diffusion_guidance_scale=2.0, lr=1e-3, device="cpu", use_lora=True, lora_rank=2,
        reward="jpeg_compressibility", eval_images_per_category=0, checkpoint_interval=10,
        diffusion_sde_window_range=(0, 2))
    Trainer(cfg).train()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    assert trained[0]["train/log_prob_mean_abs_diff"] < 1e-5
