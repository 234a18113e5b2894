"""The sana family (SANA) against diffusers' SanaPipeline, on a tiny random checkpoint built in code."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import assert_registry_finds, assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.random_checkpoints.sana import save_random_checkpoint
from diffrl.models.sana import SanaFamily
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 4.2e-7 with CFG, 3.0e-7 without; the pipeline decodes both images
# in one VAE call, the engine one at a time).
TOLERANCE = 1e-5
PROMPT = "A Red Cat"  # lower-cased by the pipeline's preprocessing
LONG_PROMPT = "a red cat on the mat of a blue dog and a green circle on a square of the blurry mat"  # truncated


@pytest.fixture(scope="module")
def sana_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "sana-tiny")


@pytest.fixture(scope="module")
def sana(sana_dir) -> SanaFamily:
    return SanaFamily.load(sana_dir)


def _copy_with(sana_dir: Path, folder: Path, *, index: dict | None = None, scheduler: dict | None = None) -> Path:
    """The tiny checkpoint copied under a name without "sana", with model_index.json or the scheduler changed."""
    shutil.copytree(sana_dir, folder)
    if index is not None:
        data = json.loads((folder / "model_index.json").read_text())
        (folder / "model_index.json").write_text(json.dumps({**data, **index}))
    if scheduler is not None:
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    return folder


@pytest.mark.parametrize(("negative", "cfg"), [
    ("blurry", 4.0),  # CFG with a negative prompt (encoded without the instruction, as the pipeline does)
    ("", 1.0),  # CFG off: one conditional forward per step
], ids=["cfg", "no-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(sana, negative, cfg):
    """ODE sampling through our engine gives SanaPipeline's images (its default complex human instruction, no
    resolution binning) from the same initial noise."""
    height, width, steps, seed = 32, 64, 4, 3
    engine = Engine(sana, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt=PROMPT, negative_prompt=negative, seed=seed,
                                             num_outputs_per_prompt=2, num_inference_steps=steps, guidance_scale=cfg,
                                             height=height, width=width))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = sana.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens  # the engine's

    def reference(prompt):
        return sana.reference_pipeline()(
            prompt=prompt, negative_prompt=negative, guidance_scale=cfg, latents=noise, num_inference_steps=steps,
            height=height, width=width, num_images_per_prompt=2, output_type="pt",
            **sana.reference_pipeline_kwargs()).images

    expected = reference(PROMPT)
    assert ours.shape == expected.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, expected, rtol=0, atol=TOLERANCE)
    assert (reference("a green dog") - expected).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_conditioning_is_the_pipelines_gemma_with_the_instruction(sana):
    """Each text's two encodings are the pipeline's: as a prompt (the complex human instruction in front, the
    first token and the last L − 1 kept) and as a negative prompt (no instruction), tokens and masks exactly; the
    instruction changes the prompt's tokens (Gemma reads it causally) and the mask reaches the forward."""
    assert sana.instruction and sana.instruction[0].startswith("Given a user prompt")  # the pipeline's default
    texts = [PROMPT, LONG_PROMPT, ""]
    cond = sana.encode_prompts(texts)
    pipe = sana.reference_pipeline()
    prompt_embeds, prompt_mask, negative_embeds, negative_mask = pipe.encode_prompt(
        texts, True, negative_prompt=texts, device="cpu", **{k: v for k, v in sana.reference_pipeline_kwargs().items()
                                                             if k != "use_resolution_binning"})
    length = sana.settings.max_sequence_length
    assert cond.embeds.shape == (3, 2 * length, sana.transformer.config.caption_channels + 1)
    assert cond.ids.shape == (2 * length, 1) and not cond.ids.any()
    torch.testing.assert_close(cond.embeds[:, :length, :-1], prompt_embeds.float(), rtol=0, atol=0)
    torch.testing.assert_close(cond.embeds[:, length:, :-1], negative_embeds.float(), rtol=0, atol=0)
    assert torch.equal(cond.embeds[:, :length, -1], prompt_mask.float())
    assert torch.equal(cond.embeds[:, length:, -1], negative_mask.float())
    assert cond.embeds[1, :, -1].sum() == 2 * length  # the long prompt fills both windows
    assert cond.embeds[2, length:, -1].tolist() == [1.0] + [0.0] * (length - 1)  # "" as a negative: <bos>
    assert (cond.embeds[0, :length] - cond.embeds[0, length:]).abs().max() > 1e-3  # the instruction is read
    latents = sana.prepare_latents(make_generators([0]), 32, 32)
    one = PromptEmbeds(cond.embeds[:1], cond.ids)
    base = sana.velocity(sana.transformer, latents, torch.tensor([0.7]), one, None, 1.0)
    unmasked = one.embeds.clone()
    unmasked[..., -1] = 1.0
    moved = sana.velocity(sana.transformer, latents, torch.tensor([0.7]), PromptEmbeds(unmasked, cond.ids), None, 1.0)
    assert (moved - base).abs().max() > 1e-4


def test_defaults_and_schedule_are_the_pipelines(sana, sana_dir, tmp_path):
    """FlowMatch Euler's σ's and σ·1000 timesteps; a DPM-Solver checkpoint (the published kind) gets DPM-Solver's
    flow σ's and its integer timesteps, as the pipeline calls the transformer with."""
    from diffusers import DPMSolverMultistepScheduler, FlowMatchEulerDiscreteScheduler

    assert (sana.default_guidance_scale, sana.default_num_inference_steps) == (4.5, 20)
    assert sana.default_size() == (32, 32) and sana.settings.max_sequence_length == 16  # the tiny model index
    assert sana.task_type == "T2I" and not sana.accepts_image_conditioning
    euler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    euler.set_timesteps(6)
    torch.testing.assert_close(sana.sigmas(6, 32, 64), euler.sigmas.float(), rtol=0, atol=0)
    torch.testing.assert_close(sana.model_timesteps(euler.sigmas[:-1]), euler.timesteps, rtol=0, atol=0)
    config = dict(DPMSolverMultistepScheduler(flow_shift=3.0, use_flow_sigmas=True, prediction_type="flow_prediction"
                                              ).config, _class_name="DPMSolverMultistepScheduler")
    dpm_dir = _copy_with(sana_dir, tmp_path / "dpm", scheduler=config,
                         index={"scheduler": ["diffusers", "DPMSolverMultistepScheduler"]})
    family = SanaFamily.load(dpm_dir)
    reference = DPMSolverMultistepScheduler.from_config(config)
    reference.set_timesteps(6)
    sigmas = family.sigmas(6, 32, 64)
    torch.testing.assert_close(sigmas, reference.sigmas.float(), rtol=0, atol=1e-7)
    assert sigmas[-1] == 0 and family.integer_timesteps
    assert family.model_timesteps(sigmas[:-1]).tolist() == reference.timesteps.float().tolist()
    (dpm_dir / "scheduler" / "scheduler_config.json").write_text(json.dumps({**config, "use_flow_sigmas": False}))
    with pytest.raises(ModelLoadError, match="without use_flow_sigmas"):
        SanaFamily.load(dpm_dir)


def test_sample_k_is_the_same_in_any_microgroup(sana):
    assert_sample_k_is_the_same_in_any_microgroup(sana, guidance_scale=3.0, negative_prompt="blurry", height=32,
                                                  width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(sana):
    """A training micro-batch mixes timesteps and prompts (with different masks), with CFG: each row's velocity
    equals that row alone."""
    cond = sana.encode_prompts([PROMPT, LONG_PROMPT, PROMPT])
    uncond = sana.encode_prompts(["", "", "blurry"])
    latents = sana.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = sana.velocity(sana.transformer, latents, sigma, cond, uncond, 3.0)
    for i in range(3):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = sana.velocity(sana.transformer, row, sigma[i : i + 1], PromptEmbeds(cond.embeds[i : i + 1], cond.ids),
                              PromptEmbeds(uncond.embeds[i : i + 1], uncond.ids), 3.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_registry_finds_the_family_by_name_and_by_transformer_class(sana_dir, tmp_path, monkeypatch):
    assert_registry_finds(SanaFamily, sana_dir, tmp_path, ("Sana_1600M_1024px_diffusers", "SANA1.5_4.8B_1024px_diffusers"), monkeypatch)


def test_other_sana_pipelines_are_refused(sana_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="SanaSprintPipeline checkpoint"):
        SanaFamily.load(_copy_with(sana_dir, tmp_path / "sprint", index={"_class_name": "SanaSprintPipeline"}))


def test_bad_requests_are_refused(sana):
    """Text to image only: an image-conditioned request is refused, as by every text-only family; so is a size
    that is not a multiple of 32 (the pipeline's check)."""
    engine = Engine(sana, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=48: SANA needs a positive multiple of 32"):
        engine.generate(RolloutRequest(prompt="a cat", height=48, width=32))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_conditioning_round_trips_the_wire(sana):
    cond = sana.encode_prompts([PROMPT])
    ids = sana.prepare_latents(make_generators([0]), 32, 32).ids
    wire = sana.cond_kwargs_to_wire(cond, ids)
    assert wire["encoder_hidden_states"][0].shape == (16, sana.transformer.config.caption_channels)
    assert wire["encoder_attention_mask"].shape == wire["negative_encoder_attention_mask"].shape == (16,)
    back, image_ids = SanaFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids) and torch.equal(image_ids, ids)
    with pytest.raises(ValueError, match="negative_encoder_attention_mask"):
        SanaFamily.cond_kwargs_from_wire({**wire, "negative_encoder_attention_mask": torch.ones(3)})


def test_rollout_conditioning_survives_the_json_wire(sana):
    """A rollout's conditioning (both encodings and masks, both CFG halves) in sglang's JSON response format and
    back: the same tensors, so a trainer behind HTTP replays the engine's forward."""
    from diffrl.serving import sglang

    req = RolloutRequest(prompt=PROMPT, negative_prompt="blurry", seed=1, num_outputs_per_prompt=2, height=32, width=32,
                         num_inference_steps=2, guidance_scale=3.0, rollout=True, rollout_return_dit_trajectory=True,
                         rollout_return_denoising_env=True)
    ran = Engine(sana, EngineConfig(max_outputs_per_request=4)).generate(sglang.engine_request(req))
    got = sglang.decode_response(sglang.encode_response(ran, req, sana, "r"), req, SanaFamily)
    sent = ran[0].denoising_env
    for key in ("prompt_embeds", "negative_prompt_embeds", "text_ids", "image_ids"):
        assert torch.equal(got[0].denoising_env[key], sent[key]), key


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_sana(sana_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, CFG 2 with the empty negative prompt) and of DiffusionNFT (full)."""
    records = run_training(sana_dir, tmp_path / "run", loss_type, lora, guidance=2.0,
                           extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2
