"""The engine behind HTTP: same tensors as in-process, 4xx naming the field, server stays up."""

import asyncio
import base64
import io
import socket

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.serving.wire import WireFormatError, decode_outputs, encode_outputs
from diffrl.errors import RequestError
from diffrl.rollout import HttpEngineClient, InProcessEngineClient, RolloutManager, RolloutSettings
from diffrl.rollout.clients import EngineUnavailable

ROLLOUT = dict(num_inference_steps=3, guidance_scale=3.0, rollout=True, rollout_sde_step_indices=[0, 1],
               rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)


@pytest.fixture
def served(tiny_family):
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    with serving_in_thread(create_app(engine)) as url:
        yield engine, url


def _assert_same_outputs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.seed == y.seed and x.weight_version == y.weight_version
        assert torch.equal(x.generated_output, y.generated_output)
        assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        for name in ("latents", "timesteps", "sigmas", "latent_step_indices"):
            assert torch.equal(getattr(x.dit_trajectory, name), getattr(y.dit_trajectory, name))
        assert (x.denoising_env is None) == (y.denoising_env is None)
        if x.denoising_env is not None:
            assert x.denoising_env.keys() == y.denoising_env.keys()
            assert all(torch.equal(x.denoising_env[k], y.denoising_env[k]) for k in x.denoising_env)


def test_http_path_returns_the_same_tensors_as_in_process(served):
    engine, url = served
    request = RolloutRequest(prompt="a red circle and a blue square", seed=5, num_outputs_per_prompt=3, **ROLLOUT)

    async def both():
        http = HttpEngineClient(url)
        try:
            return await http.generate(request), await InProcessEngineClient(engine).generate(request)
        finally:
            http.close()

    over_http, in_process = asyncio.run(both())
    _assert_same_outputs(over_http, in_process)


def test_manager_mixes_http_and_in_process_engines(served):
    engine, url = served
    settings = RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=1)

    async def run(clients):
        return await RolloutManager(clients, settings, engine_concurrency=1).rollout(["two circles"], ROLLOUT)

    mixed = asyncio.run(run([HttpEngineClient(url), InProcessEngineClient(engine)]))[0]
    local = asyncio.run(run([InProcessEngineClient(engine)]))[0]
    assert {s.engine for s in mixed} == {url, "local"}
    for a, b in zip(mixed, local, strict=True):
        assert torch.equal(a.output.generated_output, b.output.generated_output)


@pytest.mark.parametrize("body,status,field", [
    (dict(prompt="a red circle", num_outputs_per_prompt=0), 400, "num_outputs_per_prompt"),
    (dict(prompt="a red circle", num_outputs_per_prompt=9), 400, "num_outputs_per_prompt"),
    (dict(prompt="a red circle", width=4096, height=4096), 400, "height"),
    (dict(prompt="a red circle", rollout=True, rollout_sde_type="langevin"), 422, "rollout_sde_type"),
    (dict(prompt="a red circle", image="data:image/png;base64,AAAA"), 400, "image"),
    (dict(prompt="a red circle", rollout=True, rollout_sde_step_indices=[99]), 400, "rollout_sde_step_indices"),
    (dict(prompt="a red circle", surprise=True), 422, "surprise"),
    (dict(negative_prompt="no prompt"), 422, "prompt"),
])
def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_stays_up(served, body, status, field):
    _, url = served
    response = httpx.post(f"{url}/rollout/generate", json=body, timeout=30)
    assert response.status_code == status
    assert field in response.text
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok" and health["in_flight"] == 0
    ok = httpx.post(f"{url}/rollout/generate", json=dict(prompt="a red circle", num_inference_steps=1), timeout=30)
    assert ok.status_code == 200 and ok.headers["content-type"] == "application/json"  # sglang's format by default


def test_http_client_raises_request_error_with_the_field(served):
    _, url = served

    async def call():
        client = HttpEngineClient(url)
        try:
            await client.generate(RolloutRequest(prompt="x", num_outputs_per_prompt=9))
        finally:
            client.close()

    with pytest.raises(RequestError) as err:
        asyncio.run(call())
    assert err.value.field == "num_outputs_per_prompt"


def test_http_client_reports_an_unreachable_engine_as_unavailable():
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = HttpEngineClient(f"http://127.0.0.1:{port}")
    try:
        with pytest.raises(EngineUnavailable, match="ConnectionRefused"):
            asyncio.run(client.generate(RolloutRequest(prompt="a red circle")))
    finally:
        client.close()
    with pytest.raises(ValueError, match="http://host:port"):
        HttpEngineClient("127.0.0.1:30000")


def test_openai_style_images_endpoint(served):
    _, url = served
    response = httpx.post(f"{url}/v1/images/generations", timeout=30,
                          json=dict(prompt="a red circle", n=2, size="64x64", num_inference_steps=2, seed=3))
    assert response.status_code == 200
    data = response.json()["data"]
    images = [np.asarray(Image.open(io.BytesIO(base64.b64decode(d["b64_json"])))) for d in data]
    assert len(images) == 2 and images[0].shape == (64, 64, 3) and not np.array_equal(images[0], images[1])
    bad = httpx.post(f"{url}/v1/images/generations", json=dict(prompt="x", size="big"), timeout=30)
    assert bad.status_code == 400 and "size" in bad.text


def test_wire_codec_refuses_malformed_payloads(tiny_family):
    outputs = Engine(tiny_family).generate(RolloutRequest(prompt="a circle", num_inference_steps=1, **{
        k: v for k, v in ROLLOUT.items() if k != "num_inference_steps" and k != "rollout_sde_step_indices"}))
    payload = encode_outputs(outputs)
    _assert_same_outputs(decode_outputs(payload), outputs)
    with pytest.raises(WireFormatError):
        decode_outputs(b"\xc1 not msgpack")
    with pytest.raises(WireFormatError):
        decode_outputs(payload[: len(payload) // 2])
    import msgpack
    with pytest.raises(WireFormatError, match="does not match"):
        bad = msgpack.unpackb(payload, raw=False)
        bad[0]["generated_output"]["shape"] = [1, 2, 3]
        decode_outputs(msgpack.packb(bad, use_bin_type=True))


def test_http_client_survives_one_event_loop_per_rollout(served):
    _, url = served
    manager = RolloutManager([HttpEngineClient(url)], RolloutSettings(n_samples_per_prompt=2, rollout_microgroup_size=1))
    for _ in range(2):  # a training loop calls asyncio.run once per rollout
        groups = asyncio.run(manager.rollout(["a circle"], dict(num_inference_steps=1)))
        assert len(groups[0]) == 2


def test_http_client_outlives_the_servers_idle_timeout(tiny_family):
    """A trainer talks to its engine once per rollout, far apart; the server closes an idle kept-alive
    connection meanwhile (uvicorn: after 5 s). The next weight push (with a large body: a broken pipe while
    writing it) and the next rollout request (a closed socket for an answer) go out again on a new connection."""
    import time

    from diffrl.serving.server import ServerLimits

    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    weights = {k: v.clone() for k, v in engine.family.transformer.state_dict().items()}
    padded = weights | {"pad": torch.zeros(4 << 20)}  # 16 MB: more than the socket buffers take unread
    request = RolloutRequest(prompt="a circle", seed=3, num_outputs_per_prompt=1, num_inference_steps=1)
    app = create_app(engine, limits=ServerLimits(max_weights_bytes=64 << 20))
    with serving_in_thread(app, keep_alive_s=0.2) as url:
        client = HttpEngineClient(url)
        try:
            client.push_weights(weights, 1)
            time.sleep(0.6)
            client.push_weights(weights, 2)
            time.sleep(0.6)
            with pytest.raises(EngineUnavailable, match="refused: HTTP 400"):  # the server's answer ("pad" is
                client.push_weights(padded, 3)                                 # no parameter), not a broken pipe
            assert engine.weight_version == 2
            first = asyncio.run(client.generate(request))
            time.sleep(0.6)
            assert torch.equal(asyncio.run(client.generate(request))[0].generated_output, first[0].generated_output)
        finally:
            client.close()


def test_compact_requests_after_the_first_answer_on_one_kept_alive_connection(served):
    """The client's requests follow each other on its one connection (a streamed response is closed once read), the
    second and later ones as msgpack bodies (negotiated by the first answer), with the in-process tensors."""
    engine, url = served
    request = RolloutRequest(prompt="a red circle", seed=2, num_outputs_per_prompt=2, **ROLLOUT)
    want = engine.generate(request)

    async def three():
        http = HttpEngineClient(url, max_in_flight=1)
        try:
            return [await http.generate(request) for _ in range(3)], http._sends_compact
        finally:
            http.close()

    answers, compact = asyncio.run(three())
    assert compact
    for outputs in answers:
        _assert_same_outputs(outputs, want)


def test_malformed_compact_requests_are_refused_naming_the_body(served):
    import msgpack

    _, url = served
    for body in (b"\xc1", msgpack.packb(["a red circle"]), msgpack.packb({"prompt": msgpack.ExtType(3, b"x")}),
                 msgpack.packb({"prompt": "x"}) + b"\x00"):
        answer = httpx.post(f"{url}/rollout/generate", content=body, headers={"content-type": "application/msgpack"})
        assert answer.status_code == 422 and answer.json()["error"]["field"] == "body", answer.text
        assert "nor a msgpack map" in answer.json()["error"]["message"]


def _post_weights(url, tensors, token=None, version=None):
    from safetensors.torch import save

    headers = {"content-type": "application/octet-stream"}  # the only body type /update_weights takes
    if token:
        headers["authorization"] = f"Bearer {token}"
    if version is not None:
        headers["x-weight-version"] = str(version)
    return httpx.post(f"{url}/update_weights", content=save(tensors), headers=headers, timeout=30)


def test_weight_updates_are_checked_before_anything_changes(served):
    engine, url = served
    name, param = next(iter(engine.family.transformer.named_parameters()))
    before = param.detach().clone()
    bad_shape = _post_weights(url, {name: torch.zeros(3)})
    unknown = _post_weights(url, {"no.such.weight": torch.zeros(1)})
    garbage = httpx.post(f"{url}/update_weights", content=b"not safetensors", timeout=30,
                         headers={"content-type": "application/octet-stream"})
    assert (bad_shape.status_code, unknown.status_code, garbage.status_code) == (400, 400, 400)
    assert "shape" in bad_shape.text and "no.such.weight" in unknown.text
    assert torch.equal(param, before) and engine.weight_version == 0
    ok = _post_weights(url, {name: before + 1}, version=5)
    assert ok.status_code == 200 and ok.json()["weight_version"] == 5
    assert torch.equal(param, before + 1) and engine.weight_version == 5


def test_weight_update_tokens(tiny_family):
    from fastapi.testclient import TestClient
    from safetensors.torch import save

    name, param = next(iter(tiny_family.transformer.named_parameters()))
    body = save({name: param.detach().clone()})
    kind = {"content-type": "application/octet-stream"}
    guarded = TestClient(create_app(Engine(tiny_family), update_token="s3cret"), base_url="http://127.0.0.1")
    assert guarded.post("/update_weights", content=body, headers=kind).status_code == 401
    assert guarded.post("/update_weights", content=body, headers={**kind, "authorization": "Bearer nope"}).status_code == 401
    assert guarded.post("/update_weights", content=body, headers={**kind, "authorization": "Bearer s3cret"}).status_code == 200
    exposed = TestClient(create_app(Engine(tiny_family), exposed=True))  # no token, beyond loopback
    assert exposed.post("/update_weights", content=body, headers=kind).status_code == 403


def test_trainer_rolls_out_on_a_remote_engine_and_pushes_its_weights(served, tiny_model_dir, tmp_path):
    from test_trainer import tiny_config

    from diffrl.train.trainer import Trainer

    engine, url = served
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", engine_urls=(url,), local_engine=False))
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0  # the remote engine sampled with the same weights
    with trainer.policy.engine_weights(None):  # what happens before every rollout
        pass
    assert engine.weight_version == trainer.policy.weight_version == 2
    remote = engine.family.transformer.state_dict()
    for name, p in trainer.policy.family.transformer.named_parameters():
        assert torch.equal(remote[name], p.detach()), name


def test_engine_hosts_the_trainers_lora_adapter(tiny_family):
    """`POST /lora_adapter` adds the adapter unmerged (same spec: no-op; another: 400), token-guarded."""
    from fastapi.testclient import TestClient

    from diffrl.models.lora import LoraSpec

    engine = Engine(tiny_family)
    client = TestClient(create_app(engine, update_token="s3cret"), base_url="http://127.0.0.1")
    spec = LoraSpec(rank=2, alpha=4.0, target_modules=sorted(tiny_family.lora_target_modules)).model_dump()
    auth = {"authorization": "Bearer s3cret"}
    assert client.post("/lora_adapter", json=spec).status_code == 401
    request = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 2}
    compact = {"accept": "application/msgpack"}
    before = client.post("/rollout/generate", json=request, headers=compact).content
    first = client.post("/lora_adapter", json=spec, headers=auth)
    assert first.status_code == 200 and first.json()["added"] is True
    assert client.post("/lora_adapter", json=spec, headers=auth).json()["added"] is False
    other = client.post("/lora_adapter", json={**spec, "rank": 4}, headers=auth)
    assert other.status_code == 400 and other.json()["error"]["field"] == "lora"
    bad = client.post("/lora_adapter", json={**spec, "rank": 0}, headers=auth)
    assert bad.status_code == 422 and "rank" in bad.text
    after = client.post("/rollout/generate", json=request, headers=compact).content
    assert torch.equal(decode_outputs(after)[0].generated_output, decode_outputs(before)[0].generated_output)  # B = 0
    lora_names = [n for n, _ in engine.family.transformer.named_parameters() if "lora_B" in n]
    assert lora_names


def test_trainer_pushes_only_lora_tensors_to_a_remote_engine(served, tiny_model_dir, tmp_path):
    from test_trainer import tiny_config

    from diffrl.train.trainer import Trainer

    engine, url = served
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "run", engine_urls=(url,), local_engine=False,
                                  use_lora=True, lora_rank=2))
    record = trainer.rollout_and_update(0)
    assert record["train/log_prob_mean_abs_diff"] == 0.0  # the remote engine sampled with the same weights
    with trainer.policy.engine_weights(None):  # pushes the updated adapter
        pass
    remote = engine.family.transformer.state_dict()
    trained = dict(trainer.policy.family.transformer.named_parameters())
    assert trainer.policy.trainable_names and all("lora_" in n for n in trainer.policy.trainable_names)
    for name in trainer.policy.trainable_names:
        assert torch.equal(remote[name], trained[name].detach()), name
    assert any(not torch.all(remote[n] == 0) for n in trainer.policy.trainable_names if "lora_B" in n)  # it trained


def test_http_client_weight_push_needs_the_token_and_names_failures(tiny_family):
    """The client's weight push goes over the same kept-alive connections as its rollouts: a missing
    token is refused (nothing changes), the right one applies, an unreachable engine is named."""
    engine = Engine(tiny_family)
    tensors = {name: p.detach() + 1 for name, p in tiny_family.transformer.named_parameters()}
    with serving_in_thread(create_app(engine, update_token="s3cret")) as url:
        client = HttpEngineClient(url)
        try:
            with pytest.raises(EngineUnavailable, match="weight push refused: HTTP 401"):
                client.push_weights(tensors, version=5)
            assert engine.weight_version == 0
            client.push_weights(tensors, version=5, token="s3cret")
            assert engine.weight_version == 5
            outputs = asyncio.run(client.generate(RolloutRequest(prompt="a red circle", seed=1, num_inference_steps=2)))
            assert outputs[0].weight_version == 5  # the same client rolls out on the pushed weights
        finally:
            client.close()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    with pytest.raises(EngineUnavailable, match="weight push failed: ConnectionRefused"):
        HttpEngineClient(f"http://127.0.0.1:{closed_port}").push_weights(tensors, version=6)
