"""LTX-2.3 image to video (the ltx2 family's image-conditioned mode) against diffusers' LTX2ImageToVideoPipeline,
and a Flow-GRPO run on an image-to-video prompt set, on a tiny random checkpoint built in code."""

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import RequestError
from diffrl.models.ltx2 import Ltx2Family
from diffrl.models.random_checkpoints.ltx2 import save_random_checkpoint
from diffrl.sampling import make_generators, transition
from family_checks import save_ltx2_i2v_checkpoint, write_conditioned_prompt_set

TOLERANCE = 1e-5  # fp32 on CPU through two code paths, as tests/test_ltx2.py
HEIGHT, WIDTH, FRAMES = 64, 96, 9  # 2 latent frames of 2 × 3 tokens: 6 first-frame tokens, 6 generated
FIRST, GENERATED, AUDIO = 6, 6, 9
PLAIN_CFG = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": None,
             "audio_stg_scale": 0.0, "audio_modality_scale": 1.0, "audio_guidance_rescale": 0.0}


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    return save_ltx2_i2v_checkpoint(tmp_path_factory.mktemp("models") / "ltx-2.3-i2v-tiny")


@pytest.fixture(scope="module")
def i2v(i2v_dir) -> Ltx2Family:
    return Ltx2Family.load(i2v_dir)


def pixels(seed: int, size=(HEIGHT, WIDTH)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def png(seed: int, size=(HEIGHT, WIDTH)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels(seed, size)).save(buffer, format="PNG")
    return buffer.getvalue()


def _request(**fields) -> RolloutRequest:
    return RolloutRequest(**{"prompt": "a red cat", "seed": 3, "num_outputs_per_prompt": 2, "num_inference_steps": 3,
                             "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, **fields})


@pytest.mark.parametrize(("negative", "cfg", "size"), [("", 1.0, (HEIGHT, WIDTH)), ("blurry", 3.0, (50, 70))],
                         ids=["no-cfg", "cfg-resized"])
def test_engine_reproduces_the_image_to_video_pipeline(i2v, negative, cfg, size):
    """ODE sampling through our engine gives LTX2ImageToVideoPipeline's videos from the same generators and first
    frame (its `image_crf=0`: no H.264 re-compression), with and without CFG, and from a first frame of another
    size, which both resize to the video's."""
    assert i2v.settings.image_to_video and i2v.accepts_image_conditioning and i2v.max_condition_images == 1
    outputs = Engine(i2v, EngineConfig(max_outputs_per_request=4)).generate(_request(
        negative_prompt=negative, guidance_scale=cfg, image_path=[png(0, size)]))
    ours = torch.stack([o.generated_output for o in outputs])
    pipe = i2v.reference_pipeline()
    assert type(pipe).__name__ == "LTX2ImageToVideoPipeline"
    # One image per output: with a list of generators the pipeline indexes `image` per output.
    reference = pipe(image=[Image.fromarray(pixels(0, size))] * 2, image_crf=0, prompt="a red cat",
                     negative_prompt=negative if cfg > 1 else None, generator=make_generators([3, 4]),
                     num_videos_per_prompt=2, num_inference_steps=3, guidance_scale=cfg, height=HEIGHT, width=WIDTH,
                     num_frames=FRAMES, max_sequence_length=i2v.settings.max_sequence_length, output_type="pt",
                     **PLAIN_CFG).frames.permute(0, 2, 1, 3, 4)
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    other = Engine(i2v).generate(_request(negative_prompt=negative, guidance_scale=cfg, image_path=[png(1)]))
    assert (torch.stack([o.generated_output for o in other]) - reference).abs().max() > 100 * TOLERANCE


@pytest.fixture(scope="module")
def t2v(tmp_path_factory) -> Ltx2Family:
    """The same tiny checkpoint saved as LTX2Pipeline (text to video)."""
    return Ltx2Family.load(save_random_checkpoint(tmp_path_factory.mktemp("models") / "ltx-2.3-tiny"))


def test_a_request_with_an_image_is_image_to_video_on_a_text_to_video_checkpoint(t2v):
    """On a checkpoint saved as LTX2Pipeline, a request with a first frame gives LTX2ImageToVideoPipeline's videos
    (the state leaves the first frame out), and one without gives LTX2Pipeline's, from the same engine."""
    engine = Engine(t2v, EngineConfig(max_outputs_per_request=4))
    ours = torch.stack([o.generated_output for o in engine.generate(_request(guidance_scale=1.0,
                                                                             image_path=[png(0)]))])
    reference = t2v.reference_pipeline(image_to_video=True)(
        image=[Image.fromarray(pixels(0))] * 2, image_crf=0, prompt="a red cat", generator=make_generators([3, 4]),
        num_videos_per_prompt=2, num_inference_steps=3, guidance_scale=1.0, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, max_sequence_length=t2v.settings.max_sequence_length, output_type="pt",
        **PLAIN_CFG).frames.permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    text_only = torch.stack([o.generated_output for o in engine.generate(_request(guidance_scale=1.0))])
    reference = t2v.reference_pipeline()(
        prompt="a red cat", generator=make_generators([3, 4]), num_videos_per_prompt=2, num_inference_steps=3,
        guidance_scale=1.0, height=HEIGHT, width=WIDTH, num_frames=FRAMES,
        max_sequence_length=t2v.settings.max_sequence_length, output_type="pt", **PLAIN_CFG).frames
    torch.testing.assert_close(text_only, reference.permute(0, 2, 1, 3, 4), rtol=0, atol=TOLERANCE)


def test_stochastic_steps_never_move_the_first_frame_and_score_only_generated_tokens(i2v):
    """The state holds only the generated tokens (video after the first frame, then audio): a CPS step moves and
    scores those alone, and the first frame rides in the conditioning, unchanged, to the decode."""
    image = torch.from_numpy(pixels(0)).permute(2, 0, 1)
    first = i2v.encode_condition_images([image])
    cond = i2v.condition_on_images(i2v.encode_prompts(["a red cat"]), first).repeat(2)
    assert first.shape == (1, FIRST, 4) and torch.equal(i2v.first_frame_tokens(cond.embeds), first.expand(2, -1, -1))
    latents = i2v.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH, num_frames=FRAMES, cond=cond)
    assert latents.tokens.shape == (2, GENERATED + AUDIO, 4) and latents.ids.shape == (FIRST + GENERATED, 6)
    assert torch.equal(latents.tokens, i2v.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH,
                                                           num_frames=FRAMES).tokens)  # the checkpoint's mode
    sigmas = i2v.sigmas(3, HEIGHT, WIDTH, num_frames=FRAMES)
    v = i2v.velocity(i2v.transformer, latents, sigmas[:1].expand(2), cond, None, 1.0)
    assert v.shape == latents.tokens.shape
    out = transition("cps", latents.tokens, v, sigmas[0], sigmas[1], 0.8, sigma_max=sigmas[1],
                     generators=make_generators([5, 6]))
    expected = -((out.next_latents - out.mean) ** 2).flatten(1).mean(1)  # the mean over generated tokens only
    torch.testing.assert_close(out.log_prob, expected, rtol=0, atol=0)
    # The decode puts the conditioning's first frame back before the generated tokens; it is handed over, never
    # remembered from the last forward.
    with pytest.raises(ValueError, match="first-frame tokens"):
        i2v.decode(out.next_latents, HEIGHT, WIDTH, num_frames=FRAMES)
    video = i2v.decode(out.next_latents, HEIGHT, WIDTH, num_frames=FRAMES, cond=cond)
    explicit = i2v.decode(out.next_latents, HEIGHT, WIDTH, num_frames=FRAMES, first_frame=first.expand(2, -1, -1))
    assert torch.equal(video, explicit) and video.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    # The wire carries the first frame: the conditioning comes back bit for bit.
    back, ids = Ltx2Family.cond_kwargs_from_wire(i2v.cond_kwargs_to_wire(cond, latents.ids))
    assert torch.equal(back.embeds, cond.embeds[:1]) and torch.equal(ids, latents.ids)


def test_image_to_video_requests_are_checked_by_name(i2v):
    engine = Engine(i2v)
    with pytest.raises(RequestError, match="a request needs one condition image") as err:
        engine.generate(_request())
    assert err.value.field == "image_path"
    with pytest.raises(RequestError, match="at most 1"):
        engine.generate(_request(image_path=[png(0), png(1)]))


def write_i2v_set(folder: Path) -> Path:
    """A tiny image-to-video prompt set: a .jsonl beside its first frames (one under images/)."""
    return write_conditioned_prompt_set(folder, "i2v", ("the cat runs", "the dog jumps"), png(0), png(1))


def _train(model_dir, prompts, out, loss_type, num_rollout=2, **flags):
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    cfg = TrainConfig.flat(
        model_path=model_dir, output_dir=out, prompt_data=prompts, loss_type=loss_type, num_rollout=num_rollout,
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=1, global_batch_size=4,
        num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=3, diffusion_sde_window_range=(0, 3),
        diffusion_num_sde_steps=2, diffusion_sde_type="cps", diffusion_noise_level=0.8,
        diffusion_guidance_scale=1.0, lr=1e-3, eval_images_per_category=0, eval_interval=10,
        checkpoint_interval=10, device="cpu", use_lora=True, lora_rank=2, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, reward="rewards_for_tests:darkness", **flags)
    trainer = Trainer(cfg)
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return records, [p.detach().clone() for p in trainer.policy.params]


@pytest.mark.parametrize("loss_type", ["flow_grpo", "nft"])
def test_training_on_an_image_to_video_prompt_set(i2v_dir, tmp_path, loss_type):
    """Two rollouts of Flow-GRPO at the published LTX-2.3 settings (CPS at noise 0.8, CFG 1, microgroup 1, LoRA)
    and of DiffusionNFT on first frames from a .jsonl: Flow-GRPO's trainer replays the engine's log-probs exactly
    from the conditioning."""
    records, _ = _train(i2v_dir, write_i2v_set(tmp_path / "data"), tmp_path / "run", loss_type)
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] == 0.0


def test_replay_of_an_image_to_video_rollout_equals_the_live_run(i2v_dir, tmp_path):
    """A saved image-to-video rollout (the first frame inside its conditioning) trains to the same weights and
    metrics when replayed."""
    prompts = write_i2v_set(tmp_path / "data")
    live, live_state = _train(i2v_dir, prompts, tmp_path / "live", "flow_grpo", num_rollout=1,
                              save_rollout_data=tmp_path / "records")
    replayed, state = _train(i2v_dir, prompts, tmp_path / "replay", "flow_grpo", num_rollout=1,
                             load_rollout_data=tmp_path / "records")
    assert all(torch.equal(a, b) for a, b in zip(state, live_state, strict=True))
    keys = ("train/loss", "train/grad_norm", "rollout/reward/raw_mean")
    assert [[r.get(k) for k in keys] for r in live] == [[r.get(k) for k in keys] for r in replayed]
