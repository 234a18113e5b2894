"""The flux3_image family against diffusers' own FLUX 3 pipeline, on a tiny random checkpoint built in code."""

import json
from pathlib import Path

import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.flux3_image import Flux3ImageFamily
from diffrl.models.random_checkpoints.flux3_image import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

# The tolerance of an fp32 CPU run of the same weights through two code paths (measured: ≤ 1e-6).
TOLERANCE = 1e-5
LONG_PROMPT = "a very long prompt about " + "a red circle and a blue square, " * 3  # > 80 tokens: a 160-token window


@pytest.fixture(scope="module")
def flux3_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "flux3-tiny")


@pytest.fixture(scope="module")
def flux3(flux3_dir) -> Flux3ImageFamily:
    return Flux3ImageFamily.load(flux3_dir)


def _diffusers_images(family, prompt, negative_prompt, guidance, noise, steps, height, width):
    pipe = family.reference_pipeline()
    pipe.update_components(guider=pipe.guider.new(guidance_scale=guidance, enabled=guidance > 1))  # its CFG scale
    return pipe(prompt=prompt, negative_prompt=negative_prompt if guidance > 1 else None, latents=noise,
                num_inference_steps=steps, height=height, width=width, num_images_per_prompt=len(noise),
                output="images", output_type="pt", **family.reference_pipeline_kwargs())


@pytest.mark.parametrize(("prompt", "negative", "guidance"), [
    ("a red cat on a mat", "blurry", 3.5),  # CFG: both halves in one forward (same text window)
    ("a red cat on a mat", "", 1.0),  # CFG off: one conditional forward per step
    (LONG_PROMPT, "", 3.5),  # a 160-token prompt against an 80-token negative: two forwards
], ids=["cfg", "no-cfg", "long-prompt"])
def test_engine_reproduces_the_diffusers_pipeline(flux3, prompt, negative, guidance):
    """ODE sampling through our engine gives diffusers' FLUX 3 images from the same initial noise."""
    height, width, steps, seed = 32, 48, 4, 7
    engine = Engine(flux3, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt=prompt, negative_prompt=negative, seed=seed, num_outputs_per_prompt=2,
                                             num_inference_steps=steps, guidance_scale=guidance, height=height,
                                             width=width))
    ours = torch.stack([o.generated_output for o in outputs])
    # The engine's initial noise (output i has seed + i), on diffusers' latent grid [B, C, h, w].
    tokens = flux3.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    noise = tokens.transpose(1, 2).reshape(2, -1, height // 4, width // 4)
    reference = _diffusers_images(flux3, prompt, negative, guidance, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    # The comparison can fail: another prompt moves the images far beyond the tolerance.
    other = _diffusers_images(flux3, "a green dog", negative, guidance, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE


def test_sample_k_is_the_same_in_any_microgroup(flux3):
    assert_sample_k_is_the_same_in_any_microgroup(flux3, guidance_scale=3.5, height=32, width=32)


def test_text_window_is_padded_to_multiples_of_80(flux3):
    short_ids, short_mask = flux3.text_window("a red cat")
    long_ids, _ = flux3.text_window(LONG_PROMPT)
    assert short_ids.shape == (1, 80) and long_ids.shape == (1, 160)
    assert 0 < int(short_mask.sum()) < 80  # real tokens, then padding the transformer attends to
    with pytest.raises(ValueError, match="text windows of \\[80, 160\\]"):
        flux3.encode_prompts(["a red cat", LONG_PROMPT])


def test_family_is_found_by_directory_name(flux3_dir):
    assert resolve_family(None, flux3_dir) is Flux3ImageFamily


def test_bad_requests_are_refused(flux3):
    engine = Engine(flux3, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_step_distilled_checkpoint_is_refused(flux3_dir, tmp_path):
    from diffusers import Flux3Transformer2DModel

    config = json.loads((flux3_dir / "transformer" / "config.json").read_text())
    config.pop("_class_name", None), config.pop("_diffusers_version", None)
    distilled = Flux3Transformer2DModel(**{**config, "flow_map": True})
    family = Flux3ImageFamily.load(flux3_dir)
    with pytest.raises(ModelLoadError, match="step-distilled"):
        Flux3ImageFamily(distilled, family.vae, family.text_encoder, family.tokenizer, shift=family.shift,
                         settings=family.settings)


def test_unsupported_scheduler_is_refused(flux3_dir, tmp_path):
    import shutil

    copy = tmp_path / "flux3-dynamic"
    shutil.copytree(flux3_dir, copy)
    config = copy / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "use_dynamic_shifting": True}))
    with pytest.raises(ModelLoadError, match="use_dynamic_shifting"):
        Flux3ImageFamily.load(copy)


# nft-full is slow as in the other families: grpo-lora keeps FLUX.3's forward and backward in the default run, and
# the NFT objective and full finetune are shared trainer code that test_trainer.py covers on the demo family.
@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)],
                         ids=["grpo-lora", "nft-full"])
def test_training_run_on_flux3(flux3_dir, tmp_path, loss_type, lora):
    run_training(flux3_dir, tmp_path / "run", loss_type, lora, guidance=2.0)


def test_trainer_refuses_a_rollout_that_mixes_text_windows(flux3):
    from types import SimpleNamespace

    from diffrl.train.objectives import rollout_conditioning

    def sample(prompt):
        cond = flux3.encode_prompts([prompt])
        env = {"prompt_embeds": cond.embeds, "text_ids": cond.ids, "image_ids": torch.zeros(4, 4)}
        return SimpleNamespace(prompt=prompt, output=SimpleNamespace(denoising_env=env))

    same = rollout_conditioning([sample("a red cat"), sample("a blue dog")])
    assert len(same["cond"]) == 2 and torch.equal(same["negative_text_ids"], same["text_ids"])
    with pytest.raises(ValueError, match="text windows of 80 and 160 tokens"):
        rollout_conditioning([sample("a red cat"), sample(LONG_PROMPT)])
