"""The krea2 family against diffusers' Krea2Pipeline, on a tiny random checkpoint built in code."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, engine_images, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents
from diffrl.models.krea2 import PREFIX_TOKENS, SUFFIX_TOKENS, Krea2Family
from diffrl.models.random_checkpoints.krea2 import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 3.6e-7; the pipeline runs CFG as two forwards, we run one).
TOLERANCE = 1e-5
PROMPT = "a red cat on a mat"  # 6 tokens of the 24-token window of the tiny checkpoint
LONG_PROMPT = "a very long prompt about " + "a red circle and a blue square, " * 3  # truncated to the window


@pytest.fixture(scope="module")
def krea2_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "krea2-tiny")


@pytest.fixture(scope="module")
def krea2(krea2_dir) -> Krea2Family:
    return Krea2Family.load(krea2_dir)


def _diffusers_images(pipe, family, prompt, negative, guidance, noise, steps, height, width):
    """Krea2Pipeline's images. Its CFG scale is Krea's g (on above 0): the engine's scale s is 1 + g."""
    return pipe(prompt=prompt, negative_prompt=negative if guidance > 1 else None, guidance_scale=guidance - 1.0,
                latents=noise, num_inference_steps=steps, height=height, width=width, num_images_per_prompt=len(noise),
                max_sequence_length=family.settings.max_sequence_length, output_type="pt").images


@pytest.mark.parametrize(("prompt", "negative", "guidance"), [
    (PROMPT, "blurry", 5.5),  # CFG at the pipeline's default g = 4.5: both halves in one forward
    (PROMPT, "", 1.0),  # CFG off (g = 0): one conditional forward per step
    (LONG_PROMPT, "", 3.0),  # a prompt truncated to the window, CFG against the empty prompt
], ids=["cfg", "no-cfg", "long-prompt"])
def test_engine_reproduces_the_diffusers_pipeline(krea2, prompt, negative, guidance):
    """ODE sampling through our engine gives Krea2Pipeline's images from the same initial noise."""
    height, width, steps, seed = 32, 48, 4, 3
    ours = engine_images(krea2, prompt, negative, guidance, seed, steps, height, width)
    # The engine's initial noise (output i has seed + i), packed as the pipeline takes `latents`.
    noise = krea2.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens
    pipe = krea2.reference_pipeline()
    reference = _diffusers_images(pipe, krea2, prompt, negative, guidance, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    # The comparison can fail: another prompt moves the images far beyond the tolerance.
    other = _diffusers_images(pipe, krea2, "a green dog", negative, guidance, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE


def test_diffusers_reads_the_checkpoint_as_krea2(krea2, krea2_dir):
    """`Krea2Pipeline.from_pretrained` loads the checkpoint with the settings the family reads from it, and
    samples the family's images."""
    from diffusers import Krea2Pipeline

    pipe = Krea2Pipeline.from_pretrained(krea2_dir)
    pipe.set_progress_bar_config(disable=True)
    assert tuple(pipe.config.text_encoder_select_layers) == krea2.settings.text_encoder_select_layers == (2, 4)
    assert pipe.config.is_distilled is False and pipe.config.patch_size == krea2.settings.patch_size
    noise = krea2.prepare_latents(make_generators([5, 6]), 32, 32).tokens
    reference = _diffusers_images(pipe, krea2, PROMPT, "blurry", 5.5, noise, 2, 32, 32)
    torch.testing.assert_close(engine_images(krea2, PROMPT, "blurry", 5.5, 5, 2, 32, 32), reference,
                               rtol=0, atol=TOLERANCE)


def test_text_window_and_its_mask(krea2):
    """`[prefix | prompt | padding | suffix]`, the prefix dropped; the mask travels as the last channel, and
    what it masks out does not reach the velocity."""
    length = krea2.settings.max_sequence_length
    ids, mask = krea2.text_window(PROMPT)
    assert ids.shape == mask.shape == (1, PREFIX_TOKENS + length)
    prompt_tokens = 6
    expected = [True] * (PREFIX_TOKENS + prompt_tokens) + [False] * (length - prompt_tokens - SUFFIX_TOKENS)
    assert mask[0].tolist() == expected + [True] * SUFFIX_TOKENS
    assert krea2.text_window(LONG_PROMPT)[1].all()  # truncated: no padding left
    cond = krea2.encode_prompts([PROMPT])
    layers, width = krea2.transformer.config.num_text_layers, krea2.transformer.config.text_hidden_dim
    assert cond.embeds.shape == (1, length, layers * width + 1) and cond.ids.shape == (length, 3)
    hidden, text_mask = krea2.unpack_conditioning(cond.embeds)
    assert hidden.shape == (1, length, layers, width) and torch.equal(text_mask, mask[:, PREFIX_TOKENS:])

    latents = krea2.prepare_latents(make_generators([0]), 32, 32)
    sigma = torch.tensor([0.6])

    def velocity(embeds):
        return krea2.velocity(krea2.transformer, latents, sigma, type(cond)(embeds, cond.ids), None, 1.0)

    base = velocity(cond.embeds)
    padded, real = cond.embeds.clone(), cond.embeds.clone()
    padded[0, prompt_tokens, :-1] += 10.0  # a padding token: masked out
    real[0, 0, :-1] += 10.0  # a prompt token
    torch.testing.assert_close(velocity(padded), base, rtol=0, atol=1e-6)
    assert (velocity(real) - base).abs().max() > 1e-3


def test_schedule_is_the_pipelines_dynamic_shift(krea2, krea2_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.krea2.pipeline_krea2 import calculate_shift

    def scheduler_sigmas(steps, mu):
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(krea2_dir / "scheduler")
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
        return scheduler.sigmas

    for height, width in ((32, 32), (64, 96)):
        tokens = (height // 4) * (width // 4)
        expected = scheduler_sigmas(10, calculate_shift(tokens, 256, 6400, 0.5, 1.15))
        assert torch.equal(krea2.sigmas(10, height, width), expected)
    assert not torch.equal(krea2.sigmas(10, 32, 32), krea2.sigmas(10, 64, 96))  # resolution-aware
    assert len(krea2.sigmas(10, 32, 32)) == 11 and krea2.sigmas(10, 32, 32)[-1] == 0

    distilled_dir = tmp_path / "krea2-distilled"
    shutil.copytree(krea2_dir, distilled_dir)
    index = distilled_dir / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "is_distilled": True}))
    distilled = Krea2Family.load(distilled_dir)
    assert distilled.default_guidance_scale == 1.0  # sampled without CFG
    for height, width in ((32, 32), (64, 96)):
        assert torch.equal(distilled.sigmas(8, height, width), scheduler_sigmas(8, 1.15))


def test_cfg_is_krea_form(krea2):
    """guidance_scale s is Krea's g + 1: v = cond + (s − 1)·(cond − uncond)."""
    latents = krea2.prepare_latents(make_generators([0, 1]), 32, 32)
    cond, uncond = krea2.encode_prompts([PROMPT] * 2), krea2.encode_prompts(["blurry"] * 2)
    sigma = torch.tensor([0.7, 0.7])
    v_cond = krea2.velocity(krea2.transformer, latents, sigma, cond, None, 1.0)
    v_uncond = krea2.velocity(krea2.transformer, latents, sigma, uncond, None, 1.0)
    guided = krea2.velocity(krea2.transformer, latents, sigma, cond, uncond, 3.0)
    torch.testing.assert_close(guided, v_cond + 2.0 * (v_cond - v_uncond), rtol=0, atol=1e-5)


@pytest.mark.parametrize("guidance", [1.0, 5.5], ids=["no-cfg", "cfg"])
def test_sample_k_is_the_same_in_any_microgroup(krea2, guidance):
    """Batching is exact for Krea 2 (fixed text window, per-row mask and modulation): sample k does not
    depend on the microgroup, bit for bit on CPU."""
    assert_sample_k_is_the_same_in_any_microgroup(krea2, guidance_scale=guidance, height=32, width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(krea2):
    """The trainer's batches mix timesteps and prompts: each row's velocity equals its velocity alone."""
    latents = krea2.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    cond = krea2.encode_prompts([PROMPT, "a green dog", LONG_PROMPT])
    sigma = torch.tensor([0.9, 0.3, 0.6])
    together = krea2.velocity(krea2.transformer, latents, sigma, cond, None, 1.0)
    for i in range(3):
        alone = krea2.velocity(krea2.transformer, Latents(latents.tokens[i:i + 1], latents.ids), sigma[i:i + 1],
                               type(cond)(cond.embeds[i:i + 1], cond.ids), None, 1.0)
        assert torch.equal(alone, together[i:i + 1])


def test_family_is_found_by_directory_name(krea2_dir):
    assert resolve_family(None, krea2_dir) is Krea2Family


def _edited_copy(src: Path, dst: Path, relative: str, **changes) -> Path:
    shutil.copytree(src, dst)
    path = dst / relative
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return dst


def test_bad_requests_and_checkpoints_are_refused(krea2, krea2_dir, tmp_path):
    engine = Engine(krea2, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: Krea 2 needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", height=32, width=32, image="data:image/png;base64,AAAA"))
    assert err.value.field == "image"

    cases = [
        ("scheduler/scheduler_config.json", {"stochastic_sampling": True}, "unsupported scheduler options"),
        ("model_index.json", {"text_encoder_select_layers": [1, 2, 3]}, "has 3 entries, the transformer fuses 2"),
        ("model_index.json", {"text_encoder_select_layers": [2, 9]}, "out of range for a text encoder of 4 layers"),
        ("model_index.json", {"patch_size": 1}, "takes 16 channels; 1x1 patches"),
    ]
    for k, (relative, changes, message) in enumerate(cases):
        with pytest.raises(ModelLoadError, match=message):
            Krea2Family.load(_edited_copy(krea2_dir, tmp_path / f"bad-{k}", relative, **changes))

    # Character-level: the template is not 34 + 5 tokens.
    from diffrl.models.random_checkpoints.tokenizers import build_chat_tokenizer

    other = tmp_path / "other-tokenizer"
    shutil.copytree(krea2_dir, other)
    shutil.rmtree(other / "tokenizer")
    build_chat_tokenizer().save_pretrained(other / "tokenizer")
    with pytest.raises(ModelLoadError, match="cuts it at 34 \\+ 5"):
        Krea2Family.load(other)
    (other / "vae" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*vae/config.json"):
        Krea2Family.load(other)


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)],
                         ids=["grpo-lora", "nft-full"])
def test_training_run_on_krea2(krea2_dir, tmp_path, loss_type, lora):
    run_training(krea2_dir, tmp_path / "run", loss_type, lora, guidance=2.0)
