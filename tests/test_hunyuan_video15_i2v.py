"""HunyuanVideo 1.5 image to video (the hunyuan_video15 family's image-conditioned mode) against diffusers'
HunyuanVideo15ImageToVideoPipeline, an image-to-video prompt set through Flow-GRPO and DiffusionNFT, the first frame
through `diffrl serve`'s app, on tiny random checkpoints built in code (a SigLIP vision encoder of 4 patches)."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.errors import ModelLoadError, RequestError
from diffrl.models.checkpoint import load_model
from diffrl.models.hunyuan_video15 import HunyuanVideo15Family
from diffrl.models.random_checkpoints.hunyuan_video15 import save_random_checkpoint
from diffrl.models.registry import resolve_family
from diffrl.sampling import make_generators
from family_checks import assert_sample_k_is_the_same_in_any_microgroup, write_conditioned_prompt_set
from test_i2v_http_wire import COMPACT, assert_close_outputs, data_url

TOLERANCE = 1e-5  # fp32 on CPU through two code paths (pixels in [0, 1]); measured: 0 (bit-identical)
# A bucket of the pipeline's at the tiny target size (64): it sizes the video from the image's aspect ratio, and
# 32 × 80 is the bucket of a 2:5 image. Latents [4, 2, 2, 5].
HEIGHT, WIDTH, FRAMES = 32, 80, 5
PROMPT = 'a sign that says "hello"'  # a quoted text: the ByT5 glyph encoder runs too


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "hunyuanvideo-1.5-i2v-tiny",
                                  image_to_video=True)


@pytest.fixture(scope="module")
def i2v(i2v_dir) -> HunyuanVideo15Family:
    return HunyuanVideo15Family.load(i2v_dir)


@pytest.fixture(scope="module")
def t2v_dir(tmp_path_factory) -> Path:
    return save_random_checkpoint(tmp_path_factory.mktemp("models") / "hunyuanvideo-1.5-t2v-tiny")


def pixels(seed: int, size=(HEIGHT, WIDTH)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)


def png(seed: int, size=(HEIGHT, WIDTH)) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels(seed, size)).save(buffer, format="PNG")
    return buffer.getvalue()


def _request(**fields) -> RolloutRequest:
    return RolloutRequest(**{"prompt": PROMPT, "seed": 3, "num_outputs_per_prompt": 2, "num_inference_steps": 2,
                             "height": HEIGHT, "width": WIDTH, "num_frames": FRAMES, **fields})


@pytest.mark.parametrize(("negative", "guidance", "size"), [("", 1.0, (HEIGHT, WIDTH)), ("blurry", 4.5, (36, 92))],
                         ids=["no-cfg", "cfg-resized"])
def test_engine_reproduces_the_image_to_video_pipeline(i2v, negative, guidance, size):
    """ODE sampling through our engine gives HunyuanVideo15ImageToVideoPipeline's videos from the same noise and
    first frame, with CFG (the negative half sees the image too) and without, and from a first frame of another
    size (36 × 92, whose bucket is the video's), which both resize and center-crop to the video's."""
    engine = Engine(i2v, EngineConfig(max_outputs_per_request=4))
    outputs = engine.generate(_request(negative_prompt=negative, guidance_scale=guidance, image_path=[png(0, size)]))
    ours = torch.stack([o.generated_output for o in outputs])
    noise = i2v.prepare_latents(make_generators([3, 4]), HEIGHT, WIDTH, num_frames=FRAMES).tokens

    def pipeline(seed):
        pipe = i2v.reference_pipeline()
        assert type(pipe).__mro__[1].__name__ == "HunyuanVideo15ImageToVideoPipeline"
        return pipe(image=Image.fromarray(pixels(seed, size)), prompt=PROMPT,
                    negative_prompt=negative if guidance > 1 else None, latents=noise, num_inference_steps=2,
                    guidance_scale=guidance, num_frames=FRAMES, num_videos_per_prompt=2,
                    output_type="pt").frames.permute(0, 2, 1, 3, 4)

    reference = pipeline(0)
    assert ours.shape == reference.shape == (2, 3, FRAMES, HEIGHT, WIDTH)
    assert 0 <= ours.min() and ours.max() <= 1
    torch.testing.assert_close(ours, reference, rtol=0, atol=TOLERANCE)
    assert engine.image_encodes == 1  # once per request, shared by its outputs and CFG's negative half
    other = pipeline(1)
    assert (other - reference).abs().max() > 100 * TOLERANCE  # the first frame matters: the check can fail


def test_sample_k_is_the_same_in_any_microgroup(i2v):
    assert_sample_k_is_the_same_in_any_microgroup(i2v, guidance_scale=4.5, height=HEIGHT, width=WIDTH,
                                                  num_frames=FRAMES, image_path=[png(0)])


def test_the_first_frame_travels_in_the_conditioning_and_on_the_wire(i2v):
    """Encoded once: SigLIP's 4 tokens of 8 and the first frame's latents [4, 1, 2, 5], folded into rows after the
    text tokens of the prompt's conditioning, read back unchanged by the forward, and across sglang's wire."""
    source = torch.from_numpy(pixels(0)).permute(2, 0, 1)
    encoded = i2v.encode_condition_images([source], height=HEIGHT, width=WIDTH, num_frames=FRAMES)
    assert encoded.shape == (1, 4 * 8 + 4 * 2 * 5)
    text_only = i2v.encode_prompts([PROMPT, "a red cat"])
    cond = i2v.condition_on_images(text_only, encoded)
    assert torch.equal(cond.embeds[:, : text_only.embeds.shape[1]], text_only.embeds)
    assert len(cond.ids) == cond.embeds.shape[1] > text_only.embeds.shape[1]  # a layout of its own
    tokens, first = i2v.unpack_first_frame(cond.embeds, torch.zeros(2, 4, 2, 2, 5))
    assert tokens.shape == (2, 4, 8) and first.shape == (2, 4, 1, 2, 5)
    assert torch.equal(torch.cat([tokens[0].flatten(), first[0].flatten()]), encoded[0])
    assert tokens.abs().sum() > 0 and first.abs().sum() > 0
    wire = i2v.cond_kwargs_to_wire(cond, torch.zeros(0, 1))
    back, _ = HunyuanVideo15Family.cond_kwargs_from_wire(wire)
    assert torch.equal(back.embeds, cond.embeds[:1]) and torch.equal(back.ids, cond.ids)
    # Another size is another condition (the engine keys its cache by the output's size).
    assert i2v.encode_condition_images([source], height=48, width=64).shape == (1, 4 * 8 + 4 * 3 * 4)


def test_the_loader_picks_image_to_video_and_reports_i2v(i2v_dir, t2v_dir, tmp_path):
    """By the folder's name and by the transformer's class; the model index's pipeline class decides the mode, which
    `/model_info` reports in sglang-diffusion's words."""
    assert resolve_family(None, i2v_dir) is HunyuanVideo15Family
    renamed = tmp_path / "some-checkpoint"
    shutil.copytree(i2v_dir, renamed)
    index = json.loads((renamed / "model_index.json").read_text())
    del index["diffrl"]["family"]
    (renamed / "model_index.json").write_text(json.dumps(index))
    assert resolve_family(None, renamed) is HunyuanVideo15Family
    model = load_model(renamed)
    assert isinstance(model, HunyuanVideo15Family) and model.settings.image_to_video
    assert model.task_type == "I2V" and model.requires_image_conditioning and model.max_condition_images == 1
    assert type(model.image_encoder).__name__ == "SiglipVisionModel" and model.settings.image_tokens == 4
    t2v = load_model(t2v_dir)
    assert t2v.task_type == "T2V" and not t2v.accepts_image_conditioning and t2v.image_encoder is None
    # Without its text encoders (a trainer's policy), the image encoder is left out too.
    assert HunyuanVideo15Family.load(i2v_dir, load_text_encoder=False).image_encoder is None
    # An image-token count that contradicts the encoder's patches is refused.
    index["diffrl"]["image_tokens"] = 9
    (renamed / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"image_tokens=9, but the image encoder makes 4"):
        HunyuanVideo15Family.load(renamed)


def test_requests_without_a_first_frame_or_with_two_are_refused_by_name(i2v):
    engine = Engine(i2v)
    for guidance in (1.0, 4.5):
        with pytest.raises(RequestError, match="is image to video: a request needs one condition image") as err:
            engine.generate(_request(guidance_scale=guidance, negative_prompt="blurry"))
        assert err.value.field == "image_path"
    with pytest.raises(RequestError, match="takes at most 1") as err:
        engine.generate(_request(image_path=[png(0), png(1)]))
    assert err.value.field == "image_path"


def test_a_first_frame_on_the_text_to_video_checkpoint_is_refused_by_name(t2v_dir):
    engine = Engine(HunyuanVideo15Family.load(t2v_dir))
    with pytest.raises(RequestError, match="text-to-video only; image conditioning is refused") as err:
        engine.generate(_request(image_path=[png(0)]))
    assert err.value.field == "image_path"


@pytest.fixture(scope="module")
def served(i2v_dir):
    """`diffrl serve --model-path DIR --device cpu`'s app on the image-to-video checkpoint, and an in-process engine
    loaded on its own."""
    from diffrl.cli.main import parse
    from diffrl.serving.server import build_engine, create_app

    cfg = parse(["serve", "--model-path", str(i2v_dir), "--device", "cpu", "--max-outputs-per-request", "4"])
    with TestClient(create_app(build_engine(cfg), limits=cfg.server_limits())) as client:
        yield client, build_engine(cfg)


def test_a_first_frame_over_http_gives_the_in_process_videos(served):
    """sglang-diffusion's JSON (a data: URL in, JSON tensors back, the conditioning with the first frame in it) and
    diffrl's compact format give the in-process engine's rollout; `/model_info` says I2V; no first frame: refused."""
    from diffrl.serving import sglang
    from diffrl.serving.wire import decode_outputs, encode_request

    client, local = served
    fields = dict(prompt=PROMPT, seed=3, num_outputs_per_prompt=2, num_inference_steps=2, height=HEIGHT, width=WIDTH,
                  num_frames=FRAMES, negative_prompt="blurry", guidance_scale=3.0, rollout=True,
                  rollout_sde_step_indices=[0], rollout_return_denoising_env=True, rollout_return_dit_trajectory=True)
    source = png(0, (36, 92))
    want = local.generate(RolloutRequest(image_path=[source], **fields))
    as_json = RolloutRequest(image_path=[data_url(source)], **fields)
    answer = client.post("/rollout/generate", json=as_json.model_dump(exclude_none=True))
    assert answer.status_code == 200, answer.text
    assert_close_outputs(sglang.decode_response(answer.content, as_json, local.family), want)
    answer = client.post("/rollout/generate", content=encode_request({**fields, "image_path": [source]}),
                         headers=COMPACT)
    assert answer.status_code == 200, answer.text
    assert_close_outputs(decode_outputs(answer.content), want)
    info = client.get("/model_info").json()
    assert info["task_type"] == "I2V" and info["has_image_understanding"] is True and info["is_image_gen"] is False
    answer = client.post("/rollout/generate", content=encode_request(fields), headers=COMPACT)
    assert answer.status_code == 400 and answer.json()["error"]["field"] == "image_path", answer.text
    assert "needs one condition image" in answer.json()["error"]["message"]


SEEN = []


def brightness_seeing_the_source(images, prompts, metadata):
    """A reward that records each sample's first frame (the metadata's condition images) and scores brightness."""
    SEEN.extend(m[CONDITION_IMAGES_KEY][0].shape for m in metadata)
    return [float(image.float().mean()) for image in images]


@pytest.mark.parametrize("loss_type", ["flow_grpo", "nft"])
def test_training_on_an_image_to_video_prompt_set(i2v_dir, tmp_path, loss_type):
    """Two rollouts of Flow-GRPO (CFG, the first frame in both halves) and of DiffusionNFT with LoRA, on a .jsonl
    whose rows carry first frames (`image`, `images`); the reward sees each prompt's first frame, and Flow-GRPO's
    trainer replays the engine's steps from the conditioning (its log-probs match)."""
    from diffrl.train.config import TrainConfig
    from diffrl.train.trainer import Trainer

    SEEN.clear()
    prompts = write_conditioned_prompt_set(tmp_path / "data", "i2v", ("the cat walks", "the dog runs"),
                                           png(0, (36, 92)), png(1))
    out = tmp_path / "run"
    cfg = TrainConfig.flat(
        output_dir=out, model_path=i2v_dir, prompt_data=prompts, loss_type=loss_type, num_rollout=2,
        rollout_batch_size=2, n_samples_per_prompt=2, rollout_microgroup_size=2, global_batch_size=4,
        num_steps_per_rollout=1, micro_batch_size=4, diffusion_num_steps=2, height=HEIGHT, width=WIDTH,
        num_frames=FRAMES, diffusion_guidance_scale=2.0 if loss_type == "flow_grpo" else 1.0, lr=1e-3, device="cpu",
        use_lora=True, lora_rank=2, reward="jpeg_compressibility", eval_images_per_category=0, checkpoint_interval=10,
        **({"diffusion_sde_window_range": (0, 2)} if loss_type == "flow_grpo" else {}))
    trainer = Trainer(cfg, reward_fn=brightness_seeing_the_source)
    trainer.train()
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in records if "train/loss" in r]
    assert len(trained) == 2 and all(np.isfinite(r["train/loss"]) for r in trained)
    if loss_type == "flow_grpo":
        assert trained[-1]["train/log_prob_mean_abs_diff"] < 1e-4
    assert SEEN and {shape for shape in SEEN} == {(3, 36, 92), (3, HEIGHT, WIDTH)}
    assert any("lora_B" in name and w.abs().max() > 0 for name, w in trainer.policy.transformer.state_dict().items())
