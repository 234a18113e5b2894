"""The cosmos3 family (video) against diffusers' Cosmos3OmniPipeline, on tiny random checkpoints built in code."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, run_training

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.base import Latents
from diffrl.models.cosmos3 import Cosmos3Family, prompt_bytes
from diffrl.models.random_checkpoints.cosmos3 import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: 0, the same operations in the same order)
HEIGHT, WIDTH, FRAMES = 16, 32, 5  # latents [4, 2, 2, 4]: 2 latent frames of 1 × 2 patch tokens


@pytest.fixture(scope="module")
def cosmos_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "cosmos3-tiny")


@pytest.fixture(scope="module")
def cosmos(cosmos_dir) -> Cosmos3Family:
    return Cosmos3Family.load(cosmos_dir)


def _pipeline_videos(family, prompt, negative, guidance, noise, frames):
    """Cosmos3OmniPipeline's videos as [B, C, F, H, W]: one call per sample (it takes one), frames first."""
    pipe = family.reference_pipeline()
    negative = negative if guidance > 1 else None
    videos = [pipe(prompt, negative_prompt=negative, latents=row[None], guidance_scale=guidance, num_inference_steps=3,
                   height=HEIGHT, width=WIDTH, num_frames=frames, output_type="pt").video for row in noise]
    return torch.stack(videos).permute(0, 2, 1, 3, 4)


@pytest.mark.parametrize(("negative", "guidance", "frames"), [("blurry", 4.0, FRAMES), ("", 1.0, FRAMES),
                                                               ("", 6.0, 1)], ids=["cfg", "no-cfg", "image-cfg"])
def test_engine_reproduces_the_diffusers_pipeline(cosmos, negative, guidance, frames):
    """ODE sampling through our engine gives the pipeline's videos from the same noise (text-to-image: 1 frame)."""
    seed = 3
    outputs = Engine(cosmos, EngineConfig(max_outputs_per_request=4)).generate(RolloutRequest(
        prompt="a red cat", negative_prompt=negative, seed=seed, num_outputs_per_prompt=2, num_inference_steps=3,
        guidance_scale=guidance, height=HEIGHT, width=WIDTH, num_frames=frames))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = cosmos.prepare_latents(make_generators([seed, seed + 1]), HEIGHT, WIDTH, num_frames=frames).tokens
    reference = _pipeline_videos(cosmos, "a red cat", negative, guidance, noise, frames)
    assert ours.shape == reference.shape == (2, 3, frames, HEIGHT, WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = _pipeline_videos(cosmos, "a green dog", negative, guidance, noise, frames)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the comparison can fail


def test_prompt_tokens_are_the_pipelines(cosmos):
    """The metadata sentences, chat template and special tokens match `Cosmos3OmniPipeline.tokenize_prompt`."""
    pipe = cosmos.reference_pipeline()
    for prompt, negative, frames, height, width in (("a red cat.", "blurry", 5, 16, 32), ("a dog", "", 189, 720, 1280),
                                                    ("", "", 1, 32, 16)):
        cond, uncond = pipe.tokenize_prompt(prompt, negative, num_frames=frames, height=height, width=width)
        size = {"num_frames": frames, "height": height, "width": width}
        assert cosmos.prompt_token_ids(prompt, negative=False, **size) == cond
        assert cosmos.prompt_token_ids(negative, negative=True, **size) == uncond


def test_sde_rollouts_are_the_same_in_any_microgroup(cosmos):
    assert_sample_k_is_the_same_in_any_microgroup(cosmos, guidance_scale=4.0, height=HEIGHT, width=WIDTH,
                                                  num_frames=FRAMES)
    outputs = Engine(cosmos).generate(RolloutRequest(
        prompt="a red cat", num_outputs_per_prompt=2, num_inference_steps=3, guidance_scale=4.0, height=HEIGHT,
        width=WIDTH, num_frames=FRAMES, rollout=True, rollout_return_dit_trajectory=True,
        rollout_return_denoising_env=True))
    log_probs = torch.stack([o.rollout_log_probs for o in outputs])
    assert log_probs.shape == (2, 3) and torch.isfinite(log_probs).all()
    assert outputs[0].dit_trajectory.latents.shape == (4, 4, 2, 2, 4)


def test_conditioning_rows_are_padded_prompt_bytes(cosmos):
    """A row holds the prompt's UTF-8 bytes; the zero padding a trainer adds to batch prompts changes nothing,
    and a batch's rows get the velocity each gets alone."""
    cond = cosmos.encode_prompts(["a red cat", "un chien vert, été"])
    length = len("un chien vert, été".encode())
    assert cond.embeds.shape == (2, length, 1) and cond.ids.shape == (length, 1)
    assert prompt_bytes(cond.embeds[0]).decode() == "a red cat"
    assert prompt_bytes(cond.embeds[1]).decode() == "un chien vert, été"
    x = torch.randn(2, 4, 2, 2, 4)
    sigma = torch.tensor([0.9, 0.4])  # a training micro-batch mixes steps
    uncond = cosmos.encode_prompts(["blurry", ""])
    both = cosmos.velocity(cosmos.transformer, Latents(x, torch.zeros(0, 1)), sigma, cond, uncond, 4.0)
    for i in range(2):
        alone = cosmos.velocity(cosmos.transformer, Latents(x[i : i + 1], torch.zeros(0, 1)), sigma[i : i + 1],
                                cosmos.encode_prompts([prompt_bytes(cond.embeds[i]).decode()]),
                                cosmos.encode_prompts([["blurry", ""][i]]), 4.0)
        assert torch.equal(both[i : i + 1], alone)
    with pytest.raises(ValueError, match="UTF-8 bytes"):
        prompt_bytes(torch.tensor([[0.5]]))


def test_bf16_autocast_over_fp32_weights(cosmos_dir):
    """A full finetune's forward on a GPU: fp32 masters under bf16 autocast (a dtype mix the transformer alone
    refuses), close to the fp32 velocity."""
    family = Cosmos3Family.load(cosmos_dir)
    args = (Latents(torch.randn(1, 4, 2, 2, 4), torch.zeros(0, 1)), torch.tensor([0.7]),
            family.encode_prompts(["a red cat"]), family.encode_prompts(["blurry"]), 4.0)
    exact = family.velocity(family.transformer, *args)
    family.autocast_dtype = torch.bfloat16
    torch.testing.assert_close(family.velocity(family.transformer, *args), exact, rtol=0.05, atol=0.05)


def test_defaults_schedules_and_family_name(cosmos, cosmos_dir, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    assert cosmos.default_size() == (720, 1280) and cosmos.default_num_frames == 189  # the pipeline's defaults
    assert cosmos.default_guidance_scale == 6.0
    reference = FlowMatchEulerDiscreteScheduler(shift=3.0)
    reference.set_timesteps(10)
    torch.testing.assert_close(cosmos.sigmas(10, HEIGHT, WIDTH), reference.sigmas.float(), rtol=0, atol=0)
    assert torch.equal(cosmos.model_timesteps(reference.sigmas[:-1]), reference.timesteps)
    assert resolve_family(None, cosmos_dir) is Cosmos3Family
    assert resolve_family(None, tmp_path / "Cosmos-3-Nano") is Cosmos3Family
    # UniPC (the published scheduler): its flow σ's, and its integer timesteps for the model.
    unipc = Cosmos3Family.load(save_random_checkpoint(tmp_path / "unipc", scheduler="unipc", shift=10.0))
    reference = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=10.0)
    reference.set_timesteps(6)
    sigmas = unipc.sigmas(6, HEIGHT, WIDTH)
    torch.testing.assert_close(sigmas, reference.sigmas.float(), rtol=0, atol=0)
    assert torch.equal(unipc.model_timesteps(sigmas[:-1]), reference.timesteps.float())
    # The pipeline's "native" schedule: linear σ's from 1 − 1/1000, shifted by the scheduler.
    native = Cosmos3Family.load(save_random_checkpoint(tmp_path / "native", native_flow_schedule=True))
    pipe = native.reference_pipeline()
    pipe("a cat", num_inference_steps=4, height=HEIGHT, width=WIDTH, num_frames=1, guidance_scale=1.0,
         output_type="latent")
    torch.testing.assert_close(native.sigmas(4, HEIGHT, WIDTH), pipe.scheduler.sigmas.float(), rtol=0, atol=0)


@pytest.mark.parametrize(("fields", "field"), [
    ({"image": "data:image/png;base64,AAAA"}, "image"),  # image-to-video
    ({"input_reference": "video.mp4"}, "input_reference"),  # video-to-video (video2world)
    ({"num_frames": 6}, "num_frames"), ({"height": 20}, "height"),
    ({"guidance_scale_2": 3.0}, "guidance_scale_2"),
    ({"fps": 30}, "fps"),
])
def test_what_it_cannot_do_is_refused_by_name(cosmos, fields, field):
    engine = Engine(cosmos)
    request = {"prompt": "a cat", "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "num_inference_steps": 1}
    with pytest.raises(RequestError) as err:
        engine.generate(RolloutRequest(**{**request, **fields}))
    assert err.value.field == field
    assert engine.in_flight == 0 and len(engine.generate(RolloutRequest(**request))) == 1


def test_a_served_video_length_is_bounded(cosmos):
    """Cosmos3 has no positional limit, so without a bound `diffrl serve` denoised num_frames=100001 (minutes on the
    tiny model, a gigabyte response); the server's --max-num-frames refuses it by name, the default included."""
    from diffrl.serving.server import ServeConfig

    limit = ServeConfig().max_num_frames
    assert Engine(cosmos, ServeConfig().engine_config()).config.max_num_frames == limit
    engine = Engine(cosmos, EngineConfig(max_num_frames=FRAMES))
    with pytest.raises(RequestError, match="limit of") as err:
        engine.generate(RolloutRequest(prompt="a cat", height=HEIGHT, width=WIDTH, num_frames=FRAMES + 4,
                                       num_inference_steps=1))
    assert err.value.field == "num_frames" and engine.in_flight == 0
    assert len(engine.generate(RolloutRequest(prompt="a cat", height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                                              num_inference_steps=1))) == 1


def test_the_image_endpoint_serves_a_video_familys_one_frame_video(cosmos):
    """/v1/images/generations on a video family answers an image (its one-frame video), not a 500 from
    writing a [C, F, H, W] video as a PNG."""
    import base64
    import io

    from fastapi.testclient import TestClient
    from PIL import Image

    from diffrl.serving.server import create_app

    client = TestClient(create_app(Engine(cosmos)), base_url="http://127.0.0.1")
    response = client.post("/v1/images/generations", json={"prompt": "a cat", "size": f"{WIDTH}x{HEIGHT}", "n": 2,
                                                           "num_inference_steps": 1})
    assert response.status_code == 200, response.text
    images = [Image.open(io.BytesIO(base64.b64decode(d["b64_json"]))) for d in response.json()["data"]]
    assert [im.size for im in images] == [(WIDTH, HEIGHT)] * 2


def test_other_modes_are_refused_by_the_request_schema():
    """Sound and action generation have no request field; asking for them through extra_sampling_params is refused."""
    from pydantic import ValidationError

    for key in ("enable_sound", "action"):
        with pytest.raises(ValidationError, match=f"extra_sampling_params.{key}"):
            RolloutRequest(prompt="a cat", extra_sampling_params={key: True})


def test_unsupported_checkpoints_are_refused(cosmos_dir, tmp_path):
    broken = tmp_path / "cosmos3-broken"
    shutil.copytree(cosmos_dir, broken)
    index = json.loads((broken / "model_index.json").read_text())
    (broken / "modular_model_index.json").write_text(json.dumps({**index, "distilled_sigmas": [1.0, 0.5, 0.25]}))
    with pytest.raises(ModelLoadError, match="distilled"):
        Cosmos3Family.load(broken)
    (broken / "modular_model_index.json").unlink()
    scheduler = broken / "scheduler" / "scheduler_config.json"
    config = json.loads(scheduler.read_text())
    scheduler.write_text(json.dumps({**config, "use_dynamic_shifting": True}))
    with pytest.raises(ModelLoadError, match="dynamic shifting"):
        Cosmos3Family.load(broken)
    scheduler.write_text(json.dumps(config))
    (broken / "vae" / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="missing file: .*vae/config.json"):
        Cosmos3Family.load(broken)
    trainer_only = Cosmos3Family.load(cosmos_dir, load_vae=False)  # what training needs
    assert trainer_only.vae is None
    with pytest.raises(RuntimeError, match="without its VAE"):
        trainer_only.decode(torch.zeros(1, 4, 2, 2, 4), HEIGHT, WIDTH, num_frames=FRAMES)


@pytest.mark.parametrize(("loss_type", "lora"), [("flow_grpo", True), pytest.param("nft", False, marks=pytest.mark.slow)],
                         ids=["grpo-lora", "nft-full"])
def test_training_run_on_cosmos3(cosmos_dir, tmp_path, loss_type, lora):
    """`diffrl train`: one rollout, one update; the checkpoint loads back with the update in it."""
    run_training(cosmos_dir, tmp_path / "run", loss_type, lora, guidance=4.0,
                 video={"resolution": 16, "num_frames": FRAMES})


def test_the_cosmos3_recipe_runs_a_rollout_at_tiny_size(cosmos_dir, tmp_path):
    """`diffrl train --recipe cosmos3-grpo` with only size, frames, steps, batch, reward and output overridden: the
    recipe's CFG 4, SDE, 2 random SDE steps, microgroup 1, bf16 forward and gradient checkpointing run one rollout
    and its optimizer step on a tiny checkpoint (a video here: the reward sees every frame)."""
    import rewards_for_tests

    from diffrl.cli.main import parse
    from diffrl.train.trainer import Trainer

    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.txt").write_text("a red cat\na blue dog\n")
    (data / "test.txt").write_text("a green cat\n")
    out = tmp_path / "run"
    cfg = parse(["train", "--recipe", "cosmos3-grpo", "--model-path", str(cosmos_dir), "--device", "cpu",
                 "--height", str(HEIGHT), "--width", str(WIDTH), "--num-frames", str(FRAMES),
                 "--diffusion-num-steps", "6", "--diffusion-sde-window-range", "0,6",
                 "--rollout-batch-size", "1", "--n-samples-per-prompt", "4", "--global-batch-size", "4",
                 "--num-rollout", "1", "--prompt-data", str(data), "--eval-num-prompts", "1",
                 "--reward", "rewards_for_tests:darkness_noting_frames", "--output-dir", str(out)])
    r = cfg.rollout
    assert (r.diffusion_guidance_scale, r.diffusion_sde_type, r.diffusion_sde_step_strategy, cfg.task.reward_frames,
            r.rollout_microgroup_size, cfg.model.mixed_precision, cfg.optim.num_steps_per_rollout) == (
        4.0, "sde", "random", None, 1, "bf16", 1)
    rewards_for_tests.FRAMES_SEEN.clear()
    trainer = Trainer(cfg)
    steps = trainer.objective.sde_window(0)
    last = trainer.train()
    assert rewards_for_tests.FRAMES_SEEN and set(rewards_for_tests.FRAMES_SEEN) == {FRAMES}  # rollouts and evaluation
    assert len(steps) == 2 and last["train/pairs"] == 4 * 2 and torch.isfinite(torch.tensor(last["train/loss"]))
    assert last["rollout/sde_window_start"] == steps[0] and "eval/reward" in last


def test_evaluation_videos_play_at_the_familys_frame_rate(cosmos, tmp_path):
    """An evaluated video is an animated PNG at the family's 24 fps (it played at 8, three times too slow)."""
    from PIL import Image

    from diffrl.data.prompts import PromptRecord
    from diffrl.evaluation.reward_eval import evaluate_with_reward

    evaluate_with_reward(cosmos, [PromptRecord("a cat", {})], "temporal_consistency", num_steps=1, guidance_scale=1.0,
                         height=HEIGHT, width=WIDTH, num_frames=FRAMES, out_dir=tmp_path)
    video = Image.open(tmp_path / "images" / "00000.png")
    assert video.n_frames == FRAMES and video.info["duration"] == pytest.approx(1000 / 24)  # exactly 1/24 s a frame


def test_the_shapes_evaluation_refuses_a_video_family_in_one_line(cosmos_dir, tmp_path, capsys):
    """`diffrl evaluate` / `compare` without --prompt-data score the shapes world's images: a video family is refused
    before it loads, pointing at --prompt-data (it failed in the image writer with a traceback)."""
    from diffrl.cli.main import main as cli_main

    for argv in (["evaluate", "--model-path", str(cosmos_dir)],
                 ["compare", "--base", str(cosmos_dir), "--trained", str(cosmos_dir)]):
        assert cli_main([*argv, "--device", "cpu", "--num-steps", "1", "--output-dir", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "generates video" in err and "--prompt-data" in err


def test_a_served_videos_pixels_count_every_frame(cosmos):
    """The request-wide pixel bound multiplies in num_frames: a video is num_frames images."""
    engine = Engine(cosmos, EngineConfig(max_request_pixels=FRAMES * HEIGHT * WIDTH))
    request = {"prompt": "a cat", "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, "num_inference_steps": 1}
    with pytest.raises(RequestError, match="num_frames × width × height") as err:
        engine.generate(RolloutRequest(**request, num_outputs_per_prompt=2))
    assert err.value.field == "num_outputs_per_prompt" and engine.in_flight == 0
    assert len(engine.generate(RolloutRequest(**request))) == 1


def test_rollout_forwards_compute_the_text_pathway_once(cosmos_dir):
    """Without gradients the text tokens' keys and values are computed once per prompt and weights and reused at
    every step: the velocity is the full forward's to the bit (CFG, a video and an image), and a weight update in
    place, or an adapter on the text pathway, is never served from the cache."""
    from peft import LoraConfig

    family = Cosmos3Family.load(cosmos_dir)
    cond, uncond = family.encode_prompts(["a red cat", "a red cat"]), family.encode_prompts(["blurry", "blurry"])

    def velocities(x, grad):
        with torch.set_grad_enabled(grad):  # with gradients: the transformer's own forward, whole
            return [family.velocity(family.transformer, Latents(x, torch.zeros(0, 1)), torch.tensor([s, s]), cond,
                                    uncond, 4.0).detach() for s in (0.9, 0.5)]

    for frames in (2, 1):  # latent frames: a video, an image
        x = torch.randn(2, 4, frames, 2, 4)
        family.text_cache.clear()
        cached = velocities(x, grad=False)
        assert len(family.text_cache._entries) == 2  # the prompt and the negative prompt, for both steps and rows
        for a, b in zip(cached, velocities(x, grad=True), strict=True):
            assert torch.equal(a, b)
    layer = family.transformer.layers[0]
    with torch.no_grad():
        layer.mlp.up_proj.weight.mul_(1.5)  # the text pathway's own weights, in place (an optimizer step)
    updated = velocities(x, grad=False)
    assert not torch.equal(updated[0], cached[0])
    assert all(torch.equal(a, b) for a, b in zip(updated, velocities(x, grad=True), strict=True))
    video_lora = Cosmos3Family.load(cosmos_dir)  # the family's LoRA targets: the video pathway only
    video_lora.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(family.lora_target_modules),
                                                  init_lora_weights=False))
    assert video_lora.text_cache.key(video_lora.transformer, (b"a", False, (5, 16, 32), "cpu"), "auto") is not None
    family.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["self_attn.to_q"],
                                              init_lora_weights=False))
    key = family.text_cache.key(family.transformer, (b"a", False, (5, 16, 32), "cpu"), "auto")
    assert key is None  # an adapter on the text pathway: the transformer's own forward
    compiled = Cosmos3Family.load(cosmos_dir)
    compiled.transformer.layers[1].compile()  # compiled layers keep the cache (`Cosmos3Family.compile` compiles the
    assert compiled.text_cache.key(compiled.transformer, (b"a", False, (5, 16, 32), "cpu"), "auto") is not None  # step)
    assert all(torch.equal(a, b) for a, b in zip(velocities(x, grad=False), velocities(x, grad=True), strict=True))


def test_training_micro_batches_hold_one_prompts_rows(cosmos_dir, tmp_path, monkeypatch):
    """The transformer batches only one prompt's rows, so the trainer fills each micro-batch with one prompt's pairs:
    2 prompts × 4 samples × 2 SDE steps in micro-batches of 8 make 2 micro-batches, each one video-pathway call of 8
    rows per CFG half, where a shuffled step would split every micro-batch by prompt."""
    import diffrl.models.cosmos3 as cosmos3_module
    from diffrl.cli.main import parse
    from diffrl.train.trainer import Trainer

    rows_per_training_call = []
    pathway = cosmos3_module.video_pathway

    def counting_pathway(transformer, packed, text, latents, timesteps, **kwargs):
        if torch.is_grad_enabled():
            rows_per_training_call.append(latents.shape[0])
        return pathway(transformer, packed, text, latents, timesteps, **kwargs)

    monkeypatch.setattr(cosmos3_module, "video_pathway", counting_pathway)
    monkeypatch.setattr(Cosmos3Family, "batch_rows", True)  # a GPU's default
    data = tmp_path / "prompts"
    data.mkdir()
    (data / "train.txt").write_text("a red cat\na blue dog\n")
    (data / "test.txt").write_text("a green cat\n")
    cfg = parse(["train", "--diffusion-model-family", "cosmos3", "--model-path", str(cosmos_dir), "--device", "cpu",
                 "--height", str(HEIGHT), "--width", str(WIDTH), "--num-frames", str(FRAMES), "--use-lora",
                 "--diffusion-num-steps", "4", "--diffusion-guidance-scale", "4.0", "--diffusion-sde-window-range",
                 "0,2", "--diffusion-num-sde-steps", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
                 "--rollout-microgroup-size", "1", "--global-batch-size", "8", "--micro-batch-size", "8",
                 "--num-rollout", "1", "--prompt-data", str(data), "--eval-num-prompts", "0", "--reward",
                 "jpeg_compressibility", "--output-dir", str(tmp_path / "run")])
    Trainer(cfg).train()
    assert rows_per_training_call == [8, 8, 8, 8]  # per micro-batch: the negative prompt's rows, then the prompt's


def test_rows_of_one_prompt_run_as_one_batch_when_asked(cosmos_dir):
    """`batch_rows` (a GPU's default): the rows sharing a prompt go through the video pathway as one batch, with the
    velocities of the rows run one at a time (to rounding: BLAS picks other kernels for other row counts), each
    row its own timestep and noise."""
    family = Cosmos3Family.load(cosmos_dir)
    cond = family.encode_prompts(["a red cat", "a red cat", "a green dog"])
    uncond = family.encode_prompts(["blurry"] * 3)
    x = torch.randn(3, 4, 2, 2, 4)
    with torch.no_grad():
        args = (family.transformer, Latents(x, torch.zeros(0, 1)), torch.tensor([0.9, 0.4, 0.9]), cond, uncond, 4.0)
        family.batch_rows = False
        alone = family.velocity(*args)
        family.batch_rows = True
        batched = family.velocity(*args)
    torch.testing.assert_close(batched, alone, rtol=1e-5, atol=1e-5)
    assert (alone[0] - alone[1]).abs().max() > 1e-3  # the rows differ, so a mix-up would show


def test_lora_training_forwards_reuse_the_text_pathway_with_the_same_gradients(cosmos_dir):
    """With LoRA on the video pathway (the family's targets, the base frozen) the trainer's forwards also read the
    cached text pathway: the loss and the adapter's gradients are the transformer's own forward's, to the bit, with
    gradient checkpointing too; a trained text-pathway weight (a full finetune) runs the transformer whole."""
    from peft import LoraConfig

    class NoCache(type(Cosmos3Family.load(cosmos_dir).text_cache)):
        @staticmethod
        def key(*args):
            return None

    x = torch.randn(1, 4, 2, 2, 4)
    results = []
    for cache in (True, False):
        family = Cosmos3Family.load(cosmos_dir)
        torch.manual_seed(0)
        family.transformer.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=list(family.lora_target_modules),
                                                  init_lora_weights=False))
        family.transformer.requires_grad_(False)
        for name, param in family.transformer.named_parameters():
            param.requires_grad_("lora_" in name)
        family.transformer.enable_gradient_checkpointing()
        if not cache:
            family.text_cache = NoCache()
        v = family.velocity(family.transformer, Latents(x, torch.zeros(0, 1)), torch.tensor([0.6]),
                            family.encode_prompts(["a red cat"]), family.encode_prompts(["blurry"]), 4.0)
        v.square().mean().backward()
        results.append((v.detach(), {n: p.grad for n, p in family.transformer.named_parameters() if p.requires_grad}))
        if cache:
            assert len(family.text_cache._entries) == 2
            family.transformer.layers[0].mlp.up_proj.weight.requires_grad_(True)
            assert family.text_cache.key(family.transformer, (b"a", False, (5, 16, 32), "cpu"), "auto") is None
    (v_cached, g_cached), (v_whole, g_whole) = results
    assert torch.equal(v_cached, v_whole)
    assert g_cached.keys() == g_whole.keys() and all(torch.equal(g_cached[n], g_whole[n]) for n in g_cached)
    assert any(g.abs().sum() > 0 for g in g_cached.values())
