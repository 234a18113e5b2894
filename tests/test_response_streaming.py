"""Rollout responses streamed: the server writes a body as it sends it (the same bytes, with Content-Length,
never the whole body in memory), the client decodes each output as its bytes land and the rollout manager
scores each video then; a client leaving mid-body stops the writing and leaves the server answering."""

import asyncio
import base64
import json
import socket
import struct
import threading
import time
import tracemalloc

import httpx
import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from diffrl.serving import sglang, streaming
from diffrl.serving import server as server_module
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import DitTrajectory, RolloutOutput, RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.serving.streaming import Base64, Body, JsonListSplitter, TensorFile, json_parts
from diffrl.serving.wire import OutputStreamDecoder, WireFormatError, decode_outputs, encode_outputs, output_body
from diffrl.models.registry import get_family
from diffrl.rollout import EngineUnavailable, HttpEngineClient, RolloutManager, RolloutSettings

ROLLOUT = dict(num_inference_steps=3, guidance_scale=3.0, rollout=True, rollout_sde_step_indices=[0, 1],
               rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
LTX2 = get_family("ltx2")  # a video family's JSON records keep [C, F, H, W]
SIGMAS = torch.tensor([1.0, 0.6, 0.3, 0.0])
PROMPT = 'a "red" {circle} [and] a \\ blue ünïcode square'  # JSON escapes and brackets inside strings


@pytest.fixture
def engine(tiny_family):
    return Engine(tiny_family, EngineConfig(max_outputs_per_request=8))


def _video(seed: int, frames: int = 3, size: int = 8) -> RolloutOutput:
    """A small video output, as a video family's engine returns it."""
    g = torch.Generator().manual_seed(seed)
    return RolloutOutput(seed=seed, generated_output=torch.rand(3, frames, size, size, generator=g),
                         rollout_log_probs=torch.randn(2, generator=g),  # ROLLOUT's two SDE steps of 3
                         dit_trajectory=DitTrajectory(torch.randn(4, 12, 4, generator=g), SIGMAS, SIGMAS,
                                                      torch.arange(4)),
                         denoising_env=None, weight_version=3, inference_time_s=0.5, peak_memory_mb=1.0)


def _reference_sglang_json(outputs, req, family, request_id) -> bytes:
    """sglang's JSON list as `encode_response` built it in one piece before it streamed: every tensor
    base64'd with `tensor_to_json`, the records through one `json.dumps`."""
    n = req.num_inference_steps
    sde = torch.tensor(sglang.sde_steps(req), dtype=torch.int64)
    first = outputs[0]
    env = sglang._to_json(sglang._env_to_wire(first.denoising_env, family)) if first.denoising_env else None
    records = []
    for out in outputs:
        full = torch.zeros(n)
        full[sde] = out.rollout_log_probs.float()
        records.append({
            "request_id": request_id, "prompt": req.prompt, "seed": req.seed,
            "generated_output": sglang.tensor_to_json(out.generated_output.unsqueeze(1)),
            "rollout_log_probs": sglang.tensor_to_json(full), "rollout_debug_tensors": None, "denoising_env": env,
            "dit_trajectory": {"latents": sglang.tensor_to_json(out.dit_trajectory.latents),
                               "timesteps": sglang.tensor_to_json(out.dit_trajectory.timesteps[:-1]),
                               "sigmas": sglang.tensor_to_json(out.dit_trajectory.sigmas)},
            "inference_time_s": out.inference_time_s, "peak_memory_mb": out.peak_memory_mb})
    return json.dumps(records, separators=(",", ":"), allow_nan=False).encode()


def _reference_compact(outputs) -> bytes:
    """The compact body as msgpack itself packs it: each output's dataclass fields as a map, each tensor as
    {"__tensor__", "data": a safetensors file holding it as "data", "shape", "dtype"}."""
    import dataclasses

    def wire(value):
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().cpu()
            return {"__tensor__": True, "data": save_safetensors({"data": t}), "shape": list(t.shape),
                    "dtype": str(t.dtype).removeprefix("torch.")}
        if dataclasses.is_dataclass(value):
            return {f.name: wire(getattr(value, f.name)) for f in dataclasses.fields(value)}
        if isinstance(value, dict):
            return {k: wire(v) for k, v in value.items()}
        return value

    return msgpack.packb([wire(o) for o in outputs], use_bin_type=True)


# ---------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("tensor", [
    torch.randn(2, 3), torch.randn(4, 5).t(), torch.zeros((), dtype=torch.bfloat16), torch.zeros(0, 4, dtype=torch.int64),
    torch.tensor([True, False, True]), torch.randn(7, dtype=torch.float16), torch.arange(11, dtype=torch.uint8),
    torch.randn(3, dtype=torch.float64), torch.randn(3, dtype=torch.complex64)], ids=lambda t: str(t.dtype))
def test_a_tensor_file_is_the_bytes_safetensors_writes(tensor):
    whole = save_safetensors({"t": tensor.contiguous()})
    file = TensorFile(tensor, "t")
    assert file.length == len(whole)
    for size in (1, 2, 5, 64, 1 << 20):
        assert b"".join(file.pieces(size)) == whole
        text = Base64(file)
        assert b"".join(text.pieces(size)) == base64.b64encode(whole) and text.length == len(base64.b64encode(whole))
    if tensor.dtype != torch.complex64:  # written by safetensors itself: needs the data
        assert TensorFile(torch.empty(tensor.shape, dtype=tensor.dtype, device="meta"), "t").length == len(whole)


def test_a_weight_update_is_the_file_safetensors_writes_sent_tensor_by_tensor():
    """A weight push's body (`wire.weights_body`) is byte for byte `safetensors.torch.save` of the tensors, in
    any mix of dtypes and names, without gathering them first; the server's decoder reads it back."""
    from diffrl.serving.wire import decode_weights, weights_body
    torch.manual_seed(0)
    tensors = {"b.weight": torch.randn(3, 5), "d.bias": torch.randn(7).to(torch.bfloat16), "a.h": torch.randn(2).half(),
               "step": torch.arange(4), "mask": torch.tensor([True, False]), "empty": torch.zeros(0),
               "t.weight": torch.randn(6, 4).t(), "n": torch.randn(3, dtype=torch.float64),
               "q": torch.arange(5, dtype=torch.int32), "u": torch.arange(3, dtype=torch.uint8)}
    whole = save_safetensors({k: v.contiguous() for k, v in tensors.items()})
    body = weights_body(tensors)
    assert body.length == len(whole)
    for size in (1, 7, 64, 1 << 20):
        assert b"".join(body.chunks(size)) == whole
    back = decode_weights(b"".join(body.chunks()))
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())


def _weights():
    torch.manual_seed(1)
    return {"b.weight": torch.randn(3, 5), "d.bias": torch.randn(7).to(torch.bfloat16), "a.h": torch.randn(2).half(),
            "step": torch.arange(4), "mask": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3),
            "scalar": torch.tensor(2.5), "n": torch.randn(3, dtype=torch.float64), "u": torch.arange(3, dtype=torch.uint8)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_a_weight_update_read_in_place_equals_safetensors_reading_it():
    """A server reads a push's tensors over the body's own memory (`decode_weights(views=True)`): the same
    tensors as safetensors' copying reader, also for a file whose offsets do not suit an element size."""
    from diffrl.serving.wire import decode_weights
    body = save_safetensors(_weights())
    assert _same(decode_weights(body, views=True), load_safetensors(body))
    # Hand-made: a 1-byte tensor first puts the float32 tensor after it at an odd offset.
    header = json.dumps({"u": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                         "f": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}).encode()
    header += b" " * (-len(header) % 8)
    odd = struct.pack("<Q", len(header)) + header + b"\x07" + struct.pack("<2f", 1.5, -2.0)
    assert _same(decode_weights(odd, views=True), load_safetensors(odd))


@pytest.mark.parametrize("change", ["short", "header-past-end", "not-json", "not-object", "unknown-dtype", "bad-shape",
                                    "size-mismatch", "offsets-outside", "gap", "overlap", "trailing", "extra-key"])
def test_a_malformed_weight_update_is_refused_by_the_in_place_reader(change):
    from diffrl.serving.wire import WireFormatError, decode_weights

    def file(entries: dict, data: bytes) -> bytes:
        text = json.dumps(entries).encode()
        return struct.pack("<Q", len(text)) + text + data

    f32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    bodies = {
        "short": b"\x01\x00", "header-past-end": struct.pack("<Q", 10**6) + b"{}",
        "not-json": struct.pack("<Q", 3) + b"{x}", "not-object": file([1, 2], b""),
        "unknown-dtype": file({"a": {**f32, "dtype": "F128"}}, bytes(8)),
        "bad-shape": file({"a": {**f32, "shape": [-2]}}, bytes(8)),
        "size-mismatch": file({"a": {**f32, "shape": [3]}}, bytes(8)),
        "offsets-outside": file({"a": {**f32, "data_offsets": [4, 12]}}, bytes(8)),
        "gap": file({"a": {**f32, "data_offsets": [4, 12]}}, bytes(12)),
        "overlap": file({"a": f32, "b": {**f32, "data_offsets": [4, 12]}}, bytes(12)),
        "trailing": file({"a": f32}, bytes(9)), "extra-key": file({"a": {**f32, "x": 1}}, bytes(8)),
    }
    with pytest.raises(WireFormatError, match="not valid safetensors"):
        decode_weights(bodies[change], views=True)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_the_in_place_reader_accepts_what_safetensors_accepts(data):
    """Differential: a valid body with bytes changed or cut is read the same by both readers, or refused by
    both; the in-place reader never fails any other way."""
    from diffrl.serving.wire import WireFormatError, decode_weights
    body = bytearray(save_safetensors(_weights()))
    for _ in range(data.draw(st.integers(0, 3))):
        i = data.draw(st.integers(0, len(body) - 1))
        body[i] = data.draw(st.integers(0, 255))
    body = bytes(body[:data.draw(st.integers(0, len(body)))] if data.draw(st.booleans()) else body)
    try:
        expected = load_safetensors(body)
    except Exception:
        expected = None
    if expected is not None and any(t.dtype not in streaming.SAFETENSORS_DTYPES for t in expected.values()):
        expected = None  # a dtype no weight update carries (uint64, complex64, …): refused by design
    try:
        got = decode_weights(body, views=True)
    except WireFormatError:
        got = None
    assert (got is None) == (expected is None)
    if got is None:
        return
    assert got.keys() == expected.keys()
    for k in got:  # a changed bool byte reads as True here; safetensors keeps the raw byte
        assert got[k].dtype == expected[k].dtype and (k == "mask" or torch.equal(got[k], expected[k]))


def test_streamed_bodies_are_the_bytes_built_in_one_piece(engine):
    for fields in ({**ROLLOUT, "negative_prompt": "blurry"}, {**ROLLOUT, "rollout_return_step_indices": [1, 3]}):
        req = RolloutRequest(prompt=PROMPT, seed=5, num_outputs_per_prompt=3, **fields)
        outputs = engine.generate(req)
        built = _reference_compact(outputs)
        body = output_body(outputs)
        assert body.length == len(built) and bytes(body) == built == encode_outputs(outputs)
        sreq = sglang.engine_request(req)
        json_outputs = engine.generate(sreq)
        reference = _reference_sglang_json(json_outputs, req, engine.family, "id")
        json_body = sglang.response_body(json_outputs, req, engine.family, "id")
        assert json_body.length == len(reference)
        assert sglang.encode_response(json_outputs, req, engine.family, "id") == reference
        for size in (3, 100, 4096):  # any chunking writes the same bytes
            assert b"".join(body.chunks(size)) == built
            assert b"".join(json_body.chunks(size)) == reference
    videos = [_video(k) for k in range(3)]
    assert bytes(output_body(videos)) == _reference_compact(videos)
    assert bytes(output_body([_video(0)] * 17)) == _reference_compact([_video(0)] * 17)  # array16 header
    nested = {"a": [1, 2.5, None, True, "x\u00e9\n"], "b": {"c": [], "d": {}}, "e": -3}
    assert bytes(Body(json_parts(nested))) == json.dumps(nested, separators=(",", ":")).encode()


def test_writing_a_streamed_body_holds_a_chunk_not_the_body():
    videos = [_video(k, frames=96, size=128) for k in range(4)]  # 4 × 18.9 MB of pixels
    size = output_body(videos).length
    tracemalloc.start()
    try:
        encode_outputs(videos)
        built_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        written = sum(len(chunk) for chunk in output_body(videos).chunks())
        streamed_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert written == size
    assert built_peak > size  # the body, at least
    assert streamed_peak < 3 * streaming.CHUNK_BYTES < size / 4


# ---------------------------------------------------------------------------- decoding as bytes arrive
def _record_ends(outputs) -> tuple[bytes, list[int]]:
    """The compact body and the offset where each record ends (fewer than 16 records: a 1-byte header)."""
    ends, end = [], 1
    for output in outputs:
        end += len(encode_outputs([output])) - 1
        ends.append(end)
    return encode_outputs(outputs), ends


def test_the_compact_decoder_hands_out_each_output_when_its_last_byte_is_in():
    outputs = [_video(k) for k in range(3)]
    body, ends = _record_ends(outputs)
    decoder, got, fed = OutputStreamDecoder(), [], 0
    for end in ends:
        got += decoder.feed(body[fed:end - 1])
        assert len(got) == len(ends[:ends.index(end)])  # not yet: one byte is missing
        got += decoder.feed(body[end - 1:end])
        fed = end
        assert len(got) == ends.index(end) + 1
    decoder.finish()
    for a, b in zip(got, decode_outputs(body), strict=True):
        assert torch.equal(a.generated_output, b.generated_output) and a.seed == b.seed
    assert all(len(OutputStreamDecoder().feed(body[:k])) == 0 for k in range(1, 40))
    with pytest.raises(WireFormatError, match="ended after 2 of 3"):
        truncated = OutputStreamDecoder()
        truncated.feed(body[:-1])
        truncated.finish()
    with pytest.raises(WireFormatError, match="after the last"):
        OutputStreamDecoder().feed(body + b"\x00")
    with pytest.raises(WireFormatError, match="must be a list"):
        OutputStreamDecoder().feed(msgpack.packb({"a": 1}))


def test_the_json_decoder_hands_out_each_output_when_its_record_closes(engine):
    req = RolloutRequest(prompt=PROMPT, seed=9, num_outputs_per_prompt=3, **ROLLOUT)
    outputs = engine.generate(sglang.engine_request(req))
    body = sglang.encode_response(outputs, req, engine.family, "id")
    first_end = len(b"[" + sglang.encode_response(outputs[:1], req, engine.family, "id")[1:-1])
    decoder = sglang.ResponseStreamDecoder(req, type(engine.family))
    assert decoder.feed(body[:first_end - 1]) == []
    assert len(got := decoder.feed(body[first_end - 1:first_end])) == 1
    for k in range(first_end, len(body), 997):  # the rest in odd pieces
        got += decoder.feed(body[k:k + 997])
    decoder.finish()
    whole = sglang.decode_response(body, req, type(engine.family))
    for a, b in zip(got, whole, strict=True):
        assert torch.equal(a.generated_output, b.generated_output) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
    assert got[0].denoising_env is not None and got[1].denoising_env is None

    spaced = b' [ {"a": "}\\"{", "b": [1, {"c": 2}]} ,\n{"d": "\\\\"} ] '
    splitter, elements = JsonListSplitter(), []
    for byte in spaced:  # one byte at a time: escapes split across feeds
        elements += splitter.feed(bytes([byte]))
    splitter.finish()
    assert [json.loads(e) for e in elements] == json.loads(spaced)
    for bad in (b'{"a": 1}', b'[1, 2]', b'[{"a": 1}] x', b'[{"a": 1},]'):
        with pytest.raises(WireFormatError):
            JsonListSplitter().feed(bad)
    for short in (b'[{"a": 1}', b'[{"a": 1},', b'[{"a": "}'):
        with pytest.raises(WireFormatError, match="ended early"):
            cut = JsonListSplitter()
            cut.feed(short)
            cut.finish()


# ---------------------------------------------------------------------------- client and scorer
def _held_back_server(outputs, compact: bool, release: threading.Event):
    """Answers every rollout request with `outputs`, writing output 0 and then holding the rest back until
    `release` is set (or 20 s pass)."""
    app = FastAPI()

    @app.post("/rollout/generate")
    async def generate():
        req = RolloutRequest(prompt="p", num_outputs_per_prompt=len(outputs), num_frames=3, **ROLLOUT)
        first = (output_body(outputs[:1]) if compact else
                 sglang.response_body(outputs[:1], req, LTX2, "id"))
        whole = output_body(outputs) if compact else sglang.response_body(outputs, req, LTX2, "id")
        data = bytes(whole)
        cut = first.length - (1 if not compact else 0)  # JSON: up to and with record 0's closing brace

        async def held_back():
            yield data[:cut]
            await asyncio.to_thread(release.wait, 20)
            yield data[cut:]
        return StreamingResponse(held_back(), media_type="application/msgpack" if compact else "application/json",
                                 headers={"content-length": str(len(data))})
    return app


@pytest.mark.parametrize("compact", [True, False], ids=["compact", "json"])
def test_the_first_video_is_scored_while_the_server_still_holds_the_rest(compact):
    outputs = [_video(k) for k in range(3)]
    release, calls = threading.Event(), []

    def reward(images, prompts, metadata):
        calls.append((images.shape[0], [m["sample_index"] for m in metadata], release.is_set()))
        release.set()  # the server sends outputs 1 and 2 only now
        return [float(images.mean())] * images.shape[0]

    with serving_in_thread(_held_back_server(outputs, compact, release)) as url:
        client = HttpEngineClient(url, family="ltx2", wire_format="compact" if compact else "sglang")
        manager = RolloutManager([client], RolloutSettings(n_samples_per_prompt=3, rollout_microgroup_size=3),
                                 reward_fn=reward)
        try:
            start = time.monotonic()
            groups = asyncio.run(manager.rollout(["p"], ROLLOUT))
        finally:
            client.close()
    assert time.monotonic() - start < 15  # not the server's 20 s fallback
    assert calls == [(1, [0], False), (1, [1], True), (1, [2], True)]  # output 0 scored before 1 left the server
    assert [s.reward for s in groups[0]] == [pytest.approx(float(o.generated_output.mean())) for o in outputs]


class StreamingFake:
    """Streams a request's outputs with a pause between them; `fail_after`: raise after that many."""

    streams_outputs = True

    def __init__(self, name, make, fail_after=None, pause=0.02):
        self.name, self.make, self.fail_after, self.pause = name, make, fail_after, pause
        self.done_at = []

    async def generate(self, request, on_output=None):
        outputs = [self.make(request.seed + i) for i in range(request.num_outputs_per_prompt)]
        for i, output in enumerate(outputs):
            if i == self.fail_after:
                raise EngineUnavailable(f"{self.name} broke mid-response")
            await asyncio.sleep(self.pause)
            if on_output is not None:
                on_output(i, output)
        self.done_at.append(time.monotonic())
        return outputs


def _image(seed):
    return RolloutOutput(seed=seed, generated_output=torch.full((3, 4, 4), seed / 100), rollout_log_probs=None,
                         dit_trajectory=None, denoising_env=None, weight_version=0, inference_time_s=0, peak_memory_mb=0)


def _recording_reward(calls):
    async def reward(images, prompts, metadata):
        calls.append((time.monotonic(), [m["sample_index"] for m in metadata]))
        return [float(images[k].mean()) for k in range(len(prompts))]
    return reward


def test_streamed_videos_are_scored_one_by_one_and_images_per_microgroup():
    calls = []
    video = StreamingFake("v", lambda seed: _video(seed))
    manager = RolloutManager([video], RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=4),
                             reward_fn=_recording_reward(calls))
    groups = asyncio.run(manager.rollout(["p"]))
    assert [indices for _, indices in calls] == [[0], [1], [2], [3]]
    assert calls[0][0] < video.done_at[0]  # before the response was complete
    assert [s.reward for s in groups[0]] == [pytest.approx(float(_video(s.seed).generated_output.mean()))
                                             for s in groups[0]]

    calls.clear()
    manager.stream_scoring = False
    asyncio.run(manager.rollout(["p"]))
    assert [indices for _, indices in calls] == [[0, 1, 2, 3]]

    calls.clear()
    asyncio.run(RolloutManager([StreamingFake("i", _image)], manager.settings, _recording_reward(calls)).rollout(["p"]))
    assert [indices for _, indices in calls] == [[0, 1, 2, 3]]  # images: one batch per microgroup


def test_a_response_broken_mid_stream_is_retried_and_each_video_scored_once():
    calls = []
    broken = StreamingFake("broken", _video, fail_after=2)
    good = StreamingFake("good", _video)
    manager = RolloutManager([broken, good], RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=4),
                             reward_fn=_recording_reward(calls), engine_concurrency=1)
    groups = asyncio.run(manager.rollout(["p"]))
    assert sorted(i for _, indices in calls for i in indices) == [0, 1, 2, 3]
    assert manager.last_stats.retries == 1
    assert [s.seed for s in groups[0]] == [0, 1, 2, 3]
    assert all(torch.equal(s.output.generated_output, _video(s.seed).generated_output) for s in groups[0])


# ---------------------------------------------------------------------------- the server
def test_the_server_streams_both_formats_with_content_length(engine):
    request = RolloutRequest(prompt=PROMPT, seed=5, num_outputs_per_prompt=3, **ROLLOUT)
    expected = engine.generate(request)
    with serving_in_thread(create_app(engine)) as url:
        for accept in ("application/msgpack", "application/json"):
            answer = httpx.post(f"{url}/rollout/generate", json=request.model_dump(exclude_none=True),
                                headers={"accept": accept}, timeout=60)
            assert answer.status_code == 200 and answer.headers["content-type"].startswith(accept)
            assert int(answer.headers["content-length"]) == len(answer.content)
            assert "transfer-encoding" not in answer.headers
            got = (decode_outputs(answer.content) if accept == "application/msgpack"
                   else sglang.decode_response(answer.content, request, type(engine.family)))
            assert all(torch.equal(a.generated_output, b.generated_output) for a, b in zip(got, expected, strict=True))
        for accept in ("application/msgpack", "application/json"):  # bad input: still a 4xx naming the field
            refused = httpx.post(f"{url}/rollout/generate", json={"prompt": "p", "num_outputs_per_prompt": 99},
                                 headers={"accept": accept}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["field"] == "num_outputs_per_prompt"
            unknown = httpx.post(f"{url}/rollout/generate", json={"prompt": "p", "bogus": 1}, headers={"accept": accept})
            assert unknown.status_code == 422 and "bogus" in unknown.text


@pytest.mark.parametrize("accept", ["application/msgpack", "application/json"])
def test_a_client_leaving_mid_body_stops_the_writing_and_the_server_keeps_answering(engine, monkeypatch, accept):
    big = [_video(k, frames=48, size=256) for k in range(2)]  # ~75 MB of pixels per output: beyond socket buffers
    written, ended = [], threading.Event()
    real_stream = server_module.stream

    async def counted(body, size=streaming.CHUNK_BYTES):
        written.append(body.length)
        try:
            async for chunk in real_stream(body, size):
                written.append(len(chunk))
                yield chunk
        finally:
            ended.set()

    monkeypatch.setattr(server_module, "stream", counted)
    agenerate = engine.agenerate

    async def big_outputs(req, cancel=None):
        return big if req.prompt == "big" else await agenerate(req, cancel)

    monkeypatch.setattr(engine, "agenerate", big_outputs)
    with serving_in_thread(create_app(engine)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({"prompt": "big", "num_outputs_per_prompt": 2, **ROLLOUT}).encode()
        head = (f"POST /rollout/generate HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: {accept}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port))) as client:
            client.sendall(head + body)
            received = b""
            while len(received) < 1 << 20:
                received += client.recv(1 << 16)
            assert received.startswith(b"HTTP/1.1 200")
        assert ended.wait(20)  # the writing stopped once the client was gone
        total, sent = written[0], sum(written[1:])
        assert sent < total / 2
        request = RolloutRequest(prompt="a red circle", seed=2, num_outputs_per_prompt=2, **ROLLOUT)
        again = httpx.post(f"{url}/rollout/generate", json=request.model_dump(exclude_none=True),
                           headers={"accept": accept}, timeout=60)
        assert again.status_code == 200
        got = (decode_outputs(again.content) if accept == "application/msgpack"
               else sglang.decode_response(again.content, request, type(engine.family)))
        assert all(torch.equal(a.generated_output, b.generated_output)
                   for a, b in zip(got, engine.generate(request), strict=True))
        assert engine.in_flight == 0
