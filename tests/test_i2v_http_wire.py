"""Wan2.2 image to video (A14B I2V, TI2V-5B) and LTX-2.3 image to video through `diffrl serve`'s app, in both of
its wire formats: sglang-diffusion's JSON (a condition image as a `data:` URL, JSON tensors back) and diffrl's
compact one (`Content-Type` and `Accept: application/msgpack`: raw image bytes in, safetensors out). A request with
a first frame gets the in-process engine's videos for the same seed; a first frame on a text-to-video-only
checkpoint, and malformed ones, are refused by name, and the server serves the next good request. On tiny random
checkpoints built in code (the in-process tests against diffusers: tests/test_wan2_2_i2v.py, tests/test_ltx2_i2v.py).
"""

import asyncio
import base64
import dataclasses

import httpx
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from diffrl.cli.main import parse
from diffrl.data.condition_images import encode_png
from diffrl.engine.protocol import RolloutRequest
from diffrl.models.random_checkpoints import wan2_2 as random_wan
from diffrl.serving import sglang
from diffrl.serving.server import build_engine, create_app, serving_in_thread
from diffrl.serving.wire import MEDIA_TYPE, decode_outputs, encode_request
from family_checks import save_ltx2_i2v_checkpoint

TOLERANCE = 1e-5  # the in-process tests' (fp32 on CPU through two code paths)
COMPACT = {"content-type": MEDIA_TYPE, "accept": MEDIA_TYPE}
# Per mode: the checkpoint, the video's size (height, width, frames) and a first frame of another size (resized).
MODES = {
    "wan2.2-a14b-i2v": (lambda path: random_wan.save_random_checkpoint(path, image_to_video=True), (16, 32, 5), (20, 36)),
    "wan2.2-ti2v-5b": (lambda path: random_wan.save_random_checkpoint(path, ti2v=True), (16, 32, 5), (20, 36)),
    "ltx-2.3-i2v": (save_ltx2_i2v_checkpoint, (64, 96, 9), (50, 70)),
}
MAX_PIXELS = 8192  # --max-pixels: above every mode's frame (LTX: 64 × 96), below the oversized first frame's


def png(seed: int, size: tuple[int, int]) -> bytes:
    return encode_png(np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8))


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module", params=list(MODES))
def served(request, tmp_path_factory):
    """(mode, the app's client, an in-process engine on the same checkpoint, the request's fields, the first
    frame's size, the served engine): the app as `diffrl serve --model-path DIR --device cpu` builds it (no image
    roots: images come as bytes)."""
    save, (height, width, frames), source_size = MODES[request.param]
    model_dir = save(tmp_path_factory.mktemp("models") / request.param)
    cfg = parse(["serve", "--model-path", str(model_dir), "--device", "cpu", "--max-outputs-per-request", "4",
                 "--max-pixels", str(MAX_PIXELS)])
    engine = build_engine(cfg)
    app = create_app(engine, limits=cfg.server_limits())
    local = build_engine(cfg)  # the in-process engine, loaded on its own
    fields = dict(prompt="a red cat", seed=3, num_outputs_per_prompt=2, num_inference_steps=3, height=height,
                  width=width, num_frames=frames, negative_prompt="blurry", guidance_scale=3.0, rollout=True,
                  rollout_sde_step_indices=[0, 1], rollout_return_denoising_env=True,
                  rollout_return_dit_trajectory=True)
    with TestClient(app) as client:
        yield request.param, client, local, fields, source_size, engine


def assert_close_outputs(got, want):
    assert len(got) == len(want) == 2 and got[0].denoising_env is not None  # the first output carries it
    for a, b in zip(got, want, strict=True):
        assert a.seed == b.seed
        torch.testing.assert_close(a.generated_output, b.generated_output, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(a.rollout_log_probs, b.rollout_log_probs, rtol=0, atol=TOLERANCE)
        torch.testing.assert_close(a.dit_trajectory.latents, b.dit_trajectory.latents, rtol=0, atol=TOLERANCE)
        # The conditioning (the first frame inside it) comes back as the engine holds it.
        assert (a.denoising_env is None) == (b.denoising_env is None)
        assert a.denoising_env is None or a.denoising_env.keys() == b.denoising_env.keys()
        for key, value in (b.denoising_env or {}).items():
            torch.testing.assert_close(a.denoising_env[key], value, rtol=0, atol=0, msg=key)


def test_a_first_frame_over_http_gives_the_in_process_videos_in_both_wire_formats(served):
    mode, client, local, fields, source_size, _ = served
    source = png(0, source_size)
    want = local.generate(RolloutRequest(image_path=[source], **fields))
    as_json = RolloutRequest(image_path=[data_url(source)], **fields)

    answer = client.post("/rollout/generate", json=as_json.model_dump(exclude_none=True))
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"] == "application/json"
    assert_close_outputs(sglang.decode_response(answer.content, as_json, local.family), want)

    answer = client.post("/rollout/generate", json=as_json.model_dump(exclude_none=True), headers={"accept": MEDIA_TYPE})
    assert answer.status_code == 200 and answer.headers["content-type"] == MEDIA_TYPE, answer.text
    assert_close_outputs(decode_outputs(answer.content), want)

    answer = client.post("/rollout/generate", content=encode_request({**fields, "image_path": [source]}),
                         headers=COMPACT)
    assert answer.status_code == 200 and answer.headers["content-type"] == MEDIA_TYPE, answer.text
    compact = decode_outputs(answer.content)
    assert_close_outputs(compact, want)
    # The first frame matters (the check can fail): another one gives other videos.
    other = client.post("/rollout/generate", content=encode_request({**fields, "image_path": [png(1, source_size)]}),
                        headers=COMPACT)
    assert other.status_code == 200, other.text
    moved = max((a.generated_output - b.generated_output).abs().max() for a, b in
                zip(decode_outputs(other.content), compact))
    assert moved > 100 * TOLERANCE


def test_two_clients_first_frames_in_one_batch_each_get_their_own_videos(served, monkeypatch):
    """Two requests with different first frames arriving together over HTTP (a JSON body with a data: URL and a
    msgpack one with bytes, both answered in msgpack: one plan) denoise as one batch, each with its own first frame:
    the videos each gets alone in process. (sglang's JSON answer asks the engine for the whole trajectory: another
    plan, so it would not share their batch.)"""
    mode, _, local, fields, source_size, engine = served
    sources = [png(0, source_size), png(1, source_size)]
    alone = [local.generate(RolloutRequest(image_path=[source], **fields)) for source in sources]
    monkeypatch.setattr(engine, "config", dataclasses.replace(engine.config, batch_wait_s=0.5))
    as_json = RolloutRequest(image_path=[data_url(sources[0])], **fields)
    batches = engine.denoise_batches
    with serving_in_thread(create_app(engine)) as url:
        async def together():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                return await asyncio.gather(
                    client.post("/rollout/generate", json=as_json.model_dump(exclude_none=True),
                                headers={"accept": MEDIA_TYPE}),
                    client.post("/rollout/generate", content=encode_request({**fields, "image_path": [sources[1]]}),
                                headers=COMPACT))
        first, second = asyncio.run(together())
    assert first.status_code == second.status_code == 200, (first.text, second.text)
    assert engine.denoise_batches == batches + 1
    assert_close_outputs(decode_outputs(first.content), alone[0])
    assert_close_outputs(decode_outputs(second.content), alone[1])


def _refused(answer, status: int, field: str, *words: str) -> None:
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["field"] == field, error
    assert all(word in error["message"] for word in words), error["message"]


def test_malformed_first_frames_are_refused_by_name_and_the_server_serves_on(served):
    mode, client, local, fields, source_size, _ = served
    good = png(0, source_size)
    want = local.generate(RolloutRequest(image_path=[good], **fields))
    body = RolloutRequest(**fields).model_dump(exclude_none=True)
    over = png(2, (MAX_PIXELS // 64 + 1, 64))
    json_cases = {
        "not an image": ([data_url(b"not a picture")], 400, "not a decodable image"),
        "wrong base64": (["data:image/png;base64,@@@"], 400, "not base64"),
        "not a data URL": (["data:image/png,abc"], 400, "data:<type>;base64"),
        "too many pixels": ([data_url(over)], 400, f"above the limit of {MAX_PIXELS}"),
        "a path, no image roots": (["/etc/hostname"], 400, "reads no images from its disk"),
        "two first frames": ([data_url(good)] * 2, 400, "at most 1"),
    }
    for what, (entries, status, words) in json_cases.items():
        for headers in ({}, {"accept": MEDIA_TYPE}):
            answer = client.post("/rollout/generate", json={**body, "image_path": entries}, headers=headers)
            _refused(answer, status, "image_path", words)
    compact_cases = {
        "not an image": ([b"not a picture"], "not a decodable image"),
        "a truncated PNG": ([good[: len(good) // 2]], "not a decodable image"),
        "too many pixels": ([over], f"above the limit of {MAX_PIXELS}"),
    }
    for what, (entries, words) in compact_cases.items():
        answer = client.post("/rollout/generate", content=encode_request({**fields, "image_path": entries}),
                             headers=COMPACT)
        _refused(answer, 400, "image_path", words)
    # A body beyond --max-body-bytes (1 MiB): 413 before the engine sees it, in either format.
    large = b"\x89PNG" + bytes(1 << 20)
    _refused(client.post("/rollout/generate", json={**body, "image_path": [data_url(large)]}), 413, "body",
             "above this endpoint's limit")
    _refused(client.post("/rollout/generate", content=encode_request({**fields, "image_path": [large]}),
                         headers=COMPACT), 413, "body", "above this endpoint's limit")
    # Still serving: the next good request, in both formats, gets the in-process videos.
    answer = client.post("/rollout/generate", content=encode_request({**fields, "image_path": [good]}),
                         headers=COMPACT)
    assert answer.status_code == 200, answer.text
    assert_close_outputs(decode_outputs(answer.content), want)
    as_json = RolloutRequest(image_path=[data_url(good)], **fields)
    answer = client.post("/rollout/generate", json=as_json.model_dump(exclude_none=True))
    assert answer.status_code == 200, answer.text
    assert_close_outputs(sglang.decode_response(answer.content, as_json, local.family), want)
    assert client.get("/health").json()["in_flight"] == 0


@pytest.fixture(scope="module")
def text_to_video(tmp_path_factory):
    """Wan2.2 A14B text to video (WanPipeline): no image conditioning."""
    model_dir = random_wan.save_random_checkpoint(tmp_path_factory.mktemp("models") / "wan2.2-t2v")
    cfg = parse(["serve", "--model-path", str(model_dir), "--device", "cpu", "--max-outputs-per-request", "4"])
    with TestClient(create_app(build_engine(cfg), limits=cfg.server_limits())) as client:
        yield client


def test_a_first_frame_on_a_text_to_video_checkpoint_is_refused_by_name(text_to_video):
    fields = dict(prompt="a red cat", seed=3, num_outputs_per_prompt=2, num_inference_steps=2, height=16, width=32,
                  num_frames=5, guidance_scale=1.0)
    source = png(0, (16, 32))
    for name, value in (("image_path", [data_url(source)]), ("image", data_url(source))):
        for headers in ({}, {"accept": MEDIA_TYPE}):
            answer = text_to_video.post("/rollout/generate", json={**fields, name: value}, headers=headers)
            _refused(answer, 400, name, "text-to-video only", "image conditioning is refused")
    answer = text_to_video.post("/rollout/generate", content=encode_request({**fields, "image_path": [source]}),
                                headers=COMPACT)
    _refused(answer, 400, "image_path", "text-to-video only")
    info = text_to_video.get("/model_info").json()
    assert info["has_image_understanding"] is False and info["task_type"] == "T2V"
    answer = text_to_video.post("/rollout/generate", content=encode_request(fields), headers=COMPACT)
    assert answer.status_code == 200 and len(decode_outputs(answer.content)) == 2  # text alone: served


def test_model_info_names_each_mode_as_sglang_does(served):
    # sglang-diffusion's ModelTaskType: Wan2.2 I2V A14B is I2V, TI2V-5B is TI2V; an LTX-2 checkpoint saved as
    # LTX2ImageToVideoPipeline requires its first frame (I2V).
    mode, client, *_ = served
    info = client.get("/model_info").json()
    want = {"wan2.2-a14b-i2v": "I2V", "wan2.2-ti2v-5b": "TI2V", "ltx-2.3-i2v": "I2V"}[mode]
    assert info["task_type"] == want and info["has_image_understanding"] is True and info["is_image_gen"] is False
