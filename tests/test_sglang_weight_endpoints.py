"""sglang-diffusion's weight-sync and memory endpoints on `diffrl serve`, called as miles-diffusion's trainer calls
them on its engines.

miles-diffusion (radixark/miles_diffusion, `miles/backends/sglang_diffusion_utils/sglang_diffusion_engine.py`)
posts JSON with `requests.post(url, json=payload or {})`: `/update_weights_from_tensor` with
`{"serialized_named_tensors": [base64 pickle], "load_format": "flattened_bucket", "target_modules":
["transformer"], "weight_version": "N"}` (`miles/backends/fsdp_utils/diffusion_update_weight_utils.py`),
`/get_weights_checksum` with `{"module_names": ["transformer"]}` (or `{}`), and `/release_memory_occupation`
and `/resume_memory_occupation` with `{}`. The answers follow sglang-diffusion as miles pins it (Rockdu/sglang
0372158dd, `entrypoints/post_training/weights_api.py`, `loader/weight_utils.py:compute_weights_checksum`,
`post_training/tensor_update_checker.py`). The bodies and algorithms are re-written here from those facts.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle

import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import save

from diffrl.engine.engine import Engine
from diffrl.serving.server import ServerLimits, create_app
from diffrl.models.random_checkpoints import demo as random_demo

BASE_URL = "http://127.0.0.1:30000"  # what requests sends as Host for a loopback engine
SAMPLE = {"prompt": "a red circle", "negative_prompt": " ", "seed": 11, "num_outputs_per_prompt": 2, "width": 64,
          "height": 64, "num_inference_steps": 3, "guidance_scale": 3.0, "rollout": True, "rollout_sde_type": "sde",
          "rollout_noise_level": 0.7, "rollout_log_prob_no_const": False, "rollout_debug_mode": False,
          "rollout_return_denoising_env": True, "rollout_return_dit_trajectory": True, "generator_device": "cuda"}


def client_for(engine: Engine, **kwargs) -> TestClient:
    return TestClient(create_app(engine, **kwargs), base_url=BASE_URL)


def miles_post(client: TestClient, endpoint: str, payload: dict | None = None, **headers):
    """`SGLangDiffusionEngine._make_request`: a JSON POST of the payload, `{}` when there is none."""
    return client.post(f"/{endpoint}", json=payload or {}, headers=headers)


def sample_bits(client: TestClient) -> list[tuple[str, str]]:
    """A fixed-seed rollout's outputs and log-probs as the bytes on the wire (base64 safetensors)."""
    response = client.post("/rollout/generate", json=SAMPLE)
    assert response.status_code == 200, response.text
    return [(r["generated_output"]["data"], r["rollout_log_probs"]["data"]) for r in response.json()]


def sglang_checksum(named) -> str:
    """sglang-diffusion's `compute_weights_checksum`, as miles re-computes it on the trainer's side."""
    hasher = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        hasher.update(name.encode())
        hasher.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def sglang_tensor_sha256(tensor: torch.Tensor) -> str:
    """sglang-diffusion's per-tensor manifest entry (`compute_tensor_sha256`)."""
    tensor = tensor.detach().cpu().contiguous()
    hasher = hashlib.sha256()
    hasher.update(str(tensor.dtype).encode())
    hasher.update(repr(tuple(tensor.shape)).encode())
    hasher.update(tensor.view(torch.uint8).numpy().tobytes())
    return hasher.hexdigest()


class _LeavesAMark:
    """A pickle that, if anything unpickled it, would create a file: the server must never run it."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def miles_tensor_payload(tensor_name: str, tensor: torch.Tensor, mark: str | None) -> dict:
    """The body of miles' `update_bucket_weights` (flattened bucket under the target module, pickled and
    base64-encoded as `MultiprocessingSerializer.serialize(..., output_str=True)` does)."""
    bucket = {"transformer": {"flattened_tensor": tensor.reshape(-1),
                              "metadata": [{"name": tensor_name, "shape": list(tensor.shape), "dtype": str(tensor.dtype),
                                            "start_idx": 0, "end_idx": tensor.numel(), "numel": tensor.numel()}]}}
    if mark is not None:  # a pickle that would leave the mark if anything ran it
        bucket["transformer"]["trap"] = _LeavesAMark(mark)
    serialized = base64.b64encode(pickle.dumps(bucket)).decode()
    return {"serialized_named_tensors": [serialized], "load_format": "flattened_bucket",
            "target_modules": ["transformer"], "weight_version": "1"}


def test_a_pickled_tensor_update_is_off_by_default_and_changes_nothing(tiny_family, tmp_path):
    engine = Engine(tiny_family)
    client = client_for(engine)
    before = sample_bits(client)
    checksum = miles_post(client, "get_weights_checksum", {"module_names": ["transformer"]}).json()
    name, param = next(iter(tiny_family.transformer.named_parameters()))
    mark = str(tmp_path / "unpickled")

    response = miles_post(client, "update_weights_from_tensor", miles_tensor_payload(name, param + 1, mark))

    assert response.status_code == 404  # tests/test_update_weights_from_tensor.py: with the flag
    assert "--update-weights-from-tensor" in response.json()["error"]["message"]
    assert not os.path.exists(mark)  # nothing was unpickled
    assert engine.weight_version == 0 and sample_bits(client) == before
    assert miles_post(client, "get_weights_checksum", {"module_names": ["transformer"]}).json() == checksum


def test_weights_checksum_is_sglangs_and_follows_a_weight_push(tiny_family):
    engine = Engine(tiny_family)
    client = client_for(engine)
    transformer = tiny_family.transformer
    expected = sglang_checksum(transformer.named_parameters())

    asked = miles_post(client, "get_weights_checksum", {"module_names": ["transformer", "vae"]})
    everything = miles_post(client, "get_weights_checksum")  # miles sends {} when it names no module

    assert asked.status_code == 200 and asked.json() == {"transformer": expected, "vae": "not_found"}
    assert everything.json()["transformer"] == expected
    assert everything.json()["text_encoder"] == sglang_checksum(tiny_family.text_encoder.named_parameters())
    # miles' weight-sync check: the trainer's tensors, hashed on its side, against the engine's answer
    pushed = {name: t.detach() * 0.5 for name, t in transformer.state_dict().items()}
    update = client.post("/update_weights", content=save(pushed), headers={"content-type": "application/octet-stream"})
    assert update.status_code == 200
    after = miles_post(client, "get_weights_checksum", {"module_names": ["transformer"]}).json()["transformer"]
    assert after != expected and after == sglang_checksum(list(pushed.items()))
    bad = miles_post(client, "get_weights_checksum", {"module_names": "transformer"})
    assert bad.status_code == 422 and bad.json()["error"]["field"] == "module_names"


def test_release_then_resume_gives_the_same_bits(tiny_family):
    engine = Engine(tiny_family)
    client = client_for(engine)
    params = {name: p.detach().clone() for name, p in tiny_family.transformer.named_parameters()}
    before = sample_bits(client)

    released = miles_post(client, "release_memory_occupation")
    assert released.status_code == 200, released.text
    assert released.json()["success"] is True and released.json()["sleeping"] is True
    assert released.json()["moved_bytes"] > 0 and engine.asleep == 2
    assert miles_post(client, "release_memory_occupation").json()["moved_bytes"] == 0  # already asleep: a no-op
    asleep = client.post("/rollout/generate", json=SAMPLE)
    assert asleep.status_code == 503 and "asleep" in asleep.json()["error"]["message"]
    push = client.post("/update_weights", content=save({n: p + 1 for n, p in params.items()}),
                       headers={"content-type": "application/octet-stream"})
    assert push.status_code == 503 and engine.weight_version == 0

    resumed = miles_post(client, "resume_memory_occupation")
    assert resumed.status_code == 200 and resumed.json()["success"] is True and resumed.json()["sleeping"] is False
    assert resumed.json()["moved_bytes"] == released.json()["moved_bytes"] and engine.asleep == 0
    assert miles_post(client, "resume_memory_occupation").json()["message"] == "already awake"
    assert all(torch.equal(p, params[name]) for name, p in tiny_family.transformer.named_parameters())
    assert sample_bits(client) == before


def test_release_levels_and_bad_bodies(tiny_family):
    engine = Engine(tiny_family)
    client = client_for(engine)
    light = miles_post(client, "release_memory_occupation", {"level": 1, "tags": ["kv_cache"]})
    assert light.status_code == 200 and light.json()["level"] == 1 and light.json()["moved_bytes"] == 0
    bad_level = miles_post(client, "release_memory_occupation", {"level": 3})
    unknown = miles_post(client, "resume_memory_occupation", {"tag": ["weights"]})
    for response, field in ((bad_level, "level"), (unknown, "tag")):
        assert response.status_code == 422 and response.json()["error"]["field"] == field
        assert response.json()["success"] is False
    assert engine.asleep == 1  # the refused calls changed nothing
    assert miles_post(client, "resume_memory_occupation", {"tags": ["weights"]}).status_code == 200
    assert engine.asleep == 0


def test_update_weights_from_disk_reads_only_allowed_roots(tiny_family, tmp_path):
    root = tmp_path / "checkpoints"
    other = random_demo.random_family(random_demo.tiny(), seed=1)
    other.save(root / "step-1")
    other.save(tmp_path / "outside")
    (root / "escape").mkdir()
    os.symlink(tmp_path / "outside" / "transformer", root / "escape" / "transformer")
    engine = Engine(tiny_family)
    client = client_for(engine, limits=ServerLimits(weights_roots=(root,)))
    before = sample_bits(client)
    checksum = miles_post(client, "get_weights_checksum", {"module_names": ["transformer"]}).json()["transformer"]

    refusals = {
        "outside the roots": {"model_path": str(tmp_path / "outside")},
        "dot-dot": {"model_path": str(root / ".." / "outside")},
        "a link out": {"model_path": str(root / "escape")},
        "relative": {"model_path": "checkpoints/step-1"},
        "no such dir": {"model_path": str(root / "missing")},
    }
    for what, body in refusals.items():
        response = miles_post(client, "update_weights_from_disk", body)
        assert response.status_code == 400, what
        assert response.json()["success"] is False and response.json()["error"]["field"] == "model_path", what
    wrong_module = miles_post(client, "update_weights_from_disk",
                              {"model_path": str(root / "step-1"), "target_modules": ["text_encoder"]})
    assert wrong_module.status_code == 400 and wrong_module.json()["error"]["field"] == "target_modules"
    assert engine.weight_version == 0 and sample_bits(client) == before

    loaded = miles_post(client, "update_weights_from_disk",  # sglang's body: model_path, flush_cache, target_modules
                        {"model_path": str(root / "step-1"), "flush_cache": True, "target_modules": ["transformer"]})
    assert loaded.status_code == 200, loaded.text
    assert loaded.json()["success"] is True and loaded.json()["weight_version"] == 1
    after = miles_post(client, "get_weights_checksum", {"module_names": ["transformer"]}).json()["transformer"]
    assert after != checksum and after == sglang_checksum(other.transformer.named_parameters())
    assert sample_bits(client) != before

    closed = client_for(Engine(random_demo.random_family(random_demo.tiny(), seed=0)))  # no --weights-roots
    response = miles_post(closed, "update_weights_from_disk", {"model_path": str(root / "step-1")})
    assert response.status_code == 400 and "--weights-roots" in response.json()["message"]


def test_a_corrupt_checkpoint_changes_nothing(tiny_family, tmp_path):
    root = tmp_path / "checkpoints"
    random_demo.random_family(random_demo.tiny(), seed=1).save(root / "step-1")
    (root / "step-1" / "transformer" / "extra.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    engine = Engine(tiny_family)
    client = client_for(engine, limits=ServerLimits(weights_roots=(root,)))
    before = sample_bits(client)
    response = miles_post(client, "update_weights_from_disk", {"model_path": str(root / "step-1")})
    assert response.status_code == 400 and response.json()["error"]["field"] == "model_path"
    assert "extra.safetensors" in response.json()["message"]
    assert engine.weight_version == 0 and sample_bits(client) == before


def test_tensor_checker_compares_sglangs_manifest(tiny_family):
    client = client_for(Engine(tiny_family))
    named = dict(tiny_family.transformer.named_parameters())
    manifest = {name: sglang_tensor_sha256(t) for name, t in list(named.items())[:4]}
    ok = client.post("/update_weights_from_tensor_checker",
                     json={"target_module": "transformer", "expected_named_tensors_sha256": [manifest]})
    assert ok.status_code == 200 and ok.json()["success"] is True
    first = next(iter(manifest))
    wrong = client.post("/update_weights_from_tensor_checker",
                        json={"target_module": "transformer",
                              "expected_named_tensors_sha256": [{**manifest, first: "0" * 64, "no.such": "0" * 64}]})
    assert wrong.status_code == 400 and wrong.json()["success"] is False
    assert first in wrong.json()["message"] and "no.such" in wrong.json()["message"]


@pytest.mark.parametrize("endpoint", ["update_weights_from_tensor", "update_weights_from_disk",
                                      "release_memory_occupation", "resume_memory_occupation"])
def test_state_changing_endpoints_are_guarded(tiny_family, endpoint):
    engine = Engine(tiny_family)
    guarded = client_for(engine, update_token="s3cret", limits=ServerLimits(tensor_updates=True))
    assert miles_post(guarded, endpoint).status_code == 401
    assert miles_post(guarded, endpoint, authorization="Bearer nope").status_code == 401
    as_text = guarded.post(f"/{endpoint}", content=b"{}", headers={"authorization": "Bearer s3cret",
                                                                   "content-type": "text/plain"})
    assert as_text.status_code == 415 and as_text.json()["error"]["field"] == "content-type"
    from_page = miles_post(guarded, endpoint, authorization="Bearer s3cret", origin="http://evil.example")
    assert from_page.status_code == 403 and from_page.json()["error"]["field"] == "origin"
    exposed = TestClient(create_app(engine, exposed=True, limits=ServerLimits(tensor_updates=True)))  # no token
    assert miles_post(exposed, endpoint).status_code == 403
    assert engine.asleep == 0 and engine.weight_version == 0
    # Reading a checksum changes nothing: no token needed.
    assert miles_post(guarded, "get_weights_checksum").status_code == 200


def test_release_is_refused_while_requests_are_in_flight(tiny_family):
    engine = Engine(tiny_family)
    client = client_for(engine)
    engine._in_flight = 1  # a request between its arrival and its answer
    busy = miles_post(client, "release_memory_occupation")
    assert busy.status_code == 409 and busy.json()["success"] is False
    assert busy.json()["error"]["field"] == "request" and engine.asleep == 0
    engine._in_flight = 0
    assert miles_post(client, "release_memory_occupation").status_code == 200 and engine.asleep == 2


# ------------------------------------------------------------------ request defaults as sglang-diffusion resolves them
@pytest.mark.parametrize("steps", [None, "absent"])
def test_null_num_inference_steps_is_the_models_default(tiny_family, steps):
    """sglang drops null fields and takes its model's SamplingParams default (Qwen-Image 50, Wan2.2 A14B 40, ...)."""
    tiny_family.default_num_inference_steps = 4  # the demo's default is 10; any other shows where it came from
    client = client_for(Engine(tiny_family))
    body = {k: v for k, v in SAMPLE.items() if k != "num_inference_steps"}
    if steps is None:
        body["num_inference_steps"] = None
    response = client.post("/rollout/generate", json={**body, "rollout_return_dit_trajectory": True})
    assert response.status_code == 200, response.text
    record = response.json()[0]
    assert record["rollout_log_probs"]["shape"] == [4] and record["dit_trajectory"]["timesteps"]["shape"] == [4]
    explicit = client.post("/rollout/generate", json={**body, "num_inference_steps": 2}).json()[0]
    assert explicit["rollout_log_probs"]["shape"] == [2]


def test_negative_prompt_whitespace_is_stripped_as_sglang_does():
    from diffrl.engine.protocol import RolloutRequest

    assert RolloutRequest(prompt="p", negative_prompt="  blurry, low quality \n").negative_prompt == "blurry, low quality"
    assert RolloutRequest(prompt="p", negative_prompt=" ").negative_prompt == " "  # all whitespace: kept as sent
    assert RolloutRequest(prompt="p", negative_prompt="").negative_prompt == ""
    merged = RolloutRequest.model_validate({"prompt": "p", "extra_sampling_params": {"negative_prompt": " x "}})
    assert merged.negative_prompt == "x"


def test_fuzzed_bodies_get_a_4xx_naming_the_field_and_change_nothing(tiny_family, tmp_path):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    root = tmp_path / "checkpoints"
    random_demo.random_family(random_demo.tiny(), seed=1).save(root / "step-1")
    engine = Engine(tiny_family)
    client = TestClient(create_app(engine, limits=ServerLimits(weights_roots=(root,))), base_url=BASE_URL,
                        raise_server_exceptions=False)
    checksum = miles_post(client, "get_weights_checksum").json()
    texts = st.one_of(st.text(max_size=12), st.sampled_from([str(root), str(root / "step-1" / ".."), "/", "\udc00"]))
    values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-3, 2**64), st.floats(), texts),
                          lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(texts, inner, max_size=3)),
                          max_leaves=6)
    keys = st.sampled_from(["module_names", "model_path", "target_modules", "flush_cache", "weight_version", "level",
                            "tags", "target_module", "expected_named_tensors_sha256", "serialized_named_tensors", "x"])
    endpoints = st.sampled_from(["get_weights_checksum", "update_weights_from_disk", "update_weights_from_tensor",
                                 "update_weights_from_tensor_checker", "release_memory_occupation"])

    @settings(max_examples=150, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(endpoint=endpoints, body=st.one_of(st.dictionaries(keys, values, max_size=3), values))
    def case(endpoint, body):
        import json

        response = client.post(f"/{endpoint}", content=json.dumps(body, allow_nan=True).encode(),
                               headers={"content-type": "application/json"})
        if endpoint == "update_weights_from_tensor":
            assert response.status_code == 404  # off by default
        elif response.status_code >= 400:
            assert response.status_code < 500, (endpoint, response.text[:300])
            assert response.json()["error"]["field"] and response.json()["success"] is False
        if engine.asleep:
            miles_post(client, "resume_memory_occupation")

    case()
    assert engine.weight_version == 0 and miles_post(client, "get_weights_checksum").json() == checksum


def test_model_and_server_info_answer_sglangs_keys(tiny_family):
    client = TestClient(create_app(Engine(tiny_family), model_path="/models/demo"), base_url=BASE_URL)
    model = client.get("/model_info")
    server = client.get("/server_info")
    assert model.status_code == 200 and set(model.json()) == {
        "model_path", "is_generation", "model_type", "architectures", "has_image_understanding",
        "has_audio_understanding", "task_type", "is_image_gen"}
    # The demo family takes condition images (the editing world) without requiring them: sglang's TI2I.
    assert model.json()["task_type"] == "TI2I" and model.json()["is_image_gen"] is True
    assert model.json()["model_type"] == "diffusion" and model.json()["model_path"] == "/models/demo"
    assert server.status_code == 200 and set(server.json()) == {"model_path", "served_model_name", "tp_size",
                                                               "dp_size", "version"}
    assert server.json()["tp_size"] == 1 and server.json()["served_model_name"] == "/models/demo"


def test_miles_engine_calls_over_a_real_socket(tiny_family, tmp_path):
    """miles' `SGLangDiffusionEngine` calls, with `requests` as it makes them, against a served engine."""
    import requests

    from diffrl.serving.server import serving_in_thread

    engine = Engine(tiny_family)

    def make_request(url: str, endpoint: str, payload: dict | None = None):
        response = requests.post(f"{url}/{endpoint}", json=payload or {}, timeout=30,
                                 headers={"authorization": "Bearer s3cret"})
        try:
            response.raise_for_status()
        except requests.exceptions.HTTPError as err:
            err.add_note(f"{response.text=}")
            raise
        return response.json()

    limits = ServerLimits(tensor_updates=True)
    with serving_in_thread(create_app(engine, update_token="s3cret", limits=limits)) as url:
        assert requests.get(f"{url}/health_generate", timeout=5).status_code == 200
        assert make_request(url, "release_memory_occupation")["success"] is True and engine.asleep == 2
        assert make_request(url, "resume_memory_occupation")["success"] is True and engine.asleep == 0
        sums = make_request(url, "get_weights_checksum", {"module_names": ["transformer"]})
        assert sums == {"transformer": sglang_checksum(tiny_family.transformer.named_parameters())}
        name, param = next(iter(tiny_family.transformer.named_parameters()))
        mark = tmp_path / "mark"
        with pytest.raises(requests.exceptions.HTTPError) as refused:  # a pickle that would open a file
            make_request(url, "update_weights_from_tensor", miles_tensor_payload(name, param + 1, str(mark)))
        assert refused.value.response.status_code == 400 and "refused global" in "".join(refused.value.__notes__)
        assert engine.weight_version == 0 and not mark.exists()
        expected = param.detach() + 1
        payload = miles_tensor_payload(name, expected, None)
        assert make_request(url, "update_weights_from_tensor", payload)["weight_version"] == 1
        assert torch.equal(dict(tiny_family.transformer.named_parameters())[name], expected)
