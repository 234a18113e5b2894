"""The ltx2 family (LTX-2.3 text to video) against diffusers' LTX2Pipeline, on tiny random checkpoints built in
code: ODE sampling reproduces the pipeline, CPS rollouts replay exactly, refusals are named, training runs."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.wire import decode_outputs, encode_outputs
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.ltx2 import Ltx2Family, Ltx2Settings
from diffrl.models.random_checkpoints.ltx2 import save_random_checkpoint, tiny
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators, transition

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 2e-6, up to 6 steps)
# The tiny checkpoint's defaults: 9 frames (2 latent frames) of 64 × 96 (2 × 3 tokens), 9 audio tokens, 16 text
# tokens.
HEIGHT, WIDTH, FRAMES = 64, 96, 9
VIDEO_TOKENS, AUDIO_TOKENS = 2 * 2 * 3, 9
# LTX2Pipeline's extra guidance terms off: its CFG alone, one scale for video and audio.
PLAIN_CFG = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": None,
             "audio_stg_scale": 0.0, "audio_modality_scale": 1.0, "audio_guidance_rescale": 0.0}


@pytest.fixture(scope="module")
def ltx_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "ltx-2.3-tiny")


@pytest.fixture(scope="module")
def ltx(ltx_dir) -> Ltx2Family:
    return Ltx2Family.load(ltx_dir)


@pytest.fixture(scope="module")
def ltx_no_registers(tmp_path_factory) -> Ltx2Family:
    """Connectors without learnable registers (LTX-2.0's test models): padded text positions keep Gemma's states."""
    path = save_random_checkpoint(tmp_path_factory.mktemp("models") / "ltx2-no-registers", tiny(registers=None))
    return Ltx2Family.load(path)


def _pipeline_videos(family, prompt, negative, guidance, seeds, steps, frames=FRAMES):
    """LTX2Pipeline's videos as [B, C, F, H, W] (it returns frames first), each output from its own generator."""
    frames = family.reference_pipeline()(
        prompt=prompt, negative_prompt=negative if guidance > 1 else None, generator=make_generators(seeds),
        num_videos_per_prompt=len(seeds), num_inference_steps=steps, guidance_scale=guidance, height=HEIGHT,
        width=WIDTH, num_frames=frames, max_sequence_length=family.settings.max_sequence_length, output_type="pt",
        **PLAIN_CFG).frames
    return frames.permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize(("variant", "negative", "guidance", "frames"), [
    ("registers", "blurry", 3.0, FRAMES), ("registers", "", 1.0, FRAMES), ("no-registers", "", 4.0, FRAMES),
    ("registers", "", 1.0, 17)], ids=["cfg", "no-cfg", "cfg-no-registers", "no-cfg-17-frames"])
def test_engine_reproduces_the_diffusers_pipeline(ltx, ltx_no_registers, variant, negative, guidance, frames):
    """ODE sampling through our engine gives LTX2Pipeline's videos from the same generators (video and audio
    noise drawn from each output's own), also at a frame count other than the checkpoint's default, whose
    schedule is shifted for its own token count."""
    family = ltx if variant == "registers" else ltx_no_registers
    steps, seed = 3, 3
    outputs = Engine(family, EngineConfig(max_outputs_per_request=4)).generate(RolloutRequest(
        prompt="a red cat", negative_prompt=negative, seed=seed, num_outputs_per_prompt=2, num_inference_steps=steps,
        guidance_scale=guidance, height=HEIGHT, width=WIDTH, num_frames=frames))
    ours = torch.stack([o.generated_output for o in outputs])
    reference = _pipeline_videos(family, "a red cat", negative, guidance, [seed, seed + 1], steps, frames)
    assert ours.shape == reference.shape == (2, 3, frames, HEIGHT, WIDTH)
    assert 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    pipe = family.reference_pipeline()  # the text mask the pipeline's transformer gets is ours
    embeds, mask = pipe.encode_prompt("a red cat", do_classifier_free_guidance=False, max_sequence_length=16)[:2]
    assert torch.equal(pipe.connectors(embeds, mask)[2], family.unpack_conditioning(family.encode_prompts(
        ["a red cat"]).embeds)[2])
    if variant == "registers" and guidance > 1:  # the comparison can fail
        other = _pipeline_videos(family, "a green dog", negative, guidance, [seed, seed + 1], steps)
        assert (other - reference).abs().max() > 100 * TOLERANCE


def test_the_schedule_is_the_pipelines(ltx):
    """σ's from the scheduler with μ of the video token count, for any frame count (the pipeline's arithmetic)."""
    import copy

    import numpy as np
    from diffusers.pipelines.ltx2.pipeline_ltx2 import (
        calculate_shift,
        retrieve_timesteps,
    )

    for frames in (FRAMES, 17, 1):
        scheduler = copy.deepcopy(ltx.scheduler)
        tokens = ((frames - 1) // 8 + 1) * (HEIGHT // 32) * (WIDTH // 32)
        mu = calculate_shift(tokens, 1024, 4096, 0.95, 2.05)
        retrieve_timesteps(scheduler, 6, "cpu", None, sigmas=np.linspace(1.0, 1 / 6, 6), mu=mu)
        assert torch.equal(ltx.sigmas(6, HEIGHT, WIDTH, num_frames=frames), scheduler.sigmas)
    assert not torch.equal(ltx.sigmas(6, HEIGHT, WIDTH), ltx.sigmas(6, 512, 768))  # the shift follows the size
    assert float(ltx.sigmas(6, HEIGHT, WIDTH)[-2]) == pytest.approx(0.1)  # stretched to the terminal σ


def test_cps_rollouts_replay_exactly(ltx):
    """CPS rollouts (LTX-2.3's recipe: noise level 0.8, log-probs without constants) give finite log-probs, and
    the trainer's step (the family's velocity and the shared transition) scores them to the bit."""
    sde_steps = [0, 1]
    outputs = Engine(ltx).generate(RolloutRequest(
        prompt="a red cat", negative_prompt="blurry", seed=5, num_outputs_per_prompt=2, num_inference_steps=3,
        guidance_scale=3.0, height=HEIGHT, width=WIDTH, num_frames=FRAMES, rollout=True, rollout_sde_type="cps",
        rollout_noise_level=0.8, rollout_sde_step_indices=sde_steps, rollout_log_prob_no_const=True,
        rollout_return_dit_trajectory=True, rollout_return_denoising_env=True))
    env = outputs[0].denoising_env
    assert env["image_ids"].shape == (VIDEO_TOKENS, 6)  # the video tokens' positions
    cond = PromptEmbeds(env["prompt_embeds"], env["text_ids"])
    uncond = PromptEmbeds(env["negative_prompt_embeds"], env["negative_text_ids"])
    for output in outputs:
        trajectory = output.dit_trajectory
        assert trajectory.latents.shape == (3, VIDEO_TOKENS + AUDIO_TOKENS, 4)  # steps 0–2: video, then audio
        assert output.rollout_log_probs.shape == (2,) and torch.isfinite(output.rollout_log_probs).all()
        sigmas = trajectory.sigmas
        for k, step in enumerate(sde_steps):
            x, x_next = trajectory.latents[k : k + 1], trajectory.latents[k + 1 : k + 2]
            with torch.no_grad():
                v = ltx.velocity(ltx.transformer, Latents(x, env["image_ids"]), sigmas[step].expand(1), cond, uncond,
                                 3.0)
            replay = transition("cps", x, v, sigmas[step], sigmas[step + 1], 0.8, sigma_max=float(sigmas[1]),
                                next_latents=x_next, log_prob_no_const=True)
            assert replay.log_prob.item() == output.rollout_log_probs[k].item()


def test_sample_k_is_the_same_in_any_microgroup(ltx):
    assert_sample_k_is_the_same_in_any_microgroup(ltx, guidance_scale=1.0, rollout_sde_type="cps",
                                                  rollout_noise_level=0.8, height=HEIGHT, width=WIDTH,
                                                  num_frames=FRAMES)


def test_the_batched_forward_is_the_row_by_row_one(ltx):
    """A GPU runs the rows of a batch in one forward (a CPU one at a time, for exactness): the same velocities,
    with each row's own σ and text, to float rounding."""
    latents = ltx.prepare_latents(make_generators([1, 2, 3]), HEIGHT, WIDTH)
    cond = PromptEmbeds(torch.cat([ltx.encode_prompts([p]).embeds for p in ("a cat", "a red dog", "")]),
                        torch.zeros(16, 1))
    sigma = torch.tensor([0.9, 0.5, 0.2])
    with torch.no_grad():
        rows = ltx.run_transformer(ltx.transformer, latents, sigma, cond)
        batched = ltx._forward(ltx.transformer, latents.tokens, latents.ids, sigma, cond.embeds)
    torch.testing.assert_close(batched, rows, rtol=0, atol=1e-5)


def test_video_and_conditioning_cross_the_wire(ltx):
    """msgpack carries the video and the joint latents; the sglang-style cond kwargs map back to the same tensors."""
    outputs = Engine(ltx).generate(RolloutRequest(
        prompt="a red cat", num_outputs_per_prompt=2, num_inference_steps=2, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, rollout=True, rollout_sde_type="cps", rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True))
    decoded = decode_outputs(encode_outputs(outputs))
    assert decoded[0].generated_output.shape == (3, FRAMES, HEIGHT, WIDTH)
    for ours, back in zip(outputs, decoded, strict=True):
        assert torch.equal(ours.dit_trajectory.latents, back.dit_trajectory.latents)
        assert torch.equal(ours.rollout_log_probs, back.rollout_log_probs)
    env = outputs[0].denoising_env
    wire = ltx.cond_kwargs_to_wire(PromptEmbeds(env["prompt_embeds"], env["text_ids"]), env["image_ids"])
    assert wire["encoder_hidden_states"][0].shape == (16, 16)  # 16 text tokens, the video's text width
    assert wire["audio_encoder_hidden_states"][0].shape == (16, 8)
    assert wire["encoder_attention_mask"].tolist() == [1] * 16  # registers: every text token attends
    cond, image_ids = Ltx2Family.cond_kwargs_from_wire(wire)
    assert torch.equal(cond.embeds, env["prompt_embeds"]) and torch.equal(image_ids, env["image_ids"])


def test_defaults_targets_and_family_name(ltx, ltx_dir):
    assert ltx.default_size() == (HEIGHT, WIDTH) and ltx.default_num_frames == FRAMES  # the checkpoint's settings
    assert Ltx2Settings() == Ltx2Settings(1024, 24.0, 121, 512, 768)  # LTX2Pipeline's defaults otherwise
    assert ltx.default_guidance_scale == 3.0
    assert resolve_family(None, ltx_dir) is Ltx2Family
    names = [n for n, _ in ltx.transformer.named_modules()]
    for target in Ltx2Family.lora_target_modules:
        assert any(n.endswith("." + target) for n in names), target
    assert len(ltx.text_encoder_modules()) == 2  # Gemma and the connectors move off the GPU together


@pytest.mark.parametrize(("fields", "field"), [
    ({"height": 48}, "height"), ({"width": 80}, "width"), ({"num_frames": 10}, "num_frames"),
    ({"image": "data:image/png;base64,AAAA"}, "image"), ({"true_cfg_scale": 4.0, "guidance_scale": 0.5}, "guidance_scale"),
    ({"guidance_scale": 4.0, "guidance_scale_2": 3.0}, "guidance_scale_2"), ({"fps": 12}, "fps"),
    ({"num_inference_steps": 1}, "num_inference_steps"),  # the terminal stretch of a 1-step schedule is 0/0
    # One latent row or column: the tiny VAE's decoder pads by reflection (diffusers' default) and cannot.
    ({"height": 32}, "height"), ({"width": 32}, "width"),
])
def test_bad_requests_are_refused_by_name(ltx, fields, field):
    """Image conditioning (image to video) is refused, not ignored; so are sizes the VAE cannot take."""
    engine = Engine(ltx)
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(**{"prompt": "a cat", "num_inference_steps": 2, **fields}))
    assert err.value.field == field
    assert engine.in_flight == 0


def test_condition_images_come_as_image_path(ltx):
    """A request with an image is image to video (tests/test_ltx2_i2v.py); sglang's other image fields are refused
    naming the one to use."""
    with pytest.raises(RequestError) as err:
        Engine(ltx).generate(RolloutRequest(prompt="a cat", num_inference_steps=2, input_reference="x.png"))
    assert err.value.field == "input_reference" and "send the condition images as image_path" in str(err.value)


def test_the_checkpoints_frame_rate_is_accepted(ltx):
    """`fps` equal to the checkpoint's frame rate is the default, not an error (sglang clients send it)."""
    outputs = Engine(ltx).generate(RolloutRequest(prompt="a cat", num_inference_steps=3, fps=24))
    assert len(outputs) == 1 and outputs[0].generated_output.shape[1] == ltx.default_num_frames


def _edit_json(path: Path, **changes) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def test_bad_checkpoints_are_refused(ltx_dir, tmp_path):
    distilled = tmp_path / "LTX-2.3-Distilled"
    shutil.copytree(ltx_dir, distilled)
    with pytest.raises(ModelLoadError, match="distilled"):
        Ltx2Family.load(distilled)
    broken = tmp_path / "ltx2-broken"
    shutil.copytree(ltx_dir, broken)
    _edit_json(broken / "model_index.json", scheduler=["diffusers", "LTXEulerAncestralRFScheduler"])
    with pytest.raises(ModelLoadError, match="scheduler 'LTXEulerAncestralRFScheduler'"):
        Ltx2Family.load(broken)
    _edit_json(broken / "model_index.json", scheduler=["diffusers", "FlowMatchEulerDiscreteScheduler"])
    _edit_json(broken / "audio_vae" / "config.json", mel_bins=16)  # 2 channels × 4 mel bins: 8-wide audio tokens
    with pytest.raises(ModelLoadError, match="audio token is 8 wide"):
        Ltx2Family.load(broken)
    (broken / "connectors" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*connectors/config.json"):
        Ltx2Family.load(broken)


# nft-full is slow as in the other families: grpo-lora keeps LTX-2's forward and backward in the default run, and
# the NFT objective and full finetune are shared trainer code that test_trainer.py covers on the demo family.
@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)],
                         ids=["grpo-lora", "nft-full"])
def test_training_runs_and_its_checkpoint_loads_back(ltx_dir, tmp_path, loss_type, lora):
    """One rollout of Flow-GRPO (LoRA, CPS at noise 0.8, CFG 1: the published LTX-2.3 settings) or DiffusionNFT
    (full finetune); the trainer replays the engine's log-probs exactly and the saved checkpoint loads back."""
    from diffrl.models.checkpoint import load_model
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    out = tmp_path / "run"
    cfg = TrainConfig.flat(
        model_path=ltx_dir, output_dir=out, loss_type=loss_type, num_rollout=1, rollout_batch_size=2,
        n_samples_per_prompt=2, rollout_microgroup_size=1, global_batch_size=4, num_steps_per_rollout=1,
        micro_batch_size=4, diffusion_num_steps=3, diffusion_sde_window_range=(0, 3), diffusion_num_sde_steps=2,
        diffusion_sde_type="cps", diffusion_noise_level=0.8, diffusion_guidance_scale=1.0, lr=1e-3,
        eval_images_per_category=0, eval_interval=10, checkpoint_interval=1, device="cpu", use_lora=lora,
        lora_rank=2, resolution=HEIGHT, num_frames=FRAMES, reward="rewards_for_tests:darkness")
    Trainer(cfg).train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert trained and all(torch.isfinite(torch.tensor(r["train/loss"])) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] == 0.0  # the trainer replays the engine's steps
    weights = load_model(ltx_dir, out / "checkpoints" / "rollout-00001").transformer.state_dict()
    if lora:
        assert any("lora_B" in name and w.abs().max() > 0 for name, w in weights.items())
    else:
        base = load_model(ltx_dir).transformer.state_dict()
        assert any(not torch.equal(w, base[name]) for name, w in weights.items())


def test_the_ltx23_recipe_runs_a_rollout_at_tiny_size(ltx_dir, tmp_path):
    """`diffrl train --recipe ltx23-grpo-pickscore` with only size, steps, batch, reward and output overridden:
    the recipe's CPS, random SDE steps (non-adjacent here), reward frames, microgroup 1, bf16 forward, gradient
    checkpointing and deterministic mode run one rollout and its 2 optimizer steps on a tiny checkpoint."""
    import rewards_for_tests

    from diffrl.cli.main import parse
    from diffrl.train.trainer import Trainer

    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.txt").write_text("a red cat running\na blue dog in rain\n")
    (data / "test.txt").write_text("a green cat\n")
    out = tmp_path / "run"
    cfg = parse(["train", "--recipe", "ltx23-grpo-pickscore", "--model-path", str(ltx_dir), "--device", "cpu",
                 "--height", str(HEIGHT), "--width", str(WIDTH), "--num-frames", str(FRAMES),
                 "--diffusion-num-steps", "6", "--diffusion-sde-window-range", "0,6",
                 "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--global-batch-size", "2",
                 "--num-rollout", "1", "--prompt-data", str(data), "--eval-num-prompts", "1",
                 "--reward", "rewards_for_tests:darkness_noting_frames", "--output-dir", str(out)])
    r = cfg.rollout
    assert (r.diffusion_sde_type, r.diffusion_noise_level, r.diffusion_sde_step_strategy, cfg.task.reward_frames,
            r.rollout_microgroup_size, cfg.model.mixed_precision, cfg.deterministic_mode) == (
        "cps", 0.8, "random", 3, 1, "bf16", True)
    rewards_for_tests.FRAMES_SEEN.clear()
    try:
        trainer = Trainer(cfg)
        steps = trainer.objective.sde_window(0)
        assert len(steps) == 3 and steps[-1] - steps[0] > 2  # rollout 0 of seed 0: 3 steps, not all adjacent
        last = trainer.train()
    finally:
        torch.use_deterministic_algorithms(False)
    assert rewards_for_tests.FRAMES_SEEN and set(rewards_for_tests.FRAMES_SEEN) == {3}  # rollouts and evaluation
    assert last["train/pairs"] == 2 * 2 * 3 and torch.isfinite(torch.tensor(last["train/loss"]))
    assert last["train/log_prob_mean_abs_diff"] < 1e-2  # bf16 forwards (measured: 0 on CPU)
    assert last["rollout/sde_window_start"] == steps[0] and "eval/reward" in last


def test_a_mask_that_masks_nothing_is_not_passed(ltx_dir):
    """LTX-2.3's connectors keep every text token (registers fill the padding): the transformer gets no mask, so
    the text cross-attentions take no bias (fused attention kernels need none), for the same velocity; a
    conditioning with masked (zeroed) tokens still passes its mask."""
    family = Ltx2Family.load(ltx_dir)
    seen = []
    family.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["encoder_attention_mask"]), with_kwargs=True)
    latents = family.prepare_latents(make_generators([1]), HEIGHT, WIDTH, num_frames=FRAMES)
    cond = family.encode_prompts(["a red cat"])
    sigma = torch.tensor([0.6])
    with torch.no_grad():
        unmasked = family.velocity(family.transformer, latents, sigma, cond, None, 1.0)
        assert seen[-1] is None
        family._mask_is_full = lambda embeds, mask: False  # the mask passed as it is, all ones
        masked = family.velocity(family.transformer, latents, sigma, cond, None, 1.0)
        assert seen[-1] is not None and bool(seen[-1].all())
        torch.testing.assert_close(unmasked, masked, rtol=0, atol=1e-6)
        del family._mask_is_full
        holes = cond.embeds.clone()
        holes[:, :3] = 0  # three masked tokens, as connectors without registers leave them
        family.velocity(family.transformer, latents, sigma, type(cond)(holes, cond.ids), None, 1.0)
        assert seen[-1] is not None and not bool(seen[-1][:, :3].any()) and bool(seen[-1][:, 3:].all())
