"""The hunyuan_video15 family (text to video) against diffusers' HunyuanVideo15Pipeline, on a tiny random checkpoint
built in code."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.hunyuan_video15 import HunyuanVideo15Family
from diffrl.models.random_checkpoints.hunyuan_video15 import save_random_checkpoint
from diffrl.models.registry import get_family, resolve_family
from diffrl.sampling import make_generators

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (pixels in [0, 1])
HEIGHT, WIDTH, FRAMES = 16, 32, 5  # latents [4, 2, 1, 2]: 2 latent frames of 1 × 2 tokens
PROMPT = 'a sign that says "hello"'  # a quoted text: the ByT5 glyph encoder runs too


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "hunyuanvideo-1.5-tiny")


@pytest.fixture(scope="module")
def family(model_dir) -> HunyuanVideo15Family:
    return HunyuanVideo15Family.load(model_dir)


def _pipeline_videos(family, prompt, negative, guidance, noise, steps):
    """HunyuanVideo15Pipeline's videos as [B, C, F, H, W] (it returns frames first)."""
    frames = family.reference_pipeline()(
        prompt=prompt, negative_prompt=negative if guidance > 1 else None, latents=noise, num_inference_steps=steps,
        guidance_scale=guidance, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_videos_per_prompt=len(noise),
        output_type="pt").frames
    return frames.permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize(("negative", "guidance"), [("blurry", 4.5), ("", 1.0)], ids=["cfg", "no-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(family, negative, guidance):
    """ODE sampling through our engine gives HunyuanVideo15Pipeline's videos from the same noise."""
    steps, seed = 2, 3
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt=PROMPT, negative_prompt=negative, seed=seed,
                                             num_outputs_per_prompt=2, num_inference_steps=steps,
                                             guidance_scale=guidance, height=HEIGHT, width=WIDTH, num_frames=FRAMES))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = family.prepare_latents(make_generators([seed, seed + 1]), HEIGHT, WIDTH, num_frames=FRAMES).tokens
    reference = _pipeline_videos(family, PROMPT, negative, guidance, noise, steps)
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    assert 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _pipeline_videos(family, "a green dog", negative, guidance, noise, steps)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail
    if guidance > 1:  # the negative prompt is used
        unguided = _pipeline_videos(family, PROMPT, "a red cat", guidance, noise, steps)
        assert (unguided - reference).abs().max() > 100 * TOLERANCE


def test_sample_k_is_the_same_in_any_microgroup(family):
    assert_sample_k_is_the_same_in_any_microgroup(family, guidance_scale=4.5, height=HEIGHT, width=WIDTH,
                                                  num_frames=FRAMES)


def test_a_mixed_micro_batch_equals_its_rows_alone(family):
    """A training micro-batch of two prompts at two timesteps gives each row the velocity it gets alone, bit for bit
    on CPU (the per-row modulations and the text refiner's pooled-text MLP run row by row)."""
    cond = family.encode_prompts([PROMPT, "a red cat"])
    latents = family.prepare_latents(make_generators([0, 1]), HEIGHT, WIDTH, num_frames=FRAMES)
    sigma = torch.tensor([0.9, 0.3])
    both = family.velocity(family.transformer, latents, sigma, cond, None, 1.0)
    for i in range(2):
        alone = family.velocity(family.transformer, Latents(latents.tokens[i : i + 1], latents.ids), sigma[i : i + 1],
                                PromptEmbeds(cond.embeds[i : i + 1], cond.ids), None, 1.0)
        assert torch.equal(alone, both[i : i + 1])


def test_the_registry_resolves_the_family(model_dir, tmp_path):
    """By the folder's name, by the transformer's class in a folder named otherwise, and by its own name."""
    assert resolve_family(None, model_dir) is HunyuanVideo15Family
    renamed = tmp_path / "some-checkpoint"
    shutil.copytree(model_dir, renamed)
    index = json.loads((renamed / "model_index.json").read_text())
    del index["diffrl"]["family"]
    (renamed / "model_index.json").write_text(json.dumps(index))
    assert resolve_family(None, renamed) is HunyuanVideo15Family
    assert get_family("hunyuan_video15") is HunyuanVideo15Family


def test_defaults_and_schedule(family, model_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert family.default_num_frames == 121 and family.default_num_inference_steps == 50
    assert family.default_guidance_scale == 6.0  # the checkpoint's guider
    assert family.default_size() == (48, 80)  # the pipeline's 16:9 bucket at the tiny target size (64)
    assert family.task_type == "T2V"
    scheduler = FlowMatchEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, 7)[:-1])
    torch.testing.assert_close(family.sigmas(6, HEIGHT, WIDTH), scheduler.sigmas.float())
    assert json.loads((model_dir / "model_index.json").read_text())["diffrl"]["text_tokens"] == 24


@pytest.mark.parametrize(("fields", "field"), [
    (dict(height=24), "height"), (dict(num_frames=6), "num_frames"),
    (dict(image_path=["data:image/png;base64,AAAA"]), "image_path"),
])
def test_bad_requests_are_refused_by_name(family, fields, field):
    """Text to video only: a condition image is refused, as are sizes the VAE cannot take."""
    engine = Engine(family)
    request = dict(prompt="a cat", height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=1)
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(**{**request, **fields}))
    assert err.value.field == field


def test_other_pipelines_and_other_guiders_are_refused_at_load(model_dir, tmp_path):
    """Another pipeline class (HunyuanVideo 1.0's) and a guider the family does not reproduce. Image to video
    (HunyuanVideo15ImageToVideoPipeline) is tests/test_hunyuan_video15_i2v.py's."""
    broken = tmp_path / "hunyuanvideo-1.5-broken"
    shutil.copytree(model_dir, broken)
    index = broken / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "HunyuanVideoPipeline"}))
    with pytest.raises(ModelLoadError, match="a HunyuanVideoPipeline checkpoint; the family samples text to video"):
        HunyuanVideo15Family.load(broken)
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "HunyuanVideo15Pipeline"}))
    guider = broken / "guider" / "guider_config.json"
    guider.write_text(json.dumps({**json.loads(guider.read_text()), "guidance_rescale": 0.7}))
    with pytest.raises(ModelLoadError, match="not plain CFG"):
        HunyuanVideo15Family.load(broken)


def test_conditioning_crosses_the_wire(family):
    cond = family.encode_prompts([PROMPT])
    wire = family.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    back, _ = HunyuanVideo15Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds)
    assert wire["encoder_attention_mask_2"].sum() > 0  # the quoted text reached ByT5


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_run(model_dir, tmp_path, loss_type, lora):
    """A 2-rollout-sample `diffrl train` on the tiny checkpoint: Flow-GRPO with LoRA (its replay matches the
    rollout's log-probs), DiffusionNFT on the full weights."""
    run_training(model_dir, tmp_path / "run", loss_type, lora, guidance=4.5,
                 video=dict(resolution=HEIGHT, num_frames=FRAMES))
