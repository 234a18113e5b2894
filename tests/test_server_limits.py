"""Issue 23, server half: each defect an outside probe found in `diffrl serve`, reproduced with the
probe's own input, and shown fixed: a 4xx naming the field or header, nothing changed, the server
still serving."""

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from diffrl.engine.engine import INT64_MAX, Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import ServeConfig, create_app, serving_in_thread
from diffrl.serving.wire import decode_outputs

WEIGHTS = {"content-type": "application/octet-stream"}
COMPACT = {"accept": "application/msgpack"}
SAMPLE = {"prompt": "a red circle", "seed": 7, "num_inference_steps": 2}


def _client(engine, **kwargs) -> TestClient:
    return TestClient(create_app(engine, **kwargs), base_url="http://127.0.0.1")


def _sample(client) -> torch.Tensor:
    response = client.post("/rollout/generate", json=SAMPLE, headers=COMPACT)
    assert response.status_code == 200, response.text
    return decode_outputs(response.content)[0].generated_output


def _state(engine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.family.transformer.state_dict().items()}


def _unchanged(engine, before) -> bool:
    after = engine.family.transformer.state_dict()
    return after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


def _refused(response, status, field):
    assert response.status_code == status, response.text
    assert response.json()["error"]["field"] == field, response.text
    assert "\n" not in response.json()["error"]["message"]


@pytest.fixture
def engine(tiny_family):
    return Engine(tiny_family, EngineConfig(max_outputs_per_request=64, max_output_steps=4096))


def test_weight_version_beyond_int64_is_refused_and_generation_keeps_working(engine):
    client = _client(engine)
    name, param = next(iter(engine.family.transformer.named_parameters()))
    body = save({name: param.detach().clone()})
    before = _sample(client)
    for header in ("100000000000000000000000", str(2**63), "-1", "1e3", "１２".encode(), b"\xff", " "):
        _refused(client.post("/update_weights", content=body, headers={**WEIGHTS, "x-weight-version": header}),
                 400, "x-weight-version")
    assert engine.weight_version == 0
    ok = client.post("/update_weights", content=body, headers={**WEIGHTS, "x-weight-version": str(INT64_MAX)})
    assert ok.status_code == 200 and engine.weight_version == INT64_MAX
    # An unversioned update would pass int64: refused rather than wrapped or overflowed.
    _refused(client.post("/update_weights", content=body, headers=WEIGHTS), 400, "x-weight-version")
    assert torch.equal(_sample(client), before)  # msgpack encodes the version: generation still answers


def test_weights_are_checked_in_the_models_dtype_all_or_nothing(engine):
    client = _client(engine)
    params = list(engine.family.transformer.named_parameters())
    (name, param), (other, other_param) = params[0], params[1]
    before, state = _sample(client), _state(engine)
    shape = tuple(param.shape)
    huge = torch.full(shape, 1e300, dtype=torch.float64)  # finite in float64, inf in the float32 model
    for tensors in ({name: huge}, {name: torch.ones(shape, dtype=torch.int8)}, {name: torch.ones(shape, dtype=torch.bool)},
                    {other: other_param.detach() + 1, name: huge}):  # the good tensor is not written either
        response = client.post("/update_weights", content=save(tensors), headers=WEIGHTS)
        _refused(response, 400, "weights")
        assert name in response.json()["error"]["message"]
    assert _unchanged(engine, state) and engine.weight_version == 0
    assert torch.equal(_sample(client), before)
    half = (param.detach() + 0.5).half()  # a float tensor the float32 weight represents exactly: cast
    assert client.post("/update_weights", content=save({name: half}), headers=WEIGHTS).status_code == 200
    assert torch.equal(param.detach(), half.float())


def test_lora_adapter_is_validated_before_anything_is_installed(engine):
    client = _client(engine)
    targets = sorted(engine.family.lora_target_modules)
    spec = {"rank": 2, "alpha": 4.0, "target_modules": targets}
    before, state = _sample(client), _state(engine)
    _refused(client.post("/lora_adapter", json={**spec, "target_modules": [*targets, "no_such_module"]}),
             400, "target_modules")
    _refused(client.post("/lora_adapter", json={**spec, "rank": 16384}), 400, "rank")
    infinite = client.post("/lora_adapter", content=b'{"rank": 2, "alpha": Infinity, "target_modules": ["to_q"]}',
                           headers={"content-type": "application/json"})
    _refused(infinite, 422, "alpha")
    assert _unchanged(engine, state) and torch.equal(_sample(client), before)
    ok = client.post("/lora_adapter", json=spec)  # the trainer's valid adapter still goes in
    assert ok.status_code == 200 and ok.json()["added"] is True
    assert torch.equal(_sample(client), before)  # B = 0: the output is unchanged


@pytest.mark.parametrize("path", ["/rollout/generate", "/v1/images/generations", "/lora_adapter"])
@pytest.mark.parametrize("body", [
    b'{"prompt": "a", "guidance_scale": NaN}', b'{"prompt": "a", "guidance_scale": Infinity}',
    b'{"prompt": "a", "seed": -Infinity}', b'{"prompt": "\xff\xfe bad utf-8"}', b'\xc3\x28',
    b'{"prompt": "\\ud800"}', b'{"prompt": "a", "\\udfff": 1}', b'{"prompt": "a", "negative_prompt": "\\udc80"}',
    b'{"prompt": "a", "rank": 1e400}', b'[NaN]', b'', b'{"prompt": "a", "extra_sampling_params": {"\\udc00": 1}}',
])
def test_unencodable_input_gets_a_4xx_not_a_500(engine, path, body):
    response = _client(engine).post(path, content=body, headers={"content-type": "application/json"})
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert error["field"] and "\n" not in error["message"]


def test_huge_guidance_or_noise_is_a_400_naming_the_field(engine):
    client = _client(engine)
    for field, extra in (("guidance_scale", {}), ("rollout_noise_level", {"rollout": True}),
                         ("guidance_scale_2", {})):
        response = client.post("/rollout/generate", json={**SAMPLE, **extra, field: 1e308})
        assert response.status_code in (400, 422) and response.json()["error"]["field"] == field, response.text
    assert _sample(client) is not None


def test_body_prompt_and_work_per_request_are_bounded(tiny_family):
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=64, max_prompt_chars=100, max_output_steps=4096))
    client = _client(engine)
    _refused(client.post("/rollout/generate", json={**SAMPLE, "prompt": "x" * (2 << 20)}), 413, "body")
    _refused(client.post("/rollout/generate", json={**SAMPLE, "prompt": "x" * 101}), 400, "prompt")
    _refused(client.post("/rollout/generate", json={**SAMPLE, "negative_prompt": "x" * 101}), 400, "negative_prompt")
    biggest = {**SAMPLE, "num_outputs_per_prompt": 64, "num_inference_steps": 1000, "guidance_scale": 4.0}
    _refused(client.post("/rollout/generate", json=biggest), 400, "num_inference_steps")
    defaults = ServeConfig()  # what `diffrl serve` runs with
    assert (defaults.max_body_bytes, defaults.max_prompt_chars, defaults.max_output_steps,
            defaults.request_timeout_s) == (1 << 20, 16384, 4096, 600.0)
    small = _client(engine, limits=ServeConfig(max_weights_bytes=1000).server_limits())
    _refused(small.post("/update_weights", content=b"x" * 1001, headers=WEIGHTS), 413, "body")


def _slow(family, monkeypatch, step_s=0.05) -> list[float]:
    """Make each denoising step take `step_s`; returns the list of step start times."""
    real, steps = family.velocity_and_uncond, []

    def velocity(*args, **kwargs):
        steps.append(time.monotonic())
        time.sleep(step_s)
        return real(*args, **kwargs)

    monkeypatch.setattr(family, "velocity_and_uncond", velocity)
    return steps


def test_a_request_whose_client_went_away_stops_within_one_step(tiny_family, monkeypatch):
    engine = Engine(tiny_family)
    steps = _slow(tiny_family, monkeypatch)
    with serving_in_thread(create_app(engine)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps({**SAMPLE, "num_inference_steps": 400}).encode()
        head = (f"POST /rollout/generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port))) as client:
            client.sendall(head + body)
            deadline = time.monotonic() + 60
            while len(steps) < 2 and time.monotonic() < deadline:  # denoising has begun
                time.sleep(0.01)
            assert len(steps) >= 2, "the request never started denoising"
        gone = time.monotonic()  # the client has closed its connection mid-request
        deadline = gone + 5
        while engine.in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.in_flight == 0
        time.sleep(0.2)
        after = [t for t in steps if t > gone]
        assert len(steps) < 40 and len(after) <= 3, (len(steps), len(after))  # not 400 steps
        ok = httpx.post(f"{url}/rollout/generate", json=SAMPLE, timeout=30)
        assert ok.status_code == 200


def test_requests_are_bounded_in_time(tiny_family, monkeypatch):
    engine = Engine(tiny_family, EngineConfig(request_timeout_s=0.5))
    steps = _slow(tiny_family, monkeypatch)
    client = _client(engine)
    start = time.monotonic()
    response = client.post("/rollout/generate", json={**SAMPLE, "num_inference_steps": 400})
    assert response.status_code == 503 and "request_timeout_s" in response.json()["error"]["message"]
    assert time.monotonic() - start < 3
    time.sleep(0.2)
    assert len(steps) < 40 and engine.in_flight == 0


def test_the_worker_pool_is_bounded_and_waiting_requests_hold_no_thread(tiny_family):
    engine = Engine(tiny_family, EngineConfig(worker_threads=2, max_batch_outputs=64))
    before = threading.active_count()
    peak = 0

    async def burst():
        async def one(i):
            nonlocal peak
            peak = max(peak, threading.active_count() - before)
            return await engine.agenerate(RolloutRequest(prompt="a circle", seed=i, num_inference_steps=1))
        return await asyncio.gather(*(one(i) for i in range(128)))

    outputs = asyncio.run(burst())
    peak = max(peak, threading.active_count() - before)
    assert len(outputs) == 128 and peak <= 2  # the old pool started a thread per waiting request
    assert engine.denoise_batches < 64  # still batched (4 on an idle machine): waiting requests join running ones


def test_too_many_requests_in_flight_get_429(tiny_family, monkeypatch):
    engine = Engine(tiny_family, EngineConfig(max_pending_requests=1))
    _slow(tiny_family, monkeypatch, step_s=0.1)
    with serving_in_thread(create_app(engine)) as url:
        first = threading.Thread(target=httpx.post, args=(f"{url}/rollout/generate",),
                                 kwargs=dict(json={**SAMPLE, "num_inference_steps": 10}, timeout=30))
        first.start()
        while engine.in_flight == 0:
            time.sleep(0.01)
        busy = httpx.post(f"{url}/rollout/generate", json=SAMPLE, timeout=30)
        first.join()
    assert busy.status_code == 429 and busy.json()["error"]["field"] == "request"


def test_state_changing_endpoints_refuse_web_pages_and_foreign_hosts(engine):
    name, param = next(iter(engine.family.transformer.named_parameters()))
    body = save({name: param.detach() + 1})
    spec = {"rank": 2, "alpha": 4.0, "target_modules": ["to_q"]}
    state = _state(engine)
    client = _client(engine)
    # What a page on the same machine can send without a preflight: text/plain, with its Origin.
    _refused(client.post("/update_weights", content=body, headers={"content-type": "text/plain"}), 415, "content-type")
    _refused(client.post("/lora_adapter", content=str(spec).encode(), headers={"content-type": "text/plain"}),
             415, "content-type")
    _refused(client.post("/update_weights", content=body, headers={**WEIGHTS, "origin": "http://evil.example"}),
             403, "origin")
    rebound = TestClient(create_app(engine), base_url="http://evil.example:30000")  # DNS rebinding: a foreign Host
    _refused(rebound.post("/update_weights", content=body, headers=WEIGHTS), 403, "host")
    _refused(rebound.post("/lora_adapter", json=spec), 403, "host")
    assert _unchanged(engine, state) and engine.weight_version == 0
    assert rebound.post("/rollout/generate", json=SAMPLE).status_code == 200  # reading is not state-changing
    named = TestClient(create_app(engine, limits=ServeConfig(allowed_hosts=("engine.lan",)).server_limits()),
                       base_url="http://engine.lan:30000")
    assert named.post("/update_weights", content=body, headers=WEIGHTS).status_code == 200
    for host in ("localhost:30000", "[::1]:30000"):
        loopback = TestClient(create_app(engine), base_url=f"http://{host}")
        assert loopback.post("/update_weights", content=body, headers=WEIGHTS).status_code == 200


@pytest.mark.parametrize(("path", "field", "value"), [
    ("/rollout/generate", "num_outputs_per_prompt", True), ("/rollout/generate", "num_outputs_per_prompt", False),
    ("/rollout/generate", "seed", True), ("/rollout/generate", "num_inference_steps", True),
    ("/rollout/generate", "width", True), ("/rollout/generate", "guidance_scale", True),
    ("/rollout/generate", "rollout_noise_level", False), ("/rollout/generate", "rollout_sde_step_indices", [True]),
    ("/rollout/generate", "num_outputs_per_prompt", "2"), ("/rollout/generate", "guidance_scale", "4.5"),
    ("/v1/images/generations", "n", True), ("/v1/images/generations", "seed", False),
])
def test_a_boolean_or_a_string_in_a_number_field_is_a_422_naming_the_field(engine, path, field, value):
    """Pydantic's lax mode would read true as 1 and "2" as 2; the request is refused instead."""
    client = _client(engine)
    response = client.post(path, json={**SAMPLE, field: value})
    _refused(response, 422, field)
    assert "must be a number, not a " in response.json()["error"]["message"]
    assert engine.in_flight == 0


@pytest.mark.parametrize(("field", "value"), [("rank", True), ("rank", False), ("rank", "2"), ("alpha", True),
                                             ("alpha", "4.0")])
def test_a_boolean_or_a_string_in_a_lora_number_is_a_422_naming_the_field(engine, field, value):
    """`POST /lora_adapter` read `"rank": true` as an adapter of rank 1 (pydantic's lax mode); it is refused, and no
    adapter goes in."""
    client = _client(engine)
    spec = {"rank": 2, "alpha": 4.0, "target_modules": sorted(engine.family.lora_target_modules)}
    state = _state(engine)
    response = client.post("/lora_adapter", json={**spec, field: value})
    _refused(response, 422, field)
    assert "must be a number, not a " in response.json()["error"]["message"]
    assert _unchanged(engine, state)
    assert not [n for n, _ in engine.family.transformer.named_parameters() if "lora_" in n]


def test_a_boolean_in_extra_sampling_params_number_is_refused_naming_it(engine):
    response = _client(engine).post("/rollout/generate", json={**SAMPLE, "extra_sampling_params": {"seed": True}})
    _refused(response, 422, "seed")


def test_integral_floats_are_integers_and_fractional_ones_are_refused(engine):
    client = _client(engine)
    exact = client.post("/rollout/generate", json={**SAMPLE, "num_outputs_per_prompt": 2.0, "seed": 7.0,
                                                   "rollout": True, "rollout_sde_step_indices": [0.0, 1]})
    assert exact.status_code == 200, exact.text
    assert len(exact.json()) == 2 and exact.json()[0]["seed"] == 7
    _refused(client.post("/rollout/generate", json={**SAMPLE, "num_outputs_per_prompt": 2.5}), 422,
             "num_outputs_per_prompt")
    # Floats as floats and integers where a float belongs are numbers as ever; booleans stay booleans.
    fine = client.post("/rollout/generate", json={**SAMPLE, "guidance_scale": 4, "rollout": True,
                                                  "rollout_noise_level": 1, "rollout_return_dit_trajectory": False})
    assert fine.status_code == 200, fine.text


def test_minor_refusals_and_docs_off_by_default(engine):
    client = _client(engine)
    _refused(client.post("/rollout/generate", json={**SAMPLE, "width": 0}), 422, "width")
    _refused(client.post("/rollout/generate", json={**SAMPLE, "height": 0}), 422, "height")
    _refused(client.post("/v1/images/generations", json={"prompt": "a", "size": "１２８x１２８"}), 400, "size")
    _refused(client.post("/v1/images/generations", json={"prompt": "a", "size": "0x0"}), 422, "width")
    _refused(client.post("/rollout/generate", json={**SAMPLE, "rollout": False, "rollout_sde_step_indices": [99]}),
             400, "rollout_sde_step_indices")
    assert client.get("/docs").status_code == 404 and client.get("/openapi.json").status_code == 404
    documented = _client(engine, docs=True)
    assert documented.get("/docs").status_code == 200 and documented.get("/openapi.json").status_code == 200


def test_pixels_per_output_and_per_request_are_bounded(tiny_family):
    """Width and height have no bound of their own: 65536 × 65536 (allowed by a multiple-of-16 family) reached the
    model. The server bounds width × height and num_outputs_per_prompt × num_frames × width × height, defaults too."""
    defaults = ServeConfig()
    assert (defaults.max_pixels, defaults.max_request_pixels) == (4096 * 4096, 1 << 30)
    client = _client(Engine(tiny_family, defaults.engine_config()))
    before = _sample(client)
    _refused(client.post("/rollout/generate", json={**SAMPLE, "width": 65536, "height": 65536}), 400, "width")
    size = tiny_family.config.image_size
    engine = Engine(tiny_family, EngineConfig(max_pixels=size * size, max_request_pixels=4 * size * size))
    client = _client(engine)
    _refused(client.post("/rollout/generate", json={**SAMPLE, "width": size, "height": size + 1}), 400, "width")
    _refused(client.post("/rollout/generate", json={**SAMPLE, "num_outputs_per_prompt": 5}), 400,
             "num_outputs_per_prompt")
    ok = client.post("/rollout/generate", json={**SAMPLE, "num_outputs_per_prompt": 4}, headers=COMPACT)
    assert ok.status_code == 200 and len(decode_outputs(ok.content)) == 4
    assert torch.equal(_sample(client), before) and engine.in_flight == 0
