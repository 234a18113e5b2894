"""The qwen_image family against diffusers' QwenImagePipeline, on a tiny random checkpoint built in code."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.qwen_image import QwenImageFamily
from diffrl.models.random_checkpoints.qwen_image import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 3e-7 for one prompt, ≤ 5e-7 for a padded batch).
TOLERANCE = 1e-5
SHORT = "a red cat"  # 8 text tokens once the template's prefix is dropped
LONG = "a blue square to the left of a yellow circle"  # 15 text tokens
LONG_NEGATIVE = "a very long prompt about an ugly and blurry picture"  # longer than SHORT: uncond pads cond


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "qwen-image-tiny")


@pytest.fixture(scope="module")
def qwen(qwen_dir) -> QwenImageFamily:
    return QwenImageFamily.load(qwen_dir)


def _diffusers_images(family, prompt, negative, guidance, steps, height, width, **noise):
    """QwenImagePipeline's images; its CFG scale is `true_cfg_scale`, on when a negative prompt is given."""
    pipe = family.reference_pipeline()
    return pipe(prompt=prompt, negative_prompt=negative if guidance > 1 else None, true_cfg_scale=guidance,
                num_inference_steps=steps, height=height, width=width, output_type="pt", **noise).images


@pytest.mark.parametrize(("prompt", "negative", "guidance"), [
    (SHORT, LONG_NEGATIVE, 4.0),  # true CFG, the negative prompt longer than the prompt
    (LONG, "", 4.0),  # true CFG, the prompt longer than the negative prompt
    (SHORT, "", 1.0),  # CFG off: one conditional forward per step
    (LONG, "", 1.0),
], ids=["short-cfg", "long-cfg", "short-no-cfg", "long-no-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(qwen, prompt, negative, guidance):
    """ODE sampling through our engine gives QwenImagePipeline's images from the same initial noise."""
    height, width, steps, seed = 32, 48, 4, 3
    engine = Engine(qwen, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt=prompt, negative_prompt=negative, seed=seed,
                                             num_outputs_per_prompt=2, num_inference_steps=steps,
                                             guidance_scale=guidance, height=height, width=width))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = qwen.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    reference = _diffusers_images(qwen, prompt, negative, guidance, steps, height, width, latents=noise,
                                  num_images_per_prompt=2)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    # The comparison can fail: the other prompt moves the images far beyond the tolerance.
    other = _diffusers_images(qwen, LONG if prompt == SHORT else SHORT, negative, guidance, steps, height, width,
                              latents=noise, num_images_per_prompt=2)
    assert (other - reference).abs().max() > 100 * TOLERANCE


def test_initial_noise_is_what_the_pipeline_draws(qwen):
    """Per-sample generators draw the pipeline's own noise ([1, C, 2h, 2w] per sample, packed 2x2)."""
    pipe = qwen.reference_pipeline()
    generators = make_generators([5, 6])
    theirs = pipe.prepare_latents(2, qwen.vae.config.z_dim, 32, 48, torch.float32, "cpu", generators)
    ours = qwen.prepare_latents(make_generators([5, 6]), 32, 48)
    assert torch.equal(ours.tokens, theirs)
    assert ours.ids.shape == (8 * 12, 3) and ours.ids[-1].tolist() == [0, 7, 11]


def test_a_batch_of_prompts_of_different_lengths(qwen):
    """Prompts of different lengths in one batch (evaluation): padded to the longest, the mask derived from
    the lengths in the conditioning, the images equal the pipeline's for the same padded batch and each
    prompt's image alone."""
    from diffrl.evaluation.shapes import generate

    steps, size, seeds = 3, 32, [5, 6]
    ours = generate(qwen, [SHORT, LONG], seeds, num_steps=steps, guidance_scale=4.0, resolution=size)
    reference = _diffusers_images(qwen, [SHORT, LONG], ["", ""], 4.0, steps, size, size,
                                  generator=make_generators(seeds))
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    for k, prompt in enumerate([SHORT, LONG]):
        alone = generate(qwen, [prompt], seeds[k : k + 1], num_steps=steps, guidance_scale=4.0, resolution=size)
        torch.testing.assert_close(ours[k : k + 1], alone, rtol=0, atol=TOLERANCE)


def test_conditioning_carries_its_text_lengths(qwen):
    """`[B, 1 + L, D]`: a header token holding each prompt's length, its text (the template's prefix
    dropped, as the pipeline encodes it), zeros after; each row as the prompt encoded alone."""
    both = qwen.encode_prompts([SHORT, LONG])
    assert both.embeds.shape == (2, 1 + 15, 32) and both.embeds[:, 0, 0].tolist() == [8, 15]
    assert torch.equal(both.ids, torch.zeros(16, 1))
    assert both.embeds[0, 9:].abs().max() == 0 and both.embeds[0, 0, 1:].abs().max() == 0
    alone = qwen.encode_prompts([SHORT])
    assert alone.embeds.shape == (1, 9, 32) and torch.equal(alone.embeds[0], both.embeds[0, :9])
    theirs, mask = qwen.reference_pipeline()._get_qwen_prompt_embeds([SHORT, LONG], device="cpu")
    assert mask.sum(1).tolist() == [8, 15]
    torch.testing.assert_close(both.embeds[:, 1:] * mask[..., None], theirs * mask[..., None], rtol=0, atol=1e-6)


def test_schedule_is_the_pipelines(qwen):
    """The scheduler's schedule with the pipeline's μ (linear in the image tokens) at each resolution."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    config = qwen.scheduler.config
    for height, width in ((32, 32), (64, 96)):
        scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
        mu = calculate_shift((height // 4) * (width // 4), config.base_image_seq_len, config.max_image_seq_len,
                             config.base_shift, config.max_shift)
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.1, 10), mu=mu)
        ours = qwen.sigmas(10, height, width)
        assert torch.equal(ours, scheduler.sigmas) and len(ours) == 11 and ours[-1] == 0
        assert abs(float(ours[-2]) - config.shift_terminal) < 1e-6  # stretched to Qwen-Image's terminal σ
    assert not torch.equal(qwen.sigmas(10, 32, 32), qwen.sigmas(10, 64, 96))  # dynamic: depends on the size


def test_rope_tables_are_built_on_the_compute_device(qwen):
    """The tables the transformer reads come from our builder, for the device asked, and on CPU they
    are diffusers' own to the bit."""
    rope = qwen.transformer.pos_embed
    positive, negative = rope._get_device_freqs(torch.device("cpu"))
    assert torch.equal(positive, rope.pos_freqs) and torch.equal(negative, rope.neg_freqs)
    assert type(rope._get_device_freqs).__name__ == "_DeviceRopeTables"


def test_sample_k_is_the_same_in_any_microgroup(qwen):
    assert_sample_k_is_the_same_in_any_microgroup(qwen, guidance_scale=4.0, height=32, width=32)


def test_family_is_found_by_directory_name(qwen_dir, tmp_path):
    assert resolve_family(None, qwen_dir) is QwenImageFamily
    for name in ("Qwen_Image-2512", "qwenimage"):
        (tmp_path / name).mkdir()
        assert resolve_family(None, tmp_path / name) is QwenImageFamily


def test_bad_requests_are_refused(qwen):
    engine = Engine(qwen, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: Qwen-Image needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))
    with pytest.raises(RequestError, match="width=42"):
        engine.generate(RolloutRequest(prompt="a cat", height=32, width=42))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", height=32, width=32, image="data:image/png;base64,AAAA"))
    assert err.value.field == "image"


def test_true_cfg_scale_is_qwen_images_guidance_scale(qwen):
    """sglang's Qwen-Image requests send the CFG scale as `true_cfg_scale`; it means guidance_scale."""
    engine = Engine(qwen, EngineConfig(max_outputs_per_request=4))
    request = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, negative_prompt="blurry")
    true_cfg = engine.generate(RolloutRequest(true_cfg_scale=4.0, **request))[0].generated_output
    guided = engine.generate(RolloutRequest(guidance_scale=4.0, **request))[0].generated_output
    unguided = engine.generate(RolloutRequest(guidance_scale=1.0, **request))[0].generated_output
    assert torch.equal(true_cfg, guided) and not torch.equal(true_cfg, unguided)


def _edit(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize(("component", "changes", "message"), [
    ("model_index.json", {"_class_name": "QwenImageEditPlusPipeline"}, "Qwen-Image-Edit checkpoint has no processor/"),
    ("model_index.json", {"_class_name": "QwenImageLayeredPipeline"}, "variant this family does not run"),
    ("transformer/config.json", {"zero_cond_t": True}, "zero_cond_t.*image-conditioned"),
    ("transformer/config.json", {"guidance_embeds": True}, "guidance_embeds.*guidance-distilled"),
    ("scheduler/scheduler_config.json", {"stochastic_sampling": True}, "unsupported scheduler options"),
    ("model_index.json", {"diffrl": {"resolution": 3}}, "bad 'diffrl' block"),
], ids=["edit-without-processor", "layered-pipeline", "edit-transformer", "guidance-distilled", "stochastic-scheduler", "bad-settings"])
def test_unsupported_checkpoints_are_refused(qwen_dir, tmp_path, component, changes, message):
    copy_dir = tmp_path / "qwen-image-variant"
    shutil.copytree(qwen_dir, copy_dir)
    _edit(copy_dir / component, **changes)
    with pytest.raises(ModelLoadError, match=message):
        QwenImageFamily.load(copy_dir)


def test_broken_checkpoints_are_refused(qwen, qwen_dir, tmp_path):
    from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer

    broken = tmp_path / "qwen-image-broken"
    shutil.copytree(qwen_dir, broken)
    (broken / "scheduler" / "scheduler_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="corrupt file: .*scheduler_config.json"):
        QwenImageFamily.load(broken)
    (broken / "vae" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*vae/config.json"):
        QwenImageFamily.load(broken)
    with pytest.raises(ModelLoadError, match="model directory not found"):
        QwenImageFamily.load(tmp_path / "nowhere")
    # A tokenizer that does not split the template's prefix into the 34 tokens the pipeline drops.
    with pytest.raises(ModelLoadError, match="prefix into .* tokens; Qwen-Image drops the first 34"):
        QwenImageFamily(qwen.transformer, qwen.vae, qwen.text_encoder, build_chat_tokenizer(), qwen.scheduler)


def test_trainer_pads_a_rollout_of_prompts_of_different_lengths(qwen):
    """Training batches several prompts: their conditionings are zero-padded to the rollout's longest, and a
    padded row's velocity is the engine's (exactly when its micro-batch holds one prompt)."""
    from diffrl.train.objectives import rollout_conditioning

    def sample(prompt):
        cond, uncond = qwen.encode_prompts([prompt]), qwen.encode_prompts([""])
        env = {"prompt_embeds": cond.embeds, "text_ids": cond.ids, "image_ids": torch.zeros(4, 3),
               "negative_prompt_embeds": uncond.embeds, "negative_text_ids": uncond.ids}
        return SimpleNamespace(prompt=prompt, output=SimpleNamespace(denoising_env=env))

    env = rollout_conditioning([sample(SHORT), sample(LONG)], pad_text=True)
    assert [c.shape for c in env["cond"] + env["uncond"]] == [(16, 32)] * 4 and env["text_ids"].shape == (16, 1)
    with pytest.raises(ValueError, match="text windows of 9 and 16 tokens"):  # families that cannot pad refuse
        rollout_conditioning([sample(SHORT), sample(LONG)])
    latents = qwen.prepare_latents(make_generators([1, 2]), 32, 32)
    sigma = torch.tensor([0.7, 0.4])

    def velocity(cond, uncond, rows=slice(None)):
        x = Latents(latents.tokens[rows], latents.ids)
        return qwen.velocity(qwen.transformer, x, sigma[rows], PromptEmbeds(cond, env["text_ids"]),
                             PromptEmbeds(uncond, env["text_ids"]), 4.0)

    engine = [qwen.velocity(qwen.transformer, Latents(latents.tokens[k : k + 1], latents.ids), sigma[k : k + 1],
                            qwen.encode_prompts([p]), qwen.encode_prompts([""]), 4.0)
              for k, p in enumerate([SHORT, LONG])]
    padded, negative = torch.stack(env["cond"]), torch.stack(env["uncond"])
    assert torch.equal(velocity(padded[:1], negative[:1], slice(0, 1)), engine[0])
    mixed = velocity(padded, negative)
    torch.testing.assert_close(mixed, torch.cat(engine), rtol=0, atol=1e-5)


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)],
                         ids=["grpo-lora", "nft-full"])
def test_training_run_on_qwen_image(qwen_dir, tmp_path, loss_type, lora):
    run_training(qwen_dir, tmp_path / "run", loss_type, lora, guidance=4.0)
