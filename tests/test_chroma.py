"""The chroma family (Chroma) against diffusers' ChromaPipeline, on a tiny random checkpoint built in code."""

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
from diffrl.models.chroma import ChromaFamily
from diffrl.models.random_checkpoints.chroma import save_random_checkpoint
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 1.1e-6; the pipeline runs CFG as two forwards, we run one).
TOLERANCE = 1e-5
PROMPT = "a red cat"  # 3 words + </s> of the tiny checkpoint's 16-token window
LONG_PROMPT = "a red cat on the mat of a blue dog and a green circle on a square of the blurry mat"  # truncated


@pytest.fixture(scope="module")
def chroma_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "chroma-tiny")


@pytest.fixture(scope="module")
def chroma(chroma_dir) -> ChromaFamily:
    return ChromaFamily.load(chroma_dir)


@pytest.mark.parametrize(("prompt", "negative", "cfg"), [
    (PROMPT, "blurry", 4.0),  # CFG with a negative prompt: both halves in one forward (the pipeline: two)
    (PROMPT, "", 1.0),  # CFG off: one conditional forward per step
    (LONG_PROMPT, "", 5.0),  # a prompt filling the window (nothing masked), CFG against the empty prompt
], ids=["cfg", "no-cfg", "long-prompt"])
def test_engine_reproduces_the_diffusers_pipeline(chroma, prompt, negative, cfg):
    """ODE sampling through our engine gives ChromaPipeline's images from the same initial noise."""
    height, width, steps, seed = 32, 48, 4, 3
    ours = engine_images(chroma, prompt, negative, cfg, seed, steps, height, width)
    # The engine's initial noise (output i has seed + i), packed as the pipeline takes `latents`.
    noise = chroma.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = pipeline_images(chroma, prompt, negative, cfg, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline_images(chroma, "a green dog", negative, cfg, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_conditioning_is_the_pipelines_t5_and_mask(chroma):
    """The T5 tokens (encoded with the tokenizer's mask) and the transformer's text mask (the prompt's tokens and
    one padding token) are the pipeline's own; the mask reaches the forward (changing it moves the velocity)."""
    cond = chroma.encode_prompts([PROMPT, LONG_PROMPT])
    tokens, keep = chroma.unpack_conditioning(cond.embeds)
    pipe = chroma.reference_pipeline()
    reference, mask = pipe._get_t5_prompt_embeds([PROMPT, LONG_PROMPT], max_sequence_length=16, device="cpu")
    torch.testing.assert_close(tokens, reference.float(), rtol=0, atol=0)
    assert torch.equal(keep, mask.float())
    assert keep[0].tolist() == [1.0] * 5 + [0.0] * 11  # "a red cat </s>" and one <pad>
    assert keep[1].tolist() == [1.0] * 16  # truncated: every token kept
    assert cond.embeds.shape == (2, 16, chroma.transformer.config.joint_attention_dim + 1)
    assert cond.ids.shape == (16, 3) and not cond.ids.any()
    latents = chroma.prepare_latents(make_generators([0]), 32, 32)
    sigma = torch.tensor([0.7])
    one = PromptEmbeds(cond.embeds[:1], cond.ids)
    base = chroma.velocity(chroma.transformer, latents, sigma, one, None, 1.0)
    unmasked = one.embeds.clone()
    unmasked[..., -1] = 1.0
    moved = chroma.velocity(chroma.transformer, latents, sigma, PromptEmbeds(unmasked, cond.ids), None, 1.0)
    assert (moved - base).abs().max() > 1e-4


def test_defaults_and_schedule_are_the_pipelines(chroma):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.chroma.pipeline_chroma import calculate_shift

    assert (chroma.default_guidance_scale, chroma.default_num_inference_steps) == (5.0, 35)
    assert chroma.default_size() == (32, 32) and chroma.settings.max_sequence_length == 16  # the tiny model index
    assert chroma.task_type == "T2I" and not chroma.accepts_image_conditioning
    steps, tokens = 6, (48 // chroma.pixels_per_token) * (64 // chroma.pixels_per_token)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(chroma.scheduler.config)
    scheduler.set_timesteps(sigmas=[1 - k / steps for k in range(steps)], mu=calculate_shift(tokens, 256, 4096, 0.5,
                                                                                              1.15))
    torch.testing.assert_close(chroma.sigmas(steps, 48, 64), scheduler.sigmas.float(), rtol=0, atol=1e-7)


def test_sample_k_is_the_same_in_any_microgroup(chroma):
    assert_sample_k_is_the_same_in_any_microgroup(chroma, guidance_scale=3.0, negative_prompt="blurry", height=32,
                                                  width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(chroma):
    """A training micro-batch mixes timesteps and prompts (with different masks): each row's velocity equals that
    row alone."""
    cond = chroma.encode_prompts([PROMPT, LONG_PROMPT, PROMPT])
    latents = chroma.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = chroma.velocity(chroma.transformer, latents, sigma, cond, None, 1.0)
    for i in range(3):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = chroma.velocity(chroma.transformer, row, sigma[i : i + 1], PromptEmbeds(cond.embeds[i : i + 1],
                                                                                        cond.ids), None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_registry_finds_the_family_by_name_and_by_transformer_class(chroma_dir, tmp_path, monkeypatch):
    assert_registry_finds(ChromaFamily, chroma_dir, tmp_path, ("Chroma1-HD", "chroma1-base"), monkeypatch)


def test_bad_requests_are_refused(chroma):
    """Text to image only: an image-conditioned request is refused, as by every text-only family; so is a size
    that is not a multiple of the packed patch."""
    engine = Engine(chroma, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: Chroma needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))  # 16 at real size
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_conditioning_round_trips_the_wire(chroma):
    cond = chroma.encode_prompts([PROMPT])
    ids = chroma.prepare_latents(make_generators([0]), 32, 48).ids
    wire = chroma.cond_kwargs_to_wire(cond, ids)
    assert wire["encoder_hidden_states"][0].shape == (16, chroma.transformer.config.joint_attention_dim)
    assert wire["prompt_attention_mask"].shape == (16,) and wire["txt_ids"].shape == (16, 3)
    back, image_ids = ChromaFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids) and torch.equal(image_ids, ids)
    with pytest.raises(ValueError, match="prompt_attention_mask"):
        ChromaFamily.cond_kwargs_from_wire({**wire, "prompt_attention_mask": wire["prompt_attention_mask"][:3]})



def test_rollout_conditioning_survives_the_json_wire(chroma):
    """A rollout's conditioning (T5 tokens and text mask, both CFG halves) in sglang's JSON response format and back:
    the same tensors, so a trainer behind HTTP replays the engine's forward."""
    from diffrl.serving import sglang

    req = RolloutRequest(prompt=PROMPT, negative_prompt="blurry", seed=1, num_outputs_per_prompt=2, height=32, width=32,
                         num_inference_steps=2, guidance_scale=3.0, rollout=True, rollout_return_dit_trajectory=True,
                         rollout_return_denoising_env=True)
    ran = Engine(chroma, EngineConfig(max_outputs_per_request=4)).generate(sglang.engine_request(req))
    got = sglang.decode_response(sglang.encode_response(ran, req, chroma, "r"), req, ChromaFamily)
    sent = ran[0].denoising_env
    for key in ("prompt_embeds", "negative_prompt_embeds", "text_ids", "image_ids"):
        assert torch.equal(got[0].denoising_env[key], sent[key]), key


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_chroma(chroma_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, CFG 2 with the empty negative prompt) and of DiffusionNFT (full)."""
    records = run_training(chroma_dir, tmp_path / "run", loss_type, lora, guidance=2.0,
                           extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2
