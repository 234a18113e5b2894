"""The flux1 family (FLUX.1 [dev] and [schnell]) against diffusers' FluxPipeline, on tiny random checkpoints built
in code."""

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
from diffrl.models.base import Latents
from diffrl.models.flux1 import Flux1Family
from diffrl.models.random_checkpoints.flux1 import save_random_checkpoint
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 8.4e-7; the pipeline runs true CFG as two forwards, we run one).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux1-dev-tiny")


@pytest.fixture(scope="module")
def schnell_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux1-schnell-tiny", guidance_embeds=False)


@pytest.fixture(scope="module")
def dev(dev_dir) -> Flux1Family:
    return Flux1Family.load(dev_dir)


@pytest.fixture(scope="module")
def schnell(schnell_dir) -> Flux1Family:
    return Flux1Family.load(schnell_dir)


def _diffusers_images(family, prompt, negative, cfg, noise, steps, height, width):
    """FluxPipeline's images: its `guidance_scale` is the embedded guidance (the checkpoint's), its
    `true_cfg_scale` with a negative prompt is the engine's CFG scale."""
    return family.reference_pipeline()(
        prompt=prompt, negative_prompt=negative if cfg > 1 else None, true_cfg_scale=cfg, latents=noise,
        num_inference_steps=steps, height=height, width=width, num_images_per_prompt=len(noise), output_type="pt",
        **family.reference_pipeline_kwargs()).images


@pytest.mark.parametrize(("variant", "negative", "cfg"), [
    ("dev", "blurry", 4.0),  # embedded guidance 3.5 plus true CFG: both halves in one forward
    ("dev", "", 1.0),  # embedded guidance only, one forward per step (the published FLUX.1 [dev] setting)
    ("schnell", "", 1.0),  # no guidance embedding, static shift
    ("schnell", "blurry", 3.0),
], ids=["dev-cfg", "dev-no-cfg", "schnell", "schnell-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(request, variant, negative, cfg):
    """ODE sampling through our engine gives FluxPipeline's images from the same initial noise."""
    family = request.getfixturevalue(variant)
    height, width, steps, seed = 32, 48, 4, 3
    ours = engine_images(family, "a red cat", negative, cfg, seed, steps, height, width)
    noise = family.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = _diffusers_images(family, "a red cat", negative, cfg, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _diffusers_images(family, "a green dog", negative, cfg, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_variants_and_their_settings(dev, schnell):
    """dev embeds the checkpoint's guidance in every forward (a setting of the checkpoint, not of a request);
    schnell has no embedding and defaults to 4 steps and a 256-token T5 window."""
    assert dev.embedded_guidance == 3.5 and schnell.embedded_guidance is None
    assert dev.default_num_inference_steps == 50 and schnell.default_num_inference_steps == 4
    assert dev.settings.max_sequence_length == 16  # the tiny checkpoint's model_index sets it
    assert dev.default_guidance_scale == schnell.default_guidance_scale == 1.0
    cond = dev.encode_prompts(["a red cat"])
    assert cond.embeds.shape == (1, 16 + 1, dev.transformer.config.joint_attention_dim) and cond.ids.shape == (17, 3)
    latents = dev.prepare_latents(make_generators([0]), 32, 32)
    side = 32 // dev.pixels_per_token  # the tiny VAE downsamples 2×, then 2×2 patches
    assert latents.tokens.shape == (1, side * side, 16) and torch.equal(latents.ids[:, 0], torch.zeros(side * side))
    assert latents.ids[side + 1].tolist() == [0.0, 1.0, 1.0]
    sigma = torch.tensor([0.7])
    base = dev.velocity(dev.transformer, latents, sigma, cond, None, 1.0)
    dev.settings.guidance = 5.0
    try:
        moved = dev.velocity(dev.transformer, latents, sigma, cond, None, 1.0)
    finally:
        dev.settings.guidance = 3.5
    assert (moved - base).abs().max() > 1e-4
    # The pooled vector is the conditioning's last token: changing it changes the velocity.
    pooled = cond.embeds.clone()
    pooled[:, -1] += 1.0
    moved = dev.velocity(dev.transformer, latents, sigma, type(cond)(pooled, cond.ids), None, 1.0)
    assert (moved - base).abs().max() > 1e-4


def test_schedule_is_the_pipelines(dev, schnell):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    steps, tokens = 6, (48 // dev.pixels_per_token) * (64 // dev.pixels_per_token)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(dev.scheduler.config)
    mu = calculate_shift(tokens, 256, 4096, 0.5, 1.15)
    scheduler.set_timesteps(sigmas=[1 - k / steps for k in range(steps)], mu=mu)
    torch.testing.assert_close(dev.sigmas(steps, 48, 64), scheduler.sigmas.float(), rtol=0, atol=1e-7)
    plain = torch.linspace(1, 0, steps + 1)[:-1]
    torch.testing.assert_close(schnell.sigmas(steps, 48, 64)[:-1], plain, rtol=0, atol=1e-6)  # shift 1: none


def test_sample_k_is_the_same_in_any_microgroup(dev):
    assert_sample_k_is_the_same_in_any_microgroup(dev, guidance_scale=3.0, height=32, width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(dev):
    """A training micro-batch mixes timesteps and prompts: each row's velocity equals that row alone."""
    cond = dev.encode_prompts(["a red cat", "a blue dog", "a red cat"])
    latents = dev.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = dev.velocity(dev.transformer, latents, sigma, cond, None, 1.0)
    for i in range(3):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = dev.velocity(dev.transformer, row, sigma[i : i + 1], type(cond)(cond.embeds[i : i + 1], cond.ids),
                             None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_registry_finds_the_family_by_name_and_by_transformer_class(dev_dir, tmp_path, monkeypatch):
    assert_registry_finds(Flux1Family, dev_dir, tmp_path, ("FLUX.1-dev", "flux1-schnell"), monkeypatch)


def test_bad_requests_are_refused(dev):
    engine = Engine(dev, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: FLUX.1 needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))  # 16 at real size
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_conditioning_round_trips_sglangs_cond_kwargs(dev):
    cond = dev.encode_prompts(["a red cat"])
    ids = dev.prepare_latents(make_generators([0]), 32, 48).ids
    wire = dev.cond_kwargs_to_wire(cond, ids)
    assert wire["pooled_projections"].shape == (dev.transformer.config.pooled_projection_dim,)
    assert wire["txt_ids"].shape == (16, 3) and wire["encoder_hidden_states"][0].shape[0] == 16
    back, image_ids = Flux1Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids) and torch.equal(image_ids, ids)


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_flux1_dev(dev_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, true CFG on top of the embedded guidance) and of DiffusionNFT (full)."""
    records = run_training(dev_dir, tmp_path / "run", loss_type, lora, guidance=2.0, extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2


def test_few_step_grpo_on_flux1_schnell(schnell_dir, tmp_path):
    """The timestep-distilled checkpoint trains with Flow-GRPO's SDE over its few steps (2 here), without CFG."""
    run_training(schnell_dir, tmp_path / "run", "flow_grpo", True, guidance=1.0)


def test_flux1_grpo_recipe_is_flow_grpos_setting(dev_dir):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    cfg = parse(["train", "--recipe", "flux1-grpo-pickscore", "--model-path", str(dev_dir)])
    m, r, o = cfg.model, cfg.rollout, cfg.optim
    assert (m.diffusion_model_family, cfg.algorithm.loss_type, m.size()) == ("flux1", "flow_grpo", (512, 512))
    assert (m.lora_rank, m.lora_alpha, r.diffusion_num_steps, r.diffusion_guidance_scale) == (64, 128.0, 6, 1.0)
    assert (r.diffusion_sde_window_range, r.diffusion_num_sde_steps, r.diffusion_noise_level) == ((0, 5), 5, 0.9)
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout) == (48, 24, 2)
    validate_config(cfg)
