"""The hidream family (HiDream-I1) against diffusers' HiDreamImagePipeline, on a tiny random checkpoint built in code."""

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
from diffrl.models.hidream import HiDreamFamily
from diffrl.models.random_checkpoints.hidream import save_random_checkpoint
from diffrl.sampling import make_generators

# fp32 on CPU through two code paths (measured: ≤ 7e-7; the experts see other row counts than the pipeline's).
TOLERANCE = 1e-5
PROMPT = "a red cat"
LONG_PROMPT = "a red cat on the mat of a blue dog and a green circle on a square of the blurry mat"  # truncated


@pytest.fixture(scope="module")
def hidream_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "hidream-tiny")


@pytest.fixture(scope="module")
def hidream(hidream_dir) -> HiDreamFamily:
    return HiDreamFamily.load(hidream_dir)


@pytest.mark.parametrize(("prompt", "negative", "cfg", "height", "width"), [
    (PROMPT, "blurry", 4.0, 32, 32),  # CFG with a negative prompt
    (PROMPT, "", 1.0, 32, 32),  # CFG off: one conditional forward per step
    (LONG_PROMPT, "", 5.0, 32, 32),  # a prompt filling every window, CFG against the empty prompt (the default)
    (PROMPT, "", 3.0, 16, 64),  # non-square: the forward pads the patches to max_seq and masks them
], ids=["cfg", "no-cfg", "long-prompt", "non-square"])
def test_engine_reproduces_the_diffusers_pipeline(hidream, prompt, negative, cfg, height, width):
    """ODE sampling through our engine gives HiDreamImagePipeline's images from the same initial noise, at sizes of
    the checkpoint's default area (the pipeline rescales other sizes to that area)."""
    steps, seed = 4, 3
    ours = engine_images(hidream, prompt, negative, cfg, seed, steps, height, width)
    noise = hidream.prepare_latents(make_generators([seed, seed + 1]), height, width).tokens  # output i: seed + i
    reference = pipeline_images(hidream, prompt, negative or None, cfg, noise, steps, height, width)
    assert ours.shape == reference.shape == (2, 3, height, width)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline_images(hidream, "a green dog", negative or None, cfg, noise, steps, height, width)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_conditioning_is_the_pipelines(hidream):
    """The pooled CLIP vectors, T5's tokens and the Llama layers the blocks read are the pipeline's own, packed
    so that they unpack exactly; layer 1 of the tiny Llama, which no block reads, is not carried."""
    cond = hidream.encode_prompts([PROMPT, LONG_PROMPT])
    t5, llama, pooled = hidream.unpack_conditioning(cond.embeds)
    pipe = hidream.reference_pipeline()
    ref_t5, _, ref_llama, _, ref_pooled, _ = pipe.encode_prompt(
        prompt=[PROMPT, LONG_PROMPT], do_classifier_free_guidance=False, device="cpu", max_sequence_length=16)
    assert hidream.llama_layers == [0, 2] and ref_llama.shape[0] == 3
    torch.testing.assert_close(t5, ref_t5, rtol=0, atol=0)
    torch.testing.assert_close(pooled, ref_pooled, rtol=0, atol=0)
    torch.testing.assert_close(llama, ref_llama[[0, 2]].transpose(0, 1), rtol=0, atol=0)
    assert cond.embeds.shape == (2, 16 + 2 * 16 + 1, 32) and not cond.ids.any()
    assert hidream.tokenizers[3].pad_token == hidream.tokenizers[3].eos_token  # as the pipeline sets it


def test_defaults_and_schedule_are_the_pipelines(hidream):
    from diffusers.pipelines.hidream_image.pipeline_hidream_image import calculate_shift, retrieve_timesteps

    assert (hidream.default_guidance_scale, hidream.default_num_inference_steps) == (5.0, 50)
    assert hidream.default_size() == (32, 32) and hidream.settings.max_sequence_length == 16  # the tiny model index
    assert hidream.task_type == "T2I" and not hidream.accepts_image_conditioning
    pipe = hidream.reference_pipeline()
    retrieve_timesteps(pipe.scheduler, 6, "cpu", mu=calculate_shift(hidream.transformer.max_seq))
    torch.testing.assert_close(hidream.sigmas(6, 32, 32), pipe.scheduler.sigmas.float(), rtol=0, atol=0)
    assert pipe.scheduler.config.shift == 3.0 and not pipe.scheduler.config.use_dynamic_shifting


def test_experts_get_gradients(hidream):
    """diffusers runs the experts under no_grad in eval mode; here the routed experts and the router are trained
    too, and the differentiable experts give the same velocity as diffusers' `moe_infer`."""
    from diffusers.models.transformers.transformer_hidream_image import MOEFeedForwardSwiGLU

    moe = next(m for m in hidream.transformer.modules() if isinstance(m, MOEFeedForwardSwiGLU))
    x = torch.randn(2, 10, moe.gate.gating_dim, generator=torch.Generator().manual_seed(0))
    flat = x.view(-1, x.shape[-1])
    idx, weight, _ = moe.gate(x)
    reference = moe.moe_infer(flat, idx.view(-1), weight.view(-1, 1)).view(x.shape) + moe.shared_experts(x)
    torch.testing.assert_close(moe(x), reference, rtol=0, atol=1e-6)
    cond = hidream.encode_prompts([PROMPT])
    latents = hidream.prepare_latents(make_generators([0]), 32, 32)
    hidream.transformer.requires_grad_(True)  # loaded frozen, as the trainer receives it
    try:
        hidream.velocity(hidream.transformer, latents, torch.tensor([0.7]), cond, None, 1.0).square().sum().backward()
        grads = {n: p.grad for n, p in hidream.transformer.named_parameters()}
    finally:
        hidream.transformer.requires_grad_(False).zero_grad(set_to_none=True)
    routed = [n for n, g in grads.items() if ".experts." in n and g is not None and g.abs().max() > 0]
    assert routed and grads["double_stream_blocks.0.block.ff_i.gate.weight"].abs().max() > 0


def test_sample_k_is_the_same_in_any_microgroup(hidream):
    assert_sample_k_is_the_same_in_any_microgroup(hidream, guidance_scale=3.0, negative_prompt="blurry", height=32,
                                                  width=32)


def test_trainer_batch_of_mixed_timesteps_is_row_wise(hidream):
    """A training micro-batch mixes timesteps and prompts: each row's velocity equals that row alone."""
    cond = hidream.encode_prompts([PROMPT, LONG_PROMPT, PROMPT])
    latents = hidream.prepare_latents(make_generators([0, 1, 2]), 32, 32)
    sigma = torch.tensor([0.9, 0.4, 0.4])
    together = hidream.velocity(hidream.transformer, latents, sigma, cond, None, 1.0)
    for i in range(3):
        row = Latents(latents.tokens[i : i + 1], latents.ids)
        alone = hidream.velocity(hidream.transformer, row, sigma[i : i + 1],
                                 PromptEmbeds(cond.embeds[i : i + 1], cond.ids), None, 1.0)
        torch.testing.assert_close(together[i : i + 1], alone, rtol=0, atol=1e-6)


def test_registry_finds_the_family_by_name_and_by_transformer_class(hidream_dir, tmp_path, monkeypatch):
    assert_registry_finds(HiDreamFamily, hidream_dir, tmp_path, ("HiDream-I1-Dev",), monkeypatch)


def test_bad_requests_are_refused(hidream):
    """Text to image only: an image-conditioned request is refused; so is a size that is not a multiple of the
    patch."""
    engine = Engine(hidream, EngineConfig(max_outputs_per_request=4))
    with pytest.raises(RequestError, match="height=30: HiDream-I1 needs a positive multiple of 4"):
        engine.generate(RolloutRequest(prompt="a cat", height=30, width=32))  # 16 at real size
    with pytest.raises(RequestError, match="32x160: this HiDream-I1 checkpoint makes non-square images of at most 256"):
        engine.generate(RolloutRequest(prompt="a cat", height=32, width=160))  # padded to max_seq patches: too many
    assert engine.generate(RolloutRequest(prompt="a cat", height=32, width=48, num_inference_steps=1))  # fits
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", image="data:image/png;base64,AAAA", height=32, width=32))
    assert err.value.field == "image"


def test_conditioning_round_trips_the_wire(hidream):
    cond = hidream.encode_prompts([PROMPT])
    wire = hidream.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    assert wire["encoder_hidden_states_llama3"].shape == (2, 16, 24) and wire["pooled_embeds"].shape == (24,)
    back, _ = HiDreamFamily.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds) and torch.equal(back.ids, cond.ids)
    with pytest.raises(ValueError, match="encoder_hidden_states_llama3"):
        HiDreamFamily.cond_kwargs_from_wire({**wire, "encoder_hidden_states_llama3": None})


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), ("nft", False)], ids=["grpo-lora", "nft-full"])
def test_training_runs_on_hidream(hidream_dir, tmp_path, loss_type, lora):
    """Two rollouts of Flow-GRPO (LoRA, CFG 2 with the empty negative prompt) and of DiffusionNFT (full)."""
    records = run_training(hidream_dir, tmp_path / "run", loss_type, lora, guidance=2.0,
                           extra_flags=("--num-rollout", "2"))
    assert len([r for r in records if "train/loss" in r]) == 2
