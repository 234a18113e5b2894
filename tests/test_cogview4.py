"""The cogview4 family (CogView4) against diffusers' CogView4Pipeline, on a tiny random checkpoint built in code."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import (
    assert_registry_finds, assert_sample_k_is_the_same_in_any_microgroup, engine_images,
    pipeline_images, run_training,
)

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.cogview4 import CogView4Family
from diffrl.models.random_checkpoints.cogview4 import save_random_checkpoint
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 1.5e-6; the pipeline runs CFG as two forwards, we run one, and
# we recover its unshifted timestep from σ).
TOLERANCE = 1e-5
PROMPT = "a red cat"  # [gMASK] <sop> + 3 words: 11 pads on the left to 16 tokens
LONG_PROMPT = " ".join(["a red cat on the mat of a blue dog"] * 3)  # 32 tokens: two windows of 16


@pytest.fixture(scope="module")
def cogview4_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "cogview4-tiny")


@pytest.fixture(scope="module")
def cogview4(cogview4_dir) -> CogView4Family:
    return CogView4Family.load(cogview4_dir)


@pytest.mark.parametrize(("prompt", "negative", "cfg"), [
    (PROMPT, "blurry", 4.0),  # CFG with a negative prompt of the same 16 tokens: both halves in one forward
    (PROMPT, "", 1.0),  # CFG off: one conditional forward per step
    (LONG_PROMPT, "", 5.0),  # 32 text tokens against the empty prompt's 16: two forwards, as the pipeline's
], ids=["cfg", "no-cfg", "long-prompt"])
def test_engine_reproduces_the_diffusers_pipeline(cogview4, prompt, negative, cfg):
    """ODE sampling through our engine gives CogView4Pipeline's images from the same initial noise."""
    height, width, steps, seed = 32, 48, 4, 3
    ours = engine_images(cogview4, prompt, negative, cfg, seed, steps, height, width)
    # The engine's initial noise (output i has seed + i), as the pipeline takes `latents`.
    noise = cogview4.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = pipeline_images(cogview4, prompt, negative, cfg, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline_images(cogview4, "a green dog", negative, cfg, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_conditioning_is_the_pipelines_glm_states(cogview4):
    """GLM's second-to-last hidden states over the prompt left-padded to a multiple of 16, as the pipeline computes
    them for the prompt alone; a batch of prompts of different lengths is zero-padded at the end with the mask
    channel 0 there."""
    cond = cogview4.encode_prompts([PROMPT, LONG_PROMPT])
    pipe = cogview4.reference_pipeline()
    for row, prompt, length in ((0, PROMPT, 16), (1, LONG_PROMPT, 32)):
        reference = pipe._get_glm_embeds(prompt, max_sequence_length=64, device="cpu")
        assert reference.shape[1] == length
        torch.testing.assert_close(cond.embeds[row, :length, :-1], reference[0].float(), rtol=0, atol=0)
        assert cond.embeds[row, :length, -1].eq(1).all() and not cond.embeds[row, length:].any()
    assert cond.embeds.shape == (2, 32, cogview4.transformer.config.text_embed_dim + 1)
    assert cond.ids.shape == (32, 1) and not cond.ids.any()
    ids = cogview4.tokenizer([PROMPT]).input_ids[0]
    assert ids[:2] == cogview4.tokenizer.convert_tokens_to_ids(["[gMASK]", "<sop>"]) and len(ids) == 5


def test_defaults_schedule_and_timesteps_are_the_pipelines(cogview4):
    """The scheduler's sigmas for the pipeline's integer timesteps shifted by CogView4's μ, and the transformer's
    timestep: the pipeline's unshifted one, not σ·1000."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.cogview4.pipeline_cogview4 import calculate_shift

    assert (cogview4.default_guidance_scale, cogview4.default_num_inference_steps) == (5.0, 50)
    assert cogview4.default_size() == (32, 32) and cogview4.settings.max_sequence_length == 64  # the tiny index
    assert cogview4.task_type == "T2I" and not cogview4.accepts_image_conditioning
    steps, height, width = 6, 48, 64
    tokens = (height // cogview4.pixels_per_token) * (width // cogview4.pixels_per_token)
    timesteps = np.linspace(1000, 1.0, steps).astype(np.int64).astype(np.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(cogview4.scheduler.config)
    scheduler.set_timesteps(timesteps=timesteps, sigmas=timesteps / 1000, mu=calculate_shift(tokens, 256, 0.25, 0.75))
    sigmas = cogview4.sigmas(steps, height, width)
    torch.testing.assert_close(sigmas, scheduler.sigmas.float(), rtol=0, atol=1e-7)
    model_t = cogview4.transformer_timesteps(sigmas[:-1], height, width)
    torch.testing.assert_close(model_t, scheduler.timesteps.float(), rtol=0, atol=1e-3)
    assert (sigmas[1:-2] * 1000 - model_t[1:-1]).abs().min() > 10  # the shift moved the inner steps


def test_sample_k_is_the_same_in_any_microgroup(cogview4):
    assert_sample_k_is_the_same_in_any_microgroup(cogview4, guidance_scale=3.0, negative_prompt="blurry", height=32,
                                                  width=32)


def test_trainer_batch_of_mixed_lengths_and_timesteps_is_row_wise(cogview4):
    """A training micro-batch mixes timesteps and prompts of different lengths (zero-padded): each row's velocity
    equals that row alone, unpadded."""
    cond = cogview4.encode_prompts([PROMPT, LONG_PROMPT, PROMPT])
    latents = cogview4.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = cogview4.velocity(cogview4.transformer, latents, sigma, cond, None, 1.0)
    for i, prompt in enumerate([PROMPT, LONG_PROMPT, PROMPT]):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = cogview4.velocity(cogview4.transformer, row, sigma[i : i + 1], cogview4.encode_prompts([prompt]),
                                  None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_registry_finds_the_family_by_name_and_by_transformer_class(cogview4_dir, tmp_path, monkeypatch):
    assert_registry_finds(CogView4Family, cogview4_dir, tmp_path, ("CogView4-6B", "cogview-4-finetune"), monkeypatch)


def test_bad_requests_and_checkpoints_are_refused(cogview4, cogview4_dir, tmp_path):
    """Text to image only: an image-conditioned request is refused, as by every text-only family; so is a size the
    pipeline refuses (not a multiple of 16), and a scheduler whose dynamic shift is not CogView4's linear one."""
    engine = Engine(cogview4, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=24: CogView4 needs a positive multiple of 16"):
        engine.generate(RolloutRequest(prompt="a cat", height=24, width=32))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"
    exponential = tmp_path / "cogview4-exponential"
    shutil.copytree(cogview4_dir, exponential)
    config = exponential / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace('"linear"', '"exponential"'))
    with pytest.raises(ModelLoadError, match="time_shift_type='linear'"):
        CogView4Family.load(exponential)


def test_conditioning_round_trips_the_wire(cogview4):
    cond = cogview4.encode_prompts([PROMPT])
    wire = cogview4.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    assert wire["encoder_hidden_states"][0].shape == (16, cogview4.transformer.config.text_embed_dim)
    back, image_ids = CogView4Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids) and image_ids is None
    padded = PromptEmbeds(torch.nn.functional.pad(cond.embeds, (0, 0, 0, 16)), torch.zeros(32, 1))
    assert torch.equal(cogview4.cond_kwargs_to_wire(padded, torch.zeros(0, 1))["encoder_hidden_states"][0],
                       wire["encoder_hidden_states"][0])  # a trainer's zero padding stays off the wire


def test_rollout_conditioning_survives_the_json_wire(cogview4):
    """A rollout's conditioning (a 32-token prompt and a 16-token negative prompt) in sglang's JSON response format
    and back: the same tensors, so a trainer behind HTTP replays the engine's forward."""
    from diffrl.serving import sglang

    req = RolloutRequest(prompt=LONG_PROMPT, negative_prompt="blurry", seed=1, num_outputs_per_prompt=2, height=32,
                         width=32, num_inference_steps=2, guidance_scale=3.0, rollout=True,
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    ran = Engine(cogview4, EngineConfig(max_outputs_per_request=4)).generate(sglang.engine_request(req))
    got = sglang.decode_response(sglang.encode_response(ran, req, cogview4, "r"), req, CogView4Family)
    sent = ran[0].denoising_env
    assert sent["prompt_embeds"].shape[1] == 32 and sent["negative_prompt_embeds"].shape[1] == 16
    for key in ("prompt_embeds", "negative_prompt_embeds", "text_ids"):
        assert torch.equal(got[0].denoising_env[key], sent[key]), key


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_cogview4(cogview4_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, CFG 2 with the empty negative prompt) and of DiffusionNFT (full)."""
    records = run_training(cogview4_dir, tmp_path / "run", loss_type, lora, guidance=2.0,
                           extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2
