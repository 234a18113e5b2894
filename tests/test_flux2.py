"""The flux2 family (FLUX.2 [dev] and [klein], base and distilled) against diffusers' Flux2Pipeline and
Flux2KleinPipeline, on tiny random checkpoints built in code."""

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.flux2 import Flux2Family
from diffrl.models.random_checkpoints.flux2 import save_random_checkpoint, tiny
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 1.2e-6; the pipeline runs CFG as two forwards, we run one).
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux2-dev-tiny", tiny("dev"))


@pytest.fixture(scope="module")
def klein_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux2-klein-base-tiny", tiny("klein"))


@pytest.fixture(scope="module")
def distilled_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux2-klein-tiny", tiny("klein"),
                                  distilled=True)


@pytest.fixture(scope="module")
def dev(dev_dir) -> Flux2Family:
    return Flux2Family.load(dev_dir)


@pytest.fixture(scope="module")
def klein(klein_dir) -> Flux2Family:
    return Flux2Family.load(klein_dir)


@pytest.fixture(scope="module")
def distilled(distilled_dir) -> Flux2Family:
    return Flux2Family.load(distilled_dir)


def _diffusers_images(family, prompt, negative, cfg, noise, steps, height, width):
    """The variant's pipeline: dev's `guidance_scale` is its embedded guidance (the checkpoint's, from
    `reference_pipeline_kwargs`); klein's is CFG, against the empty prompt unless given a negative's embeddings."""
    pipe, kwargs = family.reference_pipeline(), family.reference_pipeline_kwargs()
    if family.settings.variant == "klein":
        kwargs["guidance_scale"] = cfg
        if cfg > 1:
            kwargs["negative_prompt_embeds"] = pipe.encode_prompt(
                negative, max_sequence_length=kwargs["max_sequence_length"],
                text_encoder_out_layers=kwargs["text_encoder_out_layers"])[0]
    grid = noise.transpose(1, 2).reshape(len(noise), -1, height // family.pixels_per_token,
                                         width // family.pixels_per_token)
    return pipe(prompt=prompt, latents=grid, num_inference_steps=steps, height=height, width=width,
                num_images_per_prompt=len(noise), output_type="pt", **kwargs).images


@pytest.mark.parametrize(("variant", "negative", "cfg", "guidance"), [
    ("dev", "", 1.0, 4.0),  # the embedded guidance alone, one forward per step (the published FLUX.2 [dev] setting)
    ("dev", "", 1.0, 2.5),  # another embedded value (a checkpoint setting) reaches every forward as the pipeline's
    ("klein", "blurry", 4.0, None),  # klein base: CFG, both halves in one forward
    ("klein", "", 1.0, None),
    ("distilled", "", 1.0, None),  # step-distilled klein: no CFG
], ids=["dev", "dev-guidance-2.5", "klein-cfg", "klein-no-cfg", "klein-distilled"])
def test_engine_reproduces_the_diffusers_pipeline(request, variant, negative, cfg, guidance):
    """ODE sampling through our engine gives the pipeline's images from the same initial noise."""
    family = request.getfixturevalue(variant)
    height, width, steps, seed = 32, 48, 4, 3
    if guidance is not None:
        family.settings.guidance = guidance
    try:
        engine = Engine(family, EngineConfig(max_outputs_per_request=4))
        outputs = engine.generate(RolloutRequest(prompt="a red cat", negative_prompt=negative, seed=seed,
                                                 num_outputs_per_prompt=2, num_inference_steps=steps,
                                                 guidance_scale=cfg, height=height, width=width))
        ours = torch.stack([o.generated_output for o in outputs])
        noise = family.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
        reference = _diffusers_images(family, "a red cat", negative, cfg, noise, steps, height, width)
        other = _diffusers_images(family, "a green dog", negative, cfg, noise, steps, height, width)
    finally:
        family.settings.guidance = 4.0
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    # The comparison can fail (dev's tiny encoder reads the prompt among FLUX.2's 33-token system message: 6e-4 apart).
    assert (other - reference).abs().max() > 10 * TOLERANCE


def test_variants_and_their_settings(dev, klein, distilled, tmp_path):
    """One family: the text encoder's class says the variant; dev embeds its guidance, klein has no embedding;
    the step-distilled klein samples 4 steps without CFG by default."""
    assert (dev.settings.variant, klein.settings.variant, distilled.settings.variant) == ("dev", "klein", "klein")
    assert dev.embedded_guidance == 4.0 and klein.embedded_guidance is None
    assert [(f.default_guidance_scale, f.default_num_inference_steps) for f in (dev, klein, distilled)] == [
        (1.0, 50), (4.0, 50), (1.0, 4)]
    assert not klein.settings.distilled and distilled.settings.distilled  # model_index.json's is_distilled
    assert Flux2Family.read_settings(tmp_path, {}).text_encoder_out_layers == (10, 20, 30)  # Flux2Pipeline's
    assert Flux2Family.read_settings(tmp_path, {"_class_name": "Flux2KleinPipeline"}).text_encoder_out_layers == (
        9, 18, 27)
    cond = dev.encode_prompts(["a red cat"])
    assert cond.embeds.shape == (1, 48, dev.transformer.config.joint_attention_dim) and cond.ids[5].tolist() == [
        0, 0, 0, 5]
    latents, sigma = dev.prepare_latents(make_generators([0]), 32, 32), torch.tensor([0.7])
    base = dev.velocity(dev.transformer, latents, sigma, cond, None, 1.0)
    dev.settings.guidance = 5.0
    try:  # the embedded guidance reaches the velocity
        assert (dev.velocity(dev.transformer, latents, sigma, cond, None, 1.0) - base).abs().max() > 1e-4
    finally:
        dev.settings.guidance = 4.0
    names = [n for n, _ in dev.transformer.named_modules()]
    for target in Flux2Family.lora_target_modules:
        assert any(n.endswith("." + target) for n in names), target


def test_schedule_is_the_pipelines(klein):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    steps, tokens = 6, (48 // klein.pixels_per_token) * (64 // klein.pixels_per_token)
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(klein.scheduler.config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=compute_empirical_mu(tokens, steps))
    torch.testing.assert_close(klein.sigmas(steps, 48, 64), scheduler.sigmas.float(), rtol=0, atol=1e-7)


def test_sample_k_is_the_same_in_any_microgroup(dev):
    """On dev with true CFG: the timestep and guidance embeddings and the modulations (klein's are the same code
    without the guidance embedding) run row by row."""
    assert_sample_k_is_the_same_in_any_microgroup(dev, guidance_scale=3.0, height=32, width=32)


def test_registry_finds_the_family_by_name_and_by_transformer_class(dev_dir, klein_dir, tmp_path):
    assert resolve_family(None, dev_dir) is Flux2Family
    for name in ("FLUX.2-dev", "FLUX.2-klein-4B", "flux2-klein-base-9b"):
        (tmp_path / name).mkdir()
        assert resolve_family(None, tmp_path / name) is Flux2Family
    for source in (dev_dir, klein_dir):  # no family's name: the transformer class decides
        neutral = tmp_path / f"my-model-{source.name[-15:]}"
        shutil.copytree(source, neutral)
        assert resolve_family(None, neutral) is Flux2Family


def test_bad_requests_are_refused(klein):
    engine = Engine(klein, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: FLUX.2 needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))  # 16 at real size
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


@pytest.mark.parametrize(("variant", "loss_type", "lora", "cfg"), [
    ("dev", "flow_grpo", True, 1.0), ("klein", "nft", False, 1.0),
], ids=["dev-grpo-lora", "klein-nft-full"])
def test_training_runs_on_flux2(request, tmp_path, variant, loss_type, lora, cfg):
    """Two rollouts of Flow-GRPO (LoRA, on dev with its embedded guidance) and of DiffusionNFT (full, klein base),
    with gradient checkpointing as the recipes train."""
    records = run_training(request.getfixturevalue(f"{variant}_dir"), tmp_path / "run", loss_type, lora, guidance=cfg,
                           extra_flags=("--num-rollout", "2", "--gradient-checkpointing"))
    assert len([r for r in records if "train/loss" in r]) == 2


def test_few_step_grpo_on_flux2_klein_distilled(distilled_dir, tmp_path):
    """The step-distilled checkpoint trains with Flow-GRPO's SDE over its own few steps (2 here), without CFG (the
    method of Flow-Factory's FLUX.2 [klein] example)."""
    run_training(distilled_dir, tmp_path / "run", "flow_grpo", True, guidance=1.0)


@pytest.mark.parametrize(("recipe", "variant", "size", "steps", "cfg", "noise", "window"), [
    ("flux2-klein-grpo-pickscore", "distilled", 384, 4, 1.0, 0.5, (1, 3)),
    ("flux2-klein-base-grpo-pickscore", "klein", 384, 8, 4.0, 0.7, (1, 4)),
    ("flux2-dev-grpo-pickscore", "dev", 512, 8, 1.0, 1.0, (1, 4)),
])
def test_flux2_grpo_recipes_are_flow_factorys_settings(request, recipe, variant, size, steps, cfg, noise, window):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    config = parse(["train", "--recipe", recipe, "--model-path", str(request.getfixturevalue(f"{variant}_dir"))])
    m, r, o = config.model, config.rollout, config.optim
    assert (m.diffusion_model_family, config.algorithm.loss_type, m.size()) == ("flux2", "flow_grpo", (size, size))
    assert (m.lora_rank, m.lora_alpha, r.diffusion_num_steps, r.diffusion_guidance_scale) == (64, 128.0, steps, cfg)
    assert (r.diffusion_sde_window_range, r.diffusion_num_sde_steps, r.diffusion_noise_level) == (window, 1, noise)
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout, o.lr) == (48, 16, 2, 3e-4)
    validate_config(config)


def test_flux2_nft_recipe_is_flow_factorys_setting(klein_dir):
    from diffrl.cli.main import parse
    from diffrl.train.trainer import validate_config

    config = parse(["train", "--recipe", "flux2-klein-base-nft-pickscore", "--model-path", str(klein_dir)])
    a, r, o = config.algorithm, config.rollout, config.optim
    assert (a.loss_type, a.diffusion_nft_beta, a.nft_rollout_guidance_scale, r.diffusion_num_steps) == (
        "nft", 0.1, 4.0, 8)
    assert (a.train_timesteps, a.train_timestep_range) == (2, (0.0, 0.5))  # 2 of the steps of σ ≥ 0.5, as that file
    assert (r.rollout_batch_size, r.n_samples_per_prompt, o.num_steps_per_rollout, o.lr) == (48, 16, 1, 1e-4)
    validate_config(config)
