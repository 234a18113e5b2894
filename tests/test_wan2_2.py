"""The wan2_2 family (video) against diffusers' WanPipeline, on tiny random checkpoints built in code."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.wire import decode_outputs, encode_outputs
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.models.wan2_2 import Wan22Family
from diffrl.sampling import make_generators

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 1.2e-6)
HEIGHT, WIDTH, FRAMES = 16, 32, 5  # latents [4, 2, 2, 4]: 2 latent frames, 4 tokens each
# Text tokens per prompt (the pipeline's default is 512): with a few words in 512 zero-padded tokens, a
# random model's video barely depends on the prompt, and the different-prompt check below needs it to.
TEXT_TOKENS = 16


@pytest.fixture(scope="module")
def wan_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.2-tiny")


@pytest.fixture(scope="module")
def wan(wan_dir) -> Wan22Family:
    return Wan22Family.load(wan_dir, max_sequence_length=TEXT_TOKENS)


@pytest.fixture(scope="module")
def wan_one_expert(tmp_path_factory) -> Wan22Family:
    path = save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.1-tiny", two_experts=False)
    return Wan22Family.load(path, max_sequence_length=TEXT_TOKENS)


def _pipeline_videos(family, prompt, negative, guidance, guidance_2, noise, steps):
    """WanPipeline's videos as [B, C, F, H, W] (it returns frames first)."""
    frames = family.reference_pipeline()(
        prompt=prompt, negative_prompt=negative if guidance > 1 else None, latents=noise, num_inference_steps=steps,
        guidance_scale=guidance, guidance_scale_2=guidance_2, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        num_videos_per_prompt=len(noise), max_sequence_length=TEXT_TOKENS, output_type="pt").frames
    return frames.permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize(("experts", "negative", "guidance", "guidance_2"), [
    (2, "blurry", 4.5, 2.0), (2, "", 4.5, None), (2, "", 1.0, None), (1, "blurry", 5.0, None), (1, "", 1.0, None)],
    ids=["two-experts-cfg-own-scale-2", "two-experts-cfg", "two-experts-no-cfg", "one-expert-cfg", "one-expert-no-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(wan, wan_one_expert, experts, negative, guidance, guidance_2):
    """ODE sampling through our engine gives WanPipeline's videos from the same noise."""
    family = wan if experts == 2 else wan_one_expert
    steps, seed = 4, 3
    sigmas = family.sigmas(steps, HEIGHT, WIDTH)
    if experts == 2:  # the boundary (0.875 · 1000) falls inside the schedule: both experts run
        high = family.transformer.high_noise(sigmas[:-1] * 1000)
        assert high.any() and not high.all()
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(RolloutRequest(prompt="a red cat", negative_prompt=negative, seed=seed,
                                             num_outputs_per_prompt=2, num_inference_steps=steps,
                                             guidance_scale=guidance, guidance_scale_2=guidance_2, height=HEIGHT,
                                             width=WIDTH, num_frames=FRAMES))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = family.prepare_latents(make_generators([seed, seed + 1]), HEIGHT, WIDTH, num_frames=FRAMES).tokens
    reference = _pipeline_videos(family, "a red cat", negative, guidance, guidance_2, noise, steps)
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    assert 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _pipeline_videos(family, "a green dog", negative, guidance, guidance_2, noise, steps)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail
    if guidance_2 is not None:  # the low-noise expert's own scale is used
        same_scale = _pipeline_videos(family, "a red cat", negative, guidance, guidance, noise, steps)
        assert (same_scale - reference).abs().max() > 100 * TOLERANCE


def test_the_experts_are_switched_at_the_boundary(wan):
    """Timesteps at or above boundary_ratio × num_train_timesteps go to `transformer`, below to
    `transformer_2`; one batch mixing both (a training micro-batch) equals each row run on its expert."""
    experts = wan.transformer
    assert experts.boundary_timestep == 875.0
    t = torch.tensor([875.0, 874.9, 1000.0, 3.0])
    assert experts.high_noise(t).tolist() == [True, False, True, False]
    x = torch.randn(4, 4, 2, 2, 4)
    text = wan.encode_prompts(["a cat", "a dog", "red", "blue"]).embeds
    mixed = experts(x, t, text)[0]
    for i, expert in enumerate([experts.transformer, experts.transformer_2] * 2):
        alone = expert(x[i : i + 1], t[i : i + 1], text[i : i + 1], return_dict=False)[0]
        torch.testing.assert_close(mixed[i : i + 1], alone, rtol=0, atol=1e-6)
    assert len(wan.transformer.expert_blocks) == 4  # both experts' blocks: FSDP units, compilation


def test_sample_k_is_the_same_in_any_microgroup(wan):
    # 3 steps: σ·1000 = 1000, 750, 3, so the two SDE steps run one expert each.
    assert_sample_k_is_the_same_in_any_microgroup(wan, guidance_scale=4.5, guidance_scale_2=2.0, height=HEIGHT,
                                                  width=WIDTH, num_frames=FRAMES)


def test_video_outputs_cross_the_wire(wan):
    """msgpack + safetensors carry a [C, F, H, W] video and its 5-D trajectory latents unchanged."""
    outputs = Engine(wan).generate(RolloutRequest(
        prompt="a red cat", num_outputs_per_prompt=2, num_inference_steps=2, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, rollout=True, rollout_return_dit_trajectory=True, rollout_return_denoising_env=True))
    decoded = decode_outputs(encode_outputs(outputs))
    assert decoded[0].generated_output.shape == (3, FRAMES, HEIGHT, WIDTH)
    assert decoded[0].dit_trajectory.latents.shape == (3, 4, 2, 2, 4)  # steps 0, 1, 2 of 2 SDE steps
    for ours, back in zip(outputs, decoded, strict=True):
        assert torch.equal(ours.generated_output, back.generated_output)
        assert torch.equal(ours.dit_trajectory.latents, back.dit_trajectory.latents)
        assert torch.equal(ours.rollout_log_probs, back.rollout_log_probs)
    assert float(decoded[0].denoising_env["guidance_scale_2"]) == 5.0  # unset: guidance_scale, as the pipeline


@pytest.mark.parametrize("guidance_2", [2.0, None], ids=["own-scale-2", "unset"])
def test_sglang_json_keeps_the_second_experts_guidance_scale_in_the_denoising_env(wan, guidance_2):
    """Through sglang's JSON (whose denoising_env has no field for it) the decoded conditioning still carries
    `guidance_scale_2`, as the engine's own: the request's, or guidance_scale when the request leaves it unset."""
    from diffrl.serving import sglang

    req = RolloutRequest(prompt="a red cat", num_inference_steps=2, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                         guidance_scale=4.5, guidance_scale_2=guidance_2, rollout=True,
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    outputs = Engine(wan).generate(sglang.engine_request(req))
    expected = outputs[0].denoising_env["guidance_scale_2"]
    assert float(expected) == (guidance_2 or 4.5)
    payload = sglang.encode_response(outputs, req, wan, "request")
    families = [wan] if guidance_2 is None else [wan, Wan22Family]  # a class cannot tell an unset scale's value
    for family in families:
        env = sglang.decode_response(payload, req, family)[0].denoising_env
        assert torch.equal(env["guidance_scale_2"], expected) and torch.equal(env["guidance_scale"], torch.tensor(4.5))


def test_defaults_schedule_and_family_name(wan, wan_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler

    assert wan.default_size() == (480, 832) and wan.default_num_frames == 81  # WanPipeline's defaults
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    scheduler.set_timesteps(10)
    torch.testing.assert_close(wan.sigmas(10, HEIGHT, WIDTH), scheduler.sigmas.float())
    assert resolve_family(None, wan_dir) is Wan22Family


def test_unipc_checkpoints_get_unipc_flow_sigmas(tmp_path):
    from diffusers import UniPCMultistepScheduler

    family = Wan22Family.load(save_random_checkpoint(tmp_path / "wan-unipc", scheduler="unipc", shift=5.0))
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    scheduler.set_timesteps(6)
    sigmas = family.sigmas(6, HEIGHT, WIDTH)
    torch.testing.assert_close(sigmas, scheduler.sigmas.float())
    assert sigmas[-1] == 0 and len(sigmas) == 7


def test_bf16_weights_sample_without_autocast(wan_dir, wan):
    """Loaded in bf16 (`diffrl bench`'s default --dtype), the experts keep their fp32 modules (diffusers'
    `_keep_in_fp32_modules`: the first parameter is fp32), and the latents go in as the weights' bf16: they went in
    as fp32 and the patch embedding refused them ("Input type (float) and bias type (BFloat16)")."""
    bf16 = Wan22Family.load(wan_dir, dtype=torch.bfloat16, max_sequence_length=TEXT_TOKENS)
    request = RolloutRequest(prompt="a red cat", num_inference_steps=2, guidance_scale=4.5, height=HEIGHT, width=WIDTH,
                             num_frames=FRAMES)
    video = Engine(bf16).generate(request)[0].generated_output
    reference = Engine(wan).generate(request)[0].generated_output
    assert (video - reference).abs().max() < 0.05  # bf16 rounding only


def test_unipc_checkpoints_give_the_transformer_the_schedulers_integer_timesteps(tmp_path):
    """WanPipeline calls each expert at the scheduler's timestep, an integer for UniPC (Wan's published scheduler):
    the engine passed σ·1000 (999.999, 978.28, … for 999, 978, …), a model input the pipeline never gives."""
    from diffusers import UniPCMultistepScheduler

    family = Wan22Family.load(save_random_checkpoint(tmp_path / "wan-unipc", scheduler="unipc", shift=5.0,
                                                     boundary_ratio=0.9), max_sequence_length=TEXT_TOKENS)
    seen = []
    for expert in family.transformer.experts:
        expert.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[1][0].item()),
                                         with_kwargs=True)
    output = Engine(family).generate(RolloutRequest(
        prompt="a cat", num_inference_steps=6, guidance_scale=1.0, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        rollout=True, rollout_return_dit_trajectory=True, rollout_return_step_indices=list(range(6))))[0]
    reference = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0)
    reference.set_timesteps(6)
    assert seen == reference.timesteps.tolist()
    assert output.dit_trajectory.timesteps.tolist() == seen  # the trajectory reports the model's timesteps too
    assert family.transformer.high_noise(torch.tensor(seen)).tolist() == [t >= 900 for t in seen]  # as the pipeline


@pytest.mark.parametrize(("fields", "field"), [
    (dict(height=24), "height"), (dict(width=16 * 8 * 33), "width"),
    (dict(num_frames=6), "num_frames"),
    (dict(image="data:image/png;base64,AAAA"), "image"), (dict(true_cfg_scale=4.0, guidance_scale=0.5), "guidance_scale"),
    (dict(guidance_scale=1.0, guidance_scale_2=3.0), "guidance_scale_2"),
])
def test_bad_video_requests_are_refused_by_name(wan, fields, field):
    engine = Engine(wan)
    request = dict(prompt="a cat", height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=1)
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(**{**request, **fields}))
    assert err.value.field == field
    assert engine.in_flight == 0 and len(engine.generate(RolloutRequest(**request))) == 1


def test_zero_sizes_are_refused_by_the_request_schema():
    """A size of 0 used to mean "the default"; the schema now refuses it, naming the field."""
    from pydantic import ValidationError

    for field in ("width", "height", "num_frames"):
        with pytest.raises(ValidationError, match=field):
            RolloutRequest(prompt="a cat", **{field: 0})


def test_guidance_scale_2_needs_a_second_expert(wan_one_expert, tiny_family):
    """A one-expert checkpoint and the image families refuse guidance_scale_2 by name; image families
    still refuse num_frames > 1 and accept 1."""
    for family, frames in ((wan_one_expert, dict(height=16, width=16, num_frames=5)), (tiny_family, {})):
        with pytest.raises(RequestError) as err:
            Engine(family).generate(RolloutRequest(prompt="a cat", guidance_scale=4.0, guidance_scale_2=3.0,
                                                   num_inference_steps=1, **frames))
        assert err.value.field == "guidance_scale_2"
    engine = Engine(tiny_family)
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(prompt="a cat", num_frames=5, num_inference_steps=1))
    assert err.value.field == "num_frames"
    image = engine.generate(RolloutRequest(prompt="a cat", num_frames=1, num_inference_steps=1))[0].generated_output
    assert image.dim() == 3


def test_bad_checkpoints_are_refused(wan_dir, tmp_path):
    broken = tmp_path / "wan2.2-broken"
    shutil.copytree(wan_dir, broken)
    index = broken / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "expand_timesteps": True}))
    with pytest.raises(ModelLoadError, match="TI2V"):
        Wan22Family.load(broken)
    # Wan2.2 I2V A14B's index over a text-to-video transformer (image-to-video's takes the image latents and a
    # mask as extra input channels): refused at load, not in the denoising loop on a shape mismatch.
    index.write_text(json.dumps({**json.loads(index.read_text()), "expand_timesteps": False,
                                 "_class_name": "WanImageToVideoPipeline", "image_encoder": [None, None]}))
    with pytest.raises(ModelLoadError, match=r"WanImageToVideoPipeline checkpoint but its transformer has "
                                             r"in_channels=4; image-to-video takes 12"):
        Wan22Family.load(broken)
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": "WanPipeline"}))
    shutil.rmtree(broken / "transformer_2")
    with pytest.raises(ModelLoadError, match="boundary_ratio=0.875 but there is no .*transformer_2"):
        Wan22Family.load(broken)
    (broken / "vae" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*vae/config.json"):
        Wan22Family.load(broken)


# The NFT full finetune of both experts is slow; the LoRA run trains both experts in the default run.
@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)], ids=["grpo-lora", "nft-full"])
def test_training_run_on_wan(wan_dir, tmp_path, loss_type, lora):
    """Both experts train (2 steps: σ·1000 = 1000 and 3, one per expert): LoRA on both, or full weights.
    Flow-GRPO rolls out with a second CFG scale for the low-noise expert, and its replay matches the
    rollout's log-probs (run_training checks), so the trainer uses that scale too."""
    second = {"diffusion_guidance_scale_2": 2.0} if loss_type == "flow_grpo" else {}
    run_training(wan_dir, tmp_path / "run", loss_type, lora, guidance=4.5,
                 video=dict(resolution=HEIGHT, num_frames=FRAMES, **second))
    from diffrl.models.checkpoint import load_model

    trained = load_model(wan_dir, tmp_path / "run" / "checkpoints" / "rollout-00001").transformer.state_dict()
    base = load_model(wan_dir).transformer.state_dict()
    for expert in ("transformer.", "transformer_2."):
        if lora:
            assert any(n.startswith(expert) and "lora_B" in n and w.abs().max() > 0 for n, w in trained.items())
        else:
            assert any(n.startswith(expert) and not torch.equal(w, base[n]) for n, w in trained.items())
    if lora:  # each expert's adapter goes into WanPipeline's own module with PEFT, as docs/training.md says
        import warnings

        from diffusers import WanPipeline
        from peft import PeftModel

        pipe = WanPipeline.from_pretrained(wan_dir)
        for expert in ("transformer", "transformer_2"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # PEFT only warns of missing keys, keeping B = 0: the base model
                loaded = PeftModel.from_pretrained(getattr(pipe, expert),
                                                   str(tmp_path / "run" / "checkpoints" / "rollout-00001" / "lora" / expert))
            adapter = {n.removeprefix("base_model.model."): w for n, w in loaded.state_dict().items() if "lora_" in n}
            ours = {n.removeprefix(f"{expert}."): w for n, w in trained.items() if n.startswith(f"{expert}.") and "lora_" in n}
            assert adapter.keys() == ours.keys() and all(torch.equal(adapter[n], w) for n, w in ours.items())


@pytest.mark.slow  # two ranks: tests/test_parallel.py covers them on the demo family
def test_two_rank_training_matches_one_process(wan_dir, tmp_path):
    """`diffrl train` under torchrun (two gloo ranks, FSDP2 over both experts' blocks) equals one process. NFT
    with micro-batches of one pair: each rank's pairs route to experts by their own samples' timesteps, so
    the ranks' micro-batches use different experts (a rank runs the other expert on one idle row)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file

    flags = ["train", "--model-path", str(wan_dir), "--loss-type", "nft", "--num-rollout", "1",
             "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-microgroup-size", "2",
             "--global-batch-size", "4", "--num-steps-per-rollout", "1", "--micro-batch-size", "1",
             "--diffusion-num-steps", "2", "--diffusion-guidance-scale", "1.0", "--lr", "1e-3",
             "--eval-images-per-category", "0", "--checkpoint-interval", "1", "--device", "cpu", "--no-use-lora",
             "--reward", "rewards_for_tests:darkness", f"--resolution={HEIGHT}", f"--num-frames={FRAMES}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent)}
    env.pop("WORLD_SIZE", None)
    runs = {}
    for name, launcher in (("single", [sys.executable, "-m", "diffrl.cli.main"]),
                           ("ranks", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                      "--master-port", "29543", "-m", "diffrl.cli.main"])):
        out = tmp_path / name
        done = subprocess.run(launcher + flags + ["--output-dir", str(out)], capture_output=True, text=True,
                              timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        record = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        model = out / "checkpoints" / "rollout-00001" / "model"
        runs[name] = record, {expert: load_file(str(model / expert / "diffusion_pytorch_model.safetensors"))
                              for expert in ("transformer", "transformer_2")}
    (single, w_single), (ranks, w_ranks) = runs["single"], runs["ranks"]
    for key in ("rollout/reward/raw_mean", "train/loss", "train/grad_norm"):
        assert ranks[key] == pytest.approx(single[key], rel=1e-5), key
    for expert, weights in w_single.items():
        for name, w in weights.items():
            torch.testing.assert_close(w_ranks[expert][name], w, rtol=1e-5, atol=1e-6, msg=f"{expert}.{name}")


def test_video_training_flags_are_checked(wan_dir, tiny_model_dir, tmp_path):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    flags = dict(num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2, rollout_microgroup_size=2,
                 global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2, diffusion_num_steps=2,
                 diffusion_sde_window_range=(0, 2), device="cpu")
    with pytest.raises(ValueError, match="generates video .* --eval-images-per-category 0"):
        Trainer(TrainConfig.flat(model_path=wan_dir, output_dir=tmp_path / "a", **flags))
    with pytest.raises(ValueError, match="--num-frames 6: num_frames=6"):
        Trainer(TrainConfig.flat(model_path=wan_dir, output_dir=tmp_path / "b", resolution=16, num_frames=6,
                            eval_images_per_category=0, **flags))
    with pytest.raises(ValueError, match="--num-frames 5: the demo family generates images"):
        Trainer(TrainConfig.flat(model_path=tiny_model_dir, output_dir=tmp_path / "c", num_frames=5, **flags))
    with pytest.raises(ValueError, match="--reward-frames 3: the demo family generates images"):
        Trainer(TrainConfig.flat(model_path=tiny_model_dir, output_dir=tmp_path / "d", reward_frames=3, **flags))
    with pytest.raises(ValueError, match="--height 16 --width 20: width=20"):
        Trainer(TrainConfig.flat(model_path=wan_dir, output_dir=tmp_path / "e", height=16, width=20,
                                 eval_images_per_category=0, **flags))
    # Refused at start-up by its flag's name: it failed at the first rollout, after the model load, naming the
    # request's field.
    with pytest.raises(ValueError, match="--diffusion-guidance-scale-2 2.0: the demo family has no second expert"):
        Trainer(TrainConfig.flat(model_path=tiny_model_dir, output_dir=tmp_path / "f", diffusion_guidance_scale=4.0,
                                 diffusion_guidance_scale_2=2.0, **flags))
    # A second expert's CFG without CFG: GRPO failed at its first rollout, NFT (CFG-free rollouts) at its first
    # held-out evaluation.
    with pytest.raises(ValueError, match=r"--diffusion-guidance-scale-2 3.0 needs CFG, .* --diffusion-guidance-scale > 1"):
        TrainConfig.flat(loss_type="nft", diffusion_guidance_scale=1.0, diffusion_guidance_scale_2=3.0).check()
    TrainConfig.flat(diffusion_guidance_scale=1.0, diffusion_guidance_scale_2=1.0).check()  # no CFG for either


def test_the_second_experts_scale_reaches_rollout_and_replay(wan_dir, tmp_path, monkeypatch):
    """--diffusion-guidance-scale-2 goes into the rollout request and into the trainer's replay of each step
    (a tiny random model's CFG barely moves its velocity, so the calls are checked, not the log-probs)."""
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    cfg = TrainConfig.flat(
        model_path=wan_dir, loss_type="flow_grpo", num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
        rollout_microgroup_size=2, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
        diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), diffusion_guidance_scale=4.5,
        diffusion_guidance_scale_2=2.0, eval_images_per_category=0, device="cpu", use_lora=True, lora_rank=2,
        reward="rewards_for_tests:darkness", output_dir=tmp_path / "run", resolution=HEIGHT, num_frames=FRAMES)
    trainer = Trainer(cfg)
    family, calls = trainer.policy.family, []
    real = family.velocity_and_uncond

    def velocity(*args, **kwargs):
        calls.append((torch.is_grad_enabled(), kwargs.get("guidance_scale_2")))
        return real(*args, **kwargs)

    monkeypatch.setattr(family, "velocity_and_uncond", velocity)
    assert trainer.objective.request(0)["guidance_scale_2"] == 2.0
    trainer.rollout_and_update(0)
    assert {grad for grad, _ in calls} == {False, True}  # the engine's steps and the trainer's replay
    assert all(scale == 2.0 for _, scale in calls), calls
    # DiffusionNFT's rollouts with CFG (--nft-rollout-guidance-scale) run the low-noise expert at its own scale too
    # (they ran it at the rollout's CFG scale); CFG-free ones at none.
    for rollout_cfg, second in ((4.5, 2.0), (1.0, None)):
        nft = Trainer(cfg.replace(loss_type="nft", nft_rollout_guidance_scale=rollout_cfg, output_dir=tmp_path / f"nft-{rollout_cfg}"))
        assert nft.objective.request(0).get("guidance_scale_2") == second


def test_a_video_evaluation_writes_every_video_and_a_frame_grid(wan, tmp_path):
    """Held-out evaluation of a video family: videos through the engine, scored as videos, every one written
    (animated PNG with all its frames) and a frame grid beside the first-frame grid."""
    from PIL import Image

    from diffrl.data.prompts import PromptRecord
    from diffrl.evaluation.reward_eval import evaluate_with_reward

    out = tmp_path / "eval"
    result = evaluate_with_reward(wan, [PromptRecord("a cat", {}), PromptRecord("a dog", {})], "temporal_consistency",
                                  num_steps=2, guidance_scale=1.0, resolution=HEIGHT, num_frames=FRAMES, out_dir=out)
    assert result.images.shape[2] == FRAMES and 0 < result.summary["eval/reward"] < 1
    for name in ("00000.png", "00001.png"):
        with Image.open(out / "images" / name) as video:
            assert video.n_frames == FRAMES
    assert (out / "frames.png").is_file() and (out / "grid.png").is_file() and (out / "report.json").is_file()


def test_non_square_size_and_reward_frames_reach_rollouts_and_evaluation(wan_dir, tmp_path):
    """--height/--width size the rollouts and the held-out videos; --reward-frames K shows the reward K evenly
    spaced frames of each video, in the rollouts (here through a reward worker process) and in evaluation."""
    from PIL import Image

    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.txt").write_text("a red cat\na blue dog\n")
    (data / "test.txt").write_text("a green cat\n")
    out = tmp_path / "run"
    cfg = TrainConfig.flat(
        model_path=wan_dir, prompt_data=data, num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
        rollout_microgroup_size=1, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
        diffusion_num_steps=2, diffusion_sde_window_range=(0, 2), diffusion_num_sde_steps=1, device="cpu",
        use_lora=True, lora_rank=2, eval_images_per_category=0, eval_num_prompts=1, output_dir=out,
        height=HEIGHT, width=WIDTH, num_frames=FRAMES, reward_frames=2, reward="rewards_for_tests:frame_count",
        reward_workers=1)
    trainer = Trainer(cfg)
    request = trainer.objective.request(0)
    assert (request["height"], request["width"], request["num_frames"]) == (HEIGHT, WIDTH, FRAMES)
    last = trainer.train()
    assert last["rollout/reward/raw_mean"] == 2.0 and last["eval/reward"] == 2.0  # 2 of 5 frames, both times
    with Image.open(out / "eval" / "rollout-00001" / "images" / "00000.png") as video:  # written whole
        assert video.size == (WIDTH, HEIGHT) and video.n_frames == FRAMES
    summary = json.loads((out / "eval" / "rollout-00001" / "report.json").read_text())
    assert (summary["config"]["height"], summary["config"]["width"], summary["config"]["reward_frames"]) == (
        HEIGHT, WIDTH, 2)


def test_held_out_evaluation_samples_with_the_runs_second_expert_scale(wan, tmp_path):
    """The trainer's held-out evaluation samples at the rollouts' CFG, the low-noise expert's scale
    (--diffusion-guidance-scale-2) included: it sampled that expert at --diffusion-guidance-scale."""
    from diffrl.evaluation.sampling import TEST_SEED
    from diffrl.tasks import build_task
    from diffrl.train.config import TrainConfig

    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "train.txt").write_text("a dog\n")
    (tmp_path / "prompts" / "test.txt").write_text("a red cat\n")
    cfg = TrainConfig.flat(prompt_data=tmp_path / "prompts", reward="temporal_consistency", eval_num_prompts=1,
                           diffusion_num_steps=3, diffusion_guidance_scale=4.5, diffusion_guidance_scale_2=2.0,
                           height=HEIGHT, width=WIDTH, num_frames=FRAMES)
    evaluated = build_task(cfg).evaluate(wan, 0, tmp_path / "eval").images[0]

    def sampled(guidance_2):
        return Engine(wan).generate(RolloutRequest(
            prompt="a red cat", seed=TEST_SEED, num_inference_steps=3, guidance_scale=4.5, guidance_scale_2=guidance_2,
            height=HEIGHT, width=WIDTH, num_frames=FRAMES, generator_device="cpu"))[0].generated_output

    assert torch.equal(evaluated, sampled(2.0))
    assert (sampled(4.5) - evaluated).abs().max() > 100 * TOLERANCE  # the comparison can fail
    summary = json.loads((tmp_path / "eval" / "rollout-00000" / "report.json").read_text())
    assert summary["config"]["guidance_scale_2"] == 2.0


def test_diffrl_evaluate_takes_the_second_experts_scale(wan_dir, tmp_path):
    """`diffrl evaluate --guidance-scale-2` samples the low-noise expert at its own scale, as a Wan2.2 run's
    rollouts and held-out evaluation do (without it, a run's evaluation could not be reproduced)."""
    from diffrl.cli.evaluate import EvaluateConfig, evaluate

    (tmp_path / "prompts.txt").write_text("a red cat\n")
    common = dict(model_path=wan_dir, prompt_data=tmp_path / "prompts.txt", reward="temporal_consistency", num_steps=3,
                  guidance_scale=4.5, height=HEIGHT, width=WIDTH, num_frames=FRAMES, device="cpu")
    scores = {}
    for scale in (2.0, None):
        out = tmp_path / f"eval-{scale}"
        evaluate(EvaluateConfig(**common, guidance_scale_2=scale, output_dir=out))
        summary = json.loads((out / "report.json").read_text())
        assert summary["config"]["guidance_scale_2"] == scale
        scores[scale] = summary["eval/reward"]
    assert scores[2.0] != scores[None]


def test_diffrl_compare_takes_the_second_experts_scale(wan_dir, tmp_path):
    """`diffrl compare --guidance-scale-2`: the CFG columns (base with CFG, trained) sample the low-noise expert at
    its own scale; the column without CFG has none."""
    from diffrl.cli.compare import CompareConfig, compare

    (tmp_path / "prompts.txt").write_text("a red cat\n")
    out = tmp_path / "compare"
    compare(CompareConfig(base=wan_dir, trained=wan_dir, prompt_data=tmp_path / "prompts.txt",
                          reward="temporal_consistency", num_steps=3, guidance_scale=4.5, guidance_scale_2=2.0,
                          height=HEIGHT, width=WIDTH, num_frames=FRAMES, device="cpu", output_dir=out))
    used = {c: json.loads((out / c / "report.json").read_text())["config"]["guidance_scale_2"]
            for c in ("base_cfg", "base_nocfg", "trained")}
    assert used == {"base_cfg": 2.0, "base_nocfg": None, "trained": 2.0}


# ---------------------------------------------------------------- --offload-idle-expert
def _expert_storage(expert) -> dict[str, int]:
    return {name: p.data_ptr() for name, p in expert.named_parameters()}


def test_an_idle_experts_weights_wait_on_the_host_and_the_samples_do_not_change(wan_dir, monkeypatch):
    """With the idle expert offloaded a request samples bit for bit what it does without; during a forward its expert
    holds visiting copies while the other holds none. On a CPU a visit would take the host tensor itself: here it
    copies, as on a GPU, so which copy each expert holds can be seen."""
    from diffrl.utils.offload import FrozenOffload

    monkeypatch.setattr(FrozenOffload, "to_device", staticmethod(lambda host, device: host.clone()))
    family = Wan22Family.load(wan_dir, max_sequence_length=TEXT_TOKENS)
    request = RolloutRequest(prompt="a cat", negative_prompt="", seed=3, num_outputs_per_prompt=2, height=HEIGHT,
                             width=WIDTH, num_frames=FRAMES, num_inference_steps=3, guidance_scale=4.5,
                             guidance_scale_2=2.0, rollout=True, rollout_sde_step_indices=[0, 1],
                             rollout_return_dit_trajectory=True)
    before = Engine(family).generate(request)
    experts = family.transformer
    held = family.offload_idle_expert(torch.device("cpu"))
    assert held == sum(p.numel() * p.element_size() for e in experts.experts for p in e.parameters()) + sum(
        b.numel() * b.element_size() for e in experts.experts for b in e.buffers())
    offload = experts.expert_offload
    host = {id(e): _expert_storage(e) for e in experts.experts}
    seen = []
    for expert in experts.experts:
        def look(module, args, expert=expert):
            other = experts.transformer_2 if expert is experts.transformer else experts.transformer
            seen.append((_expert_storage(expert) != host[id(expert)], _expert_storage(other) == host[id(other)]))
        expert.register_forward_pre_hook(look)
    after = Engine(family).generate(request)
    for a, b in zip(before, after, strict=True):
        assert torch.equal(a.generated_output, b.generated_output) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
    # 3 steps with CFG (the halves batched): high, high... then low; every forward on visiting copies of its own
    # expert, the other on its host copy.
    assert seen and all(mine and other_home for mine, other_home in seen)
    assert offload.visits == 2 and family.device == torch.device("cpu")  # high noise in, then low noise in


@pytest.mark.parametrize("compile_blocks", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_run_offloading_the_idle_expert_trains_as_one_keeping_both(wan_dir, tmp_path, compile_blocks):
    """Also with the experts' blocks compiled, as the GPU recipes run them: a compiled block reads the weights its
    expert holds when it runs, wherever they waited."""
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    results = []
    for offload in (False, True):
        cfg = TrainConfig.flat(
            model_path=wan_dir, loss_type="flow_grpo", num_rollout=1, rollout_batch_size=1, n_samples_per_prompt=2,
            rollout_microgroup_size=2, global_batch_size=2, num_steps_per_rollout=1, micro_batch_size=2,
            diffusion_num_steps=3, diffusion_sde_window_range=(0, 3), diffusion_num_sde_steps=2,
            diffusion_guidance_scale=4.5, diffusion_guidance_scale_2=2.0, eval_images_per_category=0, device="cpu",
            use_lora=True, lora_rank=2, reward="rewards_for_tests:darkness", output_dir=tmp_path / f"run-{offload}",
            resolution=HEIGHT, num_frames=FRAMES, offload_idle_expert=offload, compile=compile_blocks)
        trainer = Trainer(cfg)
        adapters = {n: p.data_ptr() for n, p in trainer.policy.transformer.named_parameters() if p.requires_grad}
        record = trainer.rollout_and_update(0)
        # The trained adapters never moved; the optimizer stepped them in place.
        assert {n: p.data_ptr() for n, p in trainer.policy.transformer.named_parameters() if p.requires_grad} == adapters
        results.append((record, [p.detach().clone() for p in trainer.policy.params]))
    (kept, weights_kept), (offloaded, weights_offloaded) = results
    assert offloaded["train/log_prob_mean_abs_diff"] == kept["train/log_prob_mean_abs_diff"]
    assert offloaded["train/loss"] == kept["train/loss"] and offloaded["train/grad_norm"] == kept["train/grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(weights_kept, weights_offloaded, strict=True))


def test_offloading_an_idle_expert_is_refused_where_there_is_none_or_nothing_frozen(wan_one_expert, wan_dir,
                                                                                    tiny_family, tmp_path):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    for family in (wan_one_expert, tiny_family):
        with pytest.raises(ModelLoadError, match="--offload-idle-expert: the .* runs one transformer"):
            family.offload_idle_expert(torch.device("cpu"))
    cfg = TrainConfig.flat(model_path=wan_dir, loss_type="nft", num_rollout=1, rollout_batch_size=1,
                           n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=2, micro_batch_size=2,
                           diffusion_num_steps=2, eval_images_per_category=0, device="cpu", use_lora=False,
                           reward="rewards_for_tests:darkness", output_dir=tmp_path / "run", resolution=HEIGHT,
                           num_frames=FRAMES, offload_idle_expert=True)
    with pytest.raises(ValueError, match="--offload-idle-expert .* needs --use-lora"):
        Trainer(cfg)
