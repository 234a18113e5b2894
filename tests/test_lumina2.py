"""The lumina2 family (Lumina-Image 2.0) against diffusers' Lumina2Pipeline, on a tiny random checkpoint built in
code."""

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from family_checks import (
    assert_registry_finds, assert_sample_k_is_the_same_in_any_microgroup, engine_images,
    pipeline_images, run_training,
)

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.lumina2 import Lumina2Family
from diffrl.models.random_checkpoints.lumina2 import save_random_checkpoint
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 9.6e-7; the pipeline runs CFG as two forwards, we run one in which
# the two texts' lengths differ, so the transformer masks the shorter one's padding).
TOLERANCE = 1e-5
PROMPT = "a red cat"  # 34 tokens behind the system prompt, of the tiny checkpoint's 48-token window
LONG_PROMPT = "a red cat on the mat of a blue dog and a green circle on a square of the blurry mat"  # truncated


@pytest.fixture(scope="module")
def lumina2_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "lumina2-tiny")


@pytest.fixture(scope="module")
def lumina2(lumina2_dir) -> Lumina2Family:
    return Lumina2Family.load(lumina2_dir)


@pytest.mark.parametrize(("prompt", "negative", "cfg", "normalized"), [
    (PROMPT, "blurry", 4.0, True),  # CFG with a negative prompt, renormalized (the pipeline's default)
    (PROMPT, "", 1.0, True),  # CFG off: one conditional forward per step
    (LONG_PROMPT, "", 5.0, True),  # a prompt filling the window (truncated), CFG against the empty prompt
    (PROMPT, "blurry", 4.0, False),  # a checkpoint that turns the renormalization off
], ids=["cfg", "no-cfg", "long-prompt", "cfg-unnormalized"])
def test_engine_reproduces_the_diffusers_pipeline(lumina2, prompt, negative, cfg, normalized):
    """ODE sampling through our engine gives Lumina2Pipeline's images from the same initial noise."""
    family = lumina2
    if not normalized:
        family = copy.copy(lumina2)  # the same components, another setting
        family.settings = replace(lumina2.settings, cfg_normalization=False)
    height, width, steps, seed = 32, 48, 4, 3
    ours = engine_images(family, prompt, negative, cfg, seed, steps, height, width)
    # The engine's initial noise (output i has seed + i), as the pipeline takes `latents`.
    noise = family.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = pipeline_images(family, prompt, negative, cfg, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline_images(family, "a green dog", negative, cfg, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail
    if not normalized:  # the setting reaches the guidance
        renormalized = pipeline_images(lumina2, prompt, negative, cfg, noise, steps, height, width)
        assert (renormalized - reference).abs().max() > 100 * TOLERANCE


def test_conditioning_is_the_pipelines_gemma_encoding(lumina2):
    """A text's two encodings are the pipeline's: as a prompt (behind the system prompt) and as a negative prompt
    (alone), Gemma2's second-to-last layer with the tokenizer's mask; a forward reads the first, CFG's negative
    rows the second."""
    cond = lumina2.encode_prompts([PROMPT, LONG_PROMPT])
    as_prompt, as_negative = Lumina2Family.encodings(cond.embeds)
    pipe = lumina2.reference_pipeline()
    embeds, mask, negative, negative_mask = pipe.encode_prompt(
        [PROMPT, LONG_PROMPT], True, negative_prompt=[PROMPT, LONG_PROMPT], device="cpu", max_sequence_length=48)
    torch.testing.assert_close(as_prompt[..., :-1], embeds.float(), rtol=0, atol=0)
    torch.testing.assert_close(as_negative[..., :-1], negative.float(), rtol=0, atol=0)
    assert torch.equal(as_prompt[..., -1], mask.float()) and torch.equal(as_negative[..., -1], negative_mask.float())
    assert mask.sum(dim=1).tolist() == [34, 48]  # <bos>, the system prompt, "<Prompt Start>", 3 words; truncated
    assert negative_mask.sum(dim=1).tolist() == [4, 22]  # <bos> and the words alone
    assert cond.embeds.shape == (2, 48, 2 * (lumina2.transformer.config.cap_feat_dim + 1))
    assert cond.ids.shape == (48, 1) and not cond.ids.any()
    uncond = lumina2.encode_prompts([""])
    both = lumina2.pair_conditionings(uncond, lumina2.encode_prompts([PROMPT]))
    tokens, keep = Lumina2Family.unpack_conditioning(both.embeds)
    assert keep.sum(dim=1).tolist() == [1, 34]  # the empty negative prompt is <bos> alone, as the pipeline's


def test_defaults_and_schedule_are_the_pipelines(lumina2):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.lumina2.pipeline_lumina2 import calculate_shift

    assert (lumina2.default_guidance_scale, lumina2.default_num_inference_steps) == (4.0, 30)
    assert lumina2.default_size() == (32, 32) and lumina2.settings.max_sequence_length == 48  # the tiny checkpoint
    assert lumina2.settings.cfg_normalization
    assert lumina2.task_type == "T2I" and not lumina2.accepts_image_conditioning
    steps = 6
    for config in (lumina2.scheduler.config, {**lumina2.scheduler.config, "use_dynamic_shifting": True}):
        family = copy.copy(lumina2)
        family.scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        # The pipeline's μ is of `latents.shape[1]`: the latent channel count of its unpacked latents.
        scheduler.set_timesteps(sigmas=[1 - k / steps for k in range(steps)],
                                mu=calculate_shift(lumina2.vae.config.latent_channels))
        torch.testing.assert_close(family.sigmas(steps, 48, 64), scheduler.sigmas.float(), rtol=0, atol=1e-7)


def test_sample_k_is_the_same_in_any_microgroup(lumina2):
    assert_sample_k_is_the_same_in_any_microgroup(lumina2, guidance_scale=3.0, negative_prompt="blurry", height=32,
                                                  width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(lumina2):
    """A training micro-batch mixes timesteps and prompts (text of different lengths, which the transformer masks):
    each row's velocity equals that row alone."""
    cond = lumina2.encode_prompts([PROMPT, LONG_PROMPT, PROMPT])
    latents = lumina2.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = lumina2.velocity(lumina2.transformer, latents, sigma, cond, None, 1.0)
    for i in range(3):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = lumina2.velocity(lumina2.transformer, row, sigma[i : i + 1], PromptEmbeds(cond.embeds[i : i + 1],
                                                                                          cond.ids), None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_registry_finds_the_family_by_name_and_by_transformer_class(lumina2_dir, tmp_path, monkeypatch):
    assert_registry_finds(Lumina2Family, lumina2_dir, tmp_path, ("Lumina-Image-2.0", "lumina2-sft"), monkeypatch)


def test_bad_requests_are_refused(lumina2):
    """Text to image only: an image-conditioned request is refused, as by every text-only family; so is a size that
    is not a multiple of the VAE's factor times the 2×2 patch, or beyond the transformer's RoPE table."""
    engine = Engine(lumina2, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: Lumina-Image 2.0 needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))  # 16 at real size (an f8 VAE)
    with pytest.raises(RequestError, match="width=132: this Lumina-Image 2.0 checkpoint makes at most 128 pixels"):
        engine.generate(RolloutRequest(prompt="a cat", height=32, width=132))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_conditioning_round_trips_the_wire(lumina2):
    cond = lumina2.encode_prompts([PROMPT])
    wire = lumina2.cond_kwargs_to_wire(cond, lumina2.prepare_latents(make_generators([0]), 32, 48).ids)
    width = lumina2.transformer.config.cap_feat_dim
    assert wire["encoder_hidden_states"][0].shape == wire["negative_encoder_hidden_states"][0].shape == (48, width)
    assert wire["encoder_attention_mask"].shape == wire["negative_encoder_attention_mask"].shape == (48,)
    back, image_ids = Lumina2Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids) and image_ids is None
    with pytest.raises(ValueError, match="negative_encoder_attention_mask"):
        Lumina2Family.cond_kwargs_from_wire({**wire, "negative_encoder_attention_mask": torch.ones(3)})


def test_rollout_conditioning_survives_the_json_wire(lumina2):
    """A rollout's conditioning (both encodings of each text, both CFG halves) in sglang's JSON response format and
    back: the same tensors, so a trainer behind HTTP replays the engine's forward."""
    from diffrl.serving import sglang

    req = RolloutRequest(prompt=PROMPT, negative_prompt="blurry", seed=1, num_outputs_per_prompt=2, height=32,
                         width=32, num_inference_steps=2, guidance_scale=3.0, rollout=True,
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    ran = Engine(lumina2, EngineConfig(max_outputs_per_request=4)).generate(sglang.engine_request(req))
    got = sglang.decode_response(sglang.encode_response(ran, req, lumina2, "r"), req, Lumina2Family)
    sent = ran[0].denoising_env
    for key in ("prompt_embeds", "negative_prompt_embeds", "text_ids"):
        assert torch.equal(got[0].denoising_env[key], sent[key]), key


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_lumina2(lumina2_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, CFG 2 with the empty negative prompt, renormalized) and of DiffusionNFT
    (full)."""
    records = run_training(lumina2_dir, tmp_path / "run", loss_type, lora, guidance=2.0,
                           extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2
