"""The z_image family (Z-Image and Z-Image-Turbo) against diffusers' ZImagePipeline, on tiny random checkpoints
built in code."""

from pathlib import Path

import pytest
import torch
from family_checks import (
    assert_registry_finds, assert_sample_k_is_the_same_in_any_microgroup, engine_images,
    run_training,
)

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.random_checkpoints.z_image import save_random_checkpoint
from diffrl.models.z_image import ZImageFamily, text_lengths
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 9e-7).
TOLERANCE = 1e-5
PROMPT = "a red cat"
LONG_PROMPT = "a very long prompt about a red circle and a blue square on a mat"  # truncated to the 64-token window


@pytest.fixture(scope="module")
def z_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "z-image-tiny")


@pytest.fixture(scope="module")
def turbo_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "z-image-turbo-tiny", turbo=True)


@pytest.fixture(scope="module")
def z_image(z_dir) -> ZImageFamily:
    return ZImageFamily.load(z_dir)


@pytest.fixture(scope="module")
def turbo(turbo_dir) -> ZImageFamily:
    return ZImageFamily.load(turbo_dir)


def _diffusers_images(family, prompt, negative, guidance, noise, steps, height, width):
    """ZImagePipeline's images. Its CFG scale is Z-Image's g (on above 0): the engine's scale s is 1 + g."""
    return family.reference_pipeline()(
        prompt=prompt, negative_prompt=negative if guidance > 1 else None, guidance_scale=guidance - 1.0,
        latents=noise, num_inference_steps=steps, height=height, width=width, num_images_per_prompt=len(noise),
        output_type="pt", **family.reference_pipeline_kwargs()).images


@pytest.mark.parametrize(("variant", "prompt", "negative", "guidance"), [
    ("z_image", PROMPT, "blurry", 5.0),  # CFG (g = 4): both halves in one forward, texts of different lengths
    ("z_image", PROMPT, "", 1.0),  # CFG off (g = 0): one forward per step
    ("z_image", LONG_PROMPT, "", 3.0),  # a prompt truncated to the window, CFG against the empty prompt
    ("turbo", PROMPT, "", 1.0),  # the few-step checkpoint as it samples
], ids=["cfg", "no-cfg", "long-prompt", "turbo"])
def test_engine_reproduces_the_diffusers_pipeline(request, variant, prompt, negative, guidance):
    """ODE sampling through our engine gives ZImagePipeline's images from the same initial noise."""
    family = request.getfixturevalue(variant)
    height, width, steps, seed = 32, 48, 4, 3
    ours = engine_images(family, prompt, negative, guidance, seed, steps, height, width)
    noise = family.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = _diffusers_images(family, prompt, negative, guidance, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _diffusers_images(family, "a green dog", negative, guidance, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_turbo_is_a_setting_of_the_family(z_image, turbo, tmp_path):
    assert (z_image.default_guidance_scale, z_image.default_num_inference_steps) == (6.0, 50)
    assert (turbo.default_guidance_scale, turbo.default_num_inference_steps) == (1.0, 9)
    assert not z_image.settings.turbo and turbo.settings.turbo
    assert ZImageFamily.read_settings(tmp_path / "Z-Image-Turbo", {}).turbo  # by name, without a diffrl block
    assert not ZImageFamily.read_settings(tmp_path / "Z-Image", {}).turbo


def test_conditioning_keeps_each_prompts_own_tokens(z_image):
    """Each prompt's real tokens and a mask channel; a batch of two lengths is zero-padded, and each row's velocity
    equals that prompt alone (the padding never reaches the transformer)."""
    ids, mask = z_image.text_window(PROMPT)
    assert ids.shape == mask.shape == (1, 64) and 0 < mask.sum() < 64 and not mask[0, -1]
    short, long = z_image.encode_prompts([PROMPT]), z_image.encode_prompts([LONG_PROMPT])
    assert text_lengths(short.embeds).tolist() == [int(mask.sum())] and text_lengths(long.embeds).tolist() == [64]
    both = z_image.encode_prompts([PROMPT, LONG_PROMPT])
    assert both.embeds.shape == (2, 64, z_image.transformer.config.cap_feat_dim + 1)
    torch.testing.assert_close(both.embeds[0, : short.embeds.shape[1]], short.embeds[0], rtol=0, atol=0)
    assert not both.embeds[0, short.embeds.shape[1]:].any()
    latents = z_image.prepare_latents(make_generators([0, 1]), 32, 32)
    sigma = torch.tensor([0.6, 0.6])
    together = z_image.velocity(z_image.transformer, latents, sigma, both, None, 1.0)
    for i, alone_cond in enumerate((short, long)):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = z_image.velocity(z_image.transformer, row, sigma[:1], alone_cond, None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-5)


def test_schedule_is_the_pipelines(z_image):
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(z_image.scheduler.config)
    scheduler.set_timesteps(sigmas=torch.linspace(1.0, 1 / 8, 8).tolist(), mu=0.7)  # static shift 3: μ unused
    torch.testing.assert_close(z_image.sigmas(8, 32, 48), scheduler.sigmas.float(), rtol=0, atol=0)


def test_cfg_is_z_image_form(z_image):
    v_u, v_c = torch.tensor([1.0]), torch.tensor([3.0])
    assert z_image.combine_guidance(v_u, v_c, 5.0, transformer=None, sigma=None).item() == 3.0 + 4.0 * 2.0


def test_sample_k_is_the_same_in_any_microgroup(z_image):
    assert_sample_k_is_the_same_in_any_microgroup(z_image, guidance_scale=4.0, height=32, width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(z_image):
    cond = z_image.encode_prompts([PROMPT, "a blue dog", PROMPT])
    latents = z_image.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = z_image.velocity(z_image.transformer, latents, sigma, cond, None, 1.0)
    for i in range(3):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        one = PromptEmbeds(cond.embeds[i : i + 1, : int(text_lengths(cond.embeds[i : i + 1])[0])], cond.ids)
        alone = z_image.velocity(z_image.transformer, row, sigma[i : i + 1], one, None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-5)


def test_registry_finds_the_family_by_name_and_by_transformer_class(z_dir, tmp_path, monkeypatch):
    assert_registry_finds(ZImageFamily, z_dir, tmp_path, ("Z-Image-Turbo", "zimage"), monkeypatch)


def test_bad_requests_are_refused(z_image):
    engine = Engine(z_image, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: Z-Image needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))  # 16 at real size
    with pytest.raises(RequestError, match="width=516: this Z-Image checkpoint makes at most 512 pixels a side"):
        engine.generate(RolloutRequest(prompt="a cat", height=32, width=516))  # its RoPE table's 128 positions
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_conditioning_round_trips_sglangs_cond_kwargs(z_image):
    cond = z_image.encode_prompts([PROMPT])
    wire = z_image.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    assert wire["encoder_hidden_states"][0].shape == (cond.embeds.shape[1], z_image.transformer.config.cap_feat_dim)
    back, _ = ZImageFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds)


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_z_image(z_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, with CFG) and of DiffusionNFT (full); the trainer zero-pads its batches'
    conditionings to one length."""
    records = run_training(z_dir, tmp_path / "run", loss_type, lora, guidance=3.0, extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2


def test_few_step_nft_on_z_image_turbo(turbo_dir, tmp_path):
    """The few-step checkpoint trains with DiffusionNFT on its few-step ODE rollouts (2 steps here, CFG off),
    every step's noise level kept."""
    run_training(turbo_dir, tmp_path / "run", "nft", True, guidance=1.0, extra_flags=("--nft-timestep-fraction", "1.0"))


@pytest.mark.parametrize(("recipe", "steps", "cfg"), [("z-image-grpo-pickscore", 10, 5.0),
                                                      ("z-image-turbo-grpo-pickscore", 6, 1.0)])
def test_z_image_recipes_are_flow_factorys_settings(z_dir, recipe, steps, cfg):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    config = parse(["train", "--recipe", recipe, "--model-path", str(z_dir)])
    m, r, o = config.model, config.rollout, config.optim
    assert (m.diffusion_model_family, config.algorithm.loss_type, m.size()) == ("z_image", "flow_grpo", (512, 512))
    assert (m.lora_rank, m.lora_alpha, r.diffusion_num_steps, r.diffusion_guidance_scale) == (64, 128.0, steps, cfg)
    assert (r.diffusion_sde_window_range, r.diffusion_num_sde_steps, r.diffusion_noise_level) == ((1, 4), 1, 0.7)
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout) == (48, 16, 2)
    validate_config(config)
