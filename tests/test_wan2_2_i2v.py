"""Wan2.2 A14B image-to-video and TI2V-5B (the wan2_2 family's image-conditioned modes) against diffusers'
WanImageToVideoPipeline (TI2V: with expand_timesteps), and an image-to-video prompt set through training, on tiny
random checkpoints built in code."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.random_checkpoints.wan2_2 import save_random_checkpoint
from diffrl.models.wan2_2 import Wan22Family
from diffrl.sampling import make_generators
from family_checks import random_png, write_conditioned_prompt_set

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (measured: ≤ 1.1e-6)
HEIGHT, WIDTH, FRAMES = 16, 32, 5  # latents [4, 2, 2, 4]; the transformer takes 4 + 4 + 4 channels
TEXT_TOKENS = 16


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.2-i2v-tiny", image_to_video=True)


@pytest.fixture(scope="module")
def i2v(i2v_dir) -> Wan22Family:
    return Wan22Family.load(i2v_dir, max_sequence_length=TEXT_TOKENS)


@pytest.fixture(scope="module")
def ti2v_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.2-ti2v-tiny", ti2v=True)


@pytest.fixture(scope="module")
def ti2v(ti2v_dir) -> Wan22Family:
    return Wan22Family.load(ti2v_dir, max_sequence_length=TEXT_TOKENS)


pytestmark = pytest.mark.usefixtures("wan_i2v_prompt_clean")


def png(seed: int, size=(20, 36)) -> bytes:
    """A random RGB picture as PNG bytes (20×36, not the video's 16×32: resized as the pipeline resizes it)."""
    return random_png(seed, size)


def _request(**fields) -> RolloutRequest:
    return RolloutRequest(**{"prompt": "a red cat", "seed": 3, "num_outputs_per_prompt": 2, "num_inference_steps": 4,
                             "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, **fields})


@pytest.mark.parametrize(("negative", "guidance", "guidance_2"), [("", 1.0, None), ("blurry", 4.5, 2.0)],
                         ids=["no-cfg", "cfg-own-scale-2"])
def test_engine_reproduces_the_diffusers_image_to_video_pipeline(i2v, negative, guidance, guidance_2):
    """ODE sampling through our engine gives WanImageToVideoPipeline's videos from the same noise and first frame,
    both experts running (the boundary falls inside the 4-step schedule), with CFG (the negative half sees the
    image too) and without."""
    high = i2v.transformer.high_noise(i2v.sigmas(4, HEIGHT, WIDTH)[:-1] * 1000)
    assert high.any() and not high.all()
    engine = Engine(i2v, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(_request(negative_prompt=negative, guidance_scale=guidance, guidance_scale_2=guidance_2,
                                       image_path=[png(0)]))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = i2v.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH, num_frames=FRAMES).tokens

    def pipeline(source):
        frames = i2v.reference_pipeline()(
            image=Image.open(io.BytesIO(source)), prompt="a red cat",
            negative_prompt=negative if guidance > 1 else None,
            latents=noise, num_inference_steps=4, guidance_scale=guidance, guidance_scale_2=guidance_2, height=HEIGHT,
            width=WIDTH, num_frames=FRAMES, num_videos_per_prompt=2, max_sequence_length=TEXT_TOKENS,
            output_type="pt").frames
        return frames.permute(0, 2, 1, 3, 4)

    reference = pipeline(png(0))
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = pipeline(png(1))
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the first frame matters: the check can fail
    assert engine.image_encodes == 1  # once per request, shared by its outputs and CFG's negative half


@pytest.mark.parametrize(("image", "negative", "guidance"),
                         [(True, "", 1.0), (True, "blurry", 4.5), (False, "blurry", 4.5)],
                         ids=["image-no-cfg", "image-cfg", "text-only-cfg"])
def test_ti2v_reproduces_the_diffusers_pipelines(ti2v, image, negative, guidance):
    """TI2V (expand_timesteps, one expert): with a first frame our videos equal WanImageToVideoPipeline(
    expand_timesteps=True)'s (the image's latents replace the first latent frame at timestep 0), without one
    WanPipeline's, from the same noise, with CFG and without."""
    assert ti2v.ti2v and ti2v.transformer.transformer_2 is None
    engine = Engine(ti2v, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(_request(negative_prompt=negative, guidance_scale=guidance,
                                       image_path=[png(0)] if image else None))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = ti2v.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH, num_frames=FRAMES).tokens

    def pipeline(source):
        kwargs = {"image": Image.open(io.BytesIO(source))} if image else {}
        frames = ti2v.reference_pipeline(with_image=image)(
            prompt="a red cat", negative_prompt=negative if guidance > 1 else None, latents=noise,
            num_inference_steps=4, guidance_scale=guidance, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
            num_videos_per_prompt=2, max_sequence_length=TEXT_TOKENS, output_type="pt", **kwargs).frames
        return frames.permute(0, 2, 1, 3, 4)

    reference = pipeline(png(0))
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    assert engine.image_encodes == (1 if image else 0)
    if image:
        other = pipeline(png(1))
        assert (other - reference).abs().max() > 100 * TOLERANCE  # the first frame matters: the check can fail


def test_ti2v_requests_with_and_without_a_first_frame_arriving_together_equal_their_own_runs(ti2v):
    """A TI2V engine given an image-to-video and a text-to-video request at once: their conditionings differ in
    layout, so they denoise one at a time, each bit for bit as alone."""
    import threading

    def video(engine, image):
        return torch.stack([o.generated_output for o in engine.generate(
            _request(guidance_scale=1.0, image_path=[png(0)] if image else None))])

    alone = {image: video(Engine(ti2v), image) for image in (True, False)}
    engine, together = Engine(ti2v, EngineConfig(batch_wait_s=0.5)), {}
    threads = [threading.Thread(target=lambda image=image: together.__setitem__(image, video(engine, image)))
               for image in (True, False)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(together[image], alone[image]) for image in (True, False))


def test_the_condition_travels_in_the_conditioning_and_on_the_wire(i2v):
    source = torch.from_numpy(np.array(Image.open(io.BytesIO(png(0))))).permute(2, 0, 1)
    encoded = i2v.encode_condition_images([source], height=HEIGHT, width=WIDTH, num_frames=FRAMES)
    assert encoded.shape == (1, 4 + 4, 2, 2, 4)
    assert encoded[:, :4, 0].eq(1).all() and encoded[:, :4, 1:].eq(0).all()  # the first-frame mask
    cond = i2v.condition_on_images(i2v.encode_prompts(["a red cat", "a dog"]), encoded)
    latents = torch.zeros(2, 4, 2, 2, 4)
    text, condition, image_embeds = i2v.unpack_conditioning(cond, latents)
    assert text.shape == (2, TEXT_TOKENS, 32) and torch.equal(condition, encoded.expand(2, -1, -1, -1, -1))
    assert image_embeds is None  # Wan2.2's A14B I2V has no image encoder
    wire = i2v.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    back, _ = Wan22Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds[:1]) and torch.equal(back.ids, cond.ids)
    assert len(cond.ids) == cond.embeds.shape[1] > TEXT_TOKENS  # a layout of its own: not batched with text alone
    # Another size is another condition (the engine keys its cache by the output's size).
    assert i2v.encode_condition_images([source], height=32, width=32, num_frames=FRAMES).shape == (1, 8, 2, 4, 4)


def test_requests_without_a_first_frame_or_with_two_are_refused_by_name(i2v):
    engine = Engine(i2v)
    with pytest.raises(RequestError, match="needs one condition image") as err:
        engine.generate(_request())
    assert err.value.field == "image_path"
    with pytest.raises(RequestError, match="takes at most 1") as err:
        engine.generate(_request(image_path=[png(0), png(1)]))
    assert err.value.field == "image_path"


def test_image_embeddings_in_a_two_expert_or_ti2v_checkpoint_are_refused_at_load(i2v_dir, tmp_path):
    broken = tmp_path / "wan-i2v-broken"
    shutil.copytree(i2v_dir, broken)
    config = broken / "transformer" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "image_dim": 1280}))
    with pytest.raises(ModelLoadError, match=r"image_dim=1280 in a two-expert checkpoint, which no Wan pipeline"):
        Wan22Family.load(broken)
    index = broken / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "expand_timesteps": True}))
    with pytest.raises(ModelLoadError, match="TI2V"):
        Wan22Family.load(broken)


SEEN = []


def brightness_seeing_the_source(images, prompts, metadata):
    """A reward that records each sample's first frame (the metadata's condition images) and scores brightness."""
    SEEN.extend(m[CONDITION_IMAGES_KEY][0].shape for m in metadata)
    return [float(image.float().mean()) for image in images]


def write_image_to_video_set(folder: Path) -> Path:
    """A tiny image-to-video prompt set: a .jsonl beside its first frames (one under images/)."""
    return write_conditioned_prompt_set(folder, "i2v", ("the cat walks", "the dog runs"), png(0), png(1))


def _train(model_dir, prompts, out, loss_type, num_rollout=2, **flags):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    cfg = TrainConfig.flat(
        output_dir=out, model_path=model_dir, prompt_data=prompts, loss_type=loss_type, num_rollout=num_rollout,
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=4,
        num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=2, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, diffusion_guidance_scale=2.0 if loss_type == "flow_grpo" else 1.0, lr=1e-3, device="cpu",
        use_lora=True, lora_rank=2, reward="jpeg_compressibility", eval_images_per_category=0, checkpoint_interval=10,
        **({"diffusion_sde_window_range": (0, 2)} if loss_type == "flow_grpo" else {}), **flags)
    trainer = Trainer(cfg, reward_fn=brightness_seeing_the_source)
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, [p.detach().clone() for p in trainer.policy.params]


@pytest.mark.parametrize(("mode", "loss_type"), [("a14b-i2v", "flow_grpo"), ("ti2v", "flow_grpo"), ("a14b-i2v", "nft"),
                                                 ("ti2v", "nft")])
def test_training_on_an_image_to_video_prompt_set(i2v_dir, ti2v_dir, tmp_path, mode, loss_type):
    """Two rollouts of Flow-GRPO (CFG with the first frame in both halves) and of DiffusionNFT, LoRA on every
    expert; the reward sees each prompt's first frame, and the trainer replays the engine's steps from the
    conditioning."""
    SEEN.clear()
    model_dir = i2v_dir if mode == "a14b-i2v" else ti2v_dir
    records, _ = _train(model_dir, write_image_to_video_set(tmp_path / "data"), tmp_path / "run", loss_type)
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    assert SEEN and all(shape == (3, 20, 36) for shape in SEEN)


@pytest.mark.parametrize("mode", ["a14b-i2v", "ti2v"])
def test_replay_of_an_image_to_video_rollout_equals_the_live_run(i2v_dir, ti2v_dir, tmp_path, mode):
    model_dir = i2v_dir if mode == "a14b-i2v" else ti2v_dir
    prompts = write_image_to_video_set(tmp_path / "data")
    live, live_state = _train(model_dir, prompts, tmp_path / "live", "flow_grpo", num_rollout=1,
                              save_rollout_data=tmp_path / "records")
    replayed, state = _train(model_dir, prompts, tmp_path / "replay", "flow_grpo", num_rollout=1,
                             load_rollout_data=tmp_path / "records")
    assert all(torch.equal(a, b) for a, b in zip(state, live_state, strict=True))
    keys = ("train/loss", "train/grad_norm", "rollout/reward/raw_mean")
    assert [[r.get(k) for k in keys] for r in live] == [[r.get(k) for k in keys] for r in replayed]
    (tmp_path / "data" / "images" / "b.png").write_bytes(png(5))  # another first frame: refused
    with pytest.raises(ValueError, match="other condition images"):
        _train(model_dir, prompts, tmp_path / "again", "flow_grpo", num_rollout=1,
               load_rollout_data=tmp_path / "records")
