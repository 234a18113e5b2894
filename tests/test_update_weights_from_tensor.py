"""`POST /update_weights_from_tensor`: miles-diffusion's weight sync, its pickles read by a restricted unpickler.

miles' `DiffusionUpdateWeightFromTensor.update_bucket_weights` groups a state dict's tensors by dtype, flattens
each group into one uint8 tensor with sglang's `FlattenedTensorBucket` (metadata: `FlattenedTensorMetadata`
dataclasses of name, shape, dtype, start_idx, end_idx, numel), wraps it as `{"transformer": {"flattened_tensor",
"metadata"}}`, and posts its base64 pickle as `{"serialized_named_tensors": [...], "load_format":
"flattened_bucket", "target_modules": ["transformer"], "weight_version": "N"}`, one request per dtype. The
bucket here is built the same way from those facts, pickled by value (`pickle.dumps`).
"""

from __future__ import annotations

import base64
import builtins
import io
import os
import pickle
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from fastapi.testclient import TestClient

from diffrl.engine.engine import Engine
from diffrl.serving.server import ServerLimits, check_tensor_updates, create_app
from diffrl.models.random_checkpoints import demo as random_demo

BASE_URL = "http://127.0.0.1:30000"
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SAMPLE = {"prompt": "a red circle", "seed": 11, "num_outputs_per_prompt": 2, "width": 64, "height": 64,
          "num_inference_steps": 3, "guidance_scale": 1.0, "rollout": True, "rollout_sde_type": "sde",
          "rollout_noise_level": 0.7}


@pytest.fixture
def sglang_metadata(monkeypatch):
    """sglang's `FlattenedTensorMetadata` under its module name, so that pickle writes that global."""
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))

    @dataclass
    class FlattenedTensorMetadata:
        name: str
        shape: torch.Size
        dtype: torch.dtype
        start_idx: int
        end_idx: int
        numel: int

    FlattenedTensorMetadata.__module__ = names[-1]
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    sys.modules[names[-1]].FlattenedTensorMetadata = FlattenedTensorMetadata
    return FlattenedTensorMetadata


def miles_buckets(named: list[tuple[str, torch.Tensor]], metadata_cls) -> list[dict]:
    """One `{"transformer": {"flattened_tensor", "metadata"}}` per dtype, as miles builds them."""
    by_dtype: dict[torch.dtype, list] = {}
    for name, tensor in named:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    buckets = []
    for group in by_dtype.values():
        flats, metadata, start = [], [], 0
        for name, tensor in group:
            flat = tensor.detach().flatten().view(torch.uint8)
            metadata.append(metadata_cls(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=start,
                                         end_idx=start + flat.numel(), numel=flat.numel()))
            flats.append(flat)
            start += flat.numel()
        buckets.append({"transformer": {"flattened_tensor": torch.cat(flats), "metadata": metadata}})
    return buckets


def body(obj, version: str = "1", data: bytes | None = None) -> dict:
    serialized = base64.b64encode(pickle.dumps(obj) if data is None else data).decode()
    return {"serialized_named_tensors": [serialized], "load_format": "flattened_bucket",
            "target_modules": ["transformer"], "weight_version": version}


def client_for(engine: Engine, *, enabled: bool = True, token: str | None = TOKEN, **kwargs) -> TestClient:
    app = create_app(engine, update_token=token, limits=ServerLimits(tensor_updates=enabled), **kwargs)
    return TestClient(app, base_url=BASE_URL)


def sample_bits(client: TestClient) -> list[tuple[str, str]]:
    response = client.post("/rollout/generate", json=SAMPLE)
    assert response.status_code == 200, response.text
    return [(r["generated_output"]["data"], r["rollout_log_probs"]["data"]) for r in response.json()]


def state(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.family.transformer.state_dict().items()}


def test_a_miles_update_loads_the_weights_as_a_direct_load_does(tiny_family, sglang_metadata):
    engine = Engine(tiny_family)
    client = client_for(engine)
    before = sample_bits(client)
    trained = random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict()
    # Two dtypes (miles sends one request per dtype): a bf16 copy of half of the tensors, cast back on load.
    names = list(trained)
    named = [(n, trained[n].to(torch.bfloat16) if i % 2 else trained[n]) for i, n in enumerate(names)]

    for bucket in miles_buckets(named, sglang_metadata):
        response = client.post("/update_weights_from_tensor", json=body(bucket, version="7"), headers=AUTH)
        assert response.status_code == 200, response.text
        assert response.json()["success"] is True and response.json()["weight_version"] == 7

    after = sample_bits(client)
    assert after != before and engine.weight_version == 7
    direct = Engine(random_demo.random_family(random_demo.tiny(), seed=0))
    direct.update_weights({n: t for n, t in named})
    assert sample_bits(TestClient(create_app(direct), base_url=BASE_URL)) == after
    assert all(torch.equal(a, b) for a, b in zip(state(engine).values(), state(direct).values()))


def test_named_pairs_and_parameters_are_read_too(tiny_family):
    engine = Engine(tiny_family)
    client = client_for(engine)
    source = random_demo.random_family(random_demo.tiny(), seed=2).transformer
    pairs = [(name, p) for name, p in source.named_parameters()]  # nn.Parameter pickles by its own rebuild
    response = client.post("/update_weights_from_tensor", headers=AUTH,
                           json={**body(pairs), "load_format": None, "weight_version": None})
    assert response.status_code == 200, response.text
    params = dict(engine.family.transformer.named_parameters())
    assert all(torch.equal(params[name], p.detach()) for name, p in pairs) and engine.weight_version == 1


class _Reduces:
    def __init__(self, func, *args):
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


def test_hostile_payloads_are_refused_before_they_run(tiny_family, sglang_metadata, tmp_path):
    engine = Engine(tiny_family)
    client = client_for(engine)
    before, bits = state(engine), sample_bits(client)
    benign = miles_buckets(list(random_demo.random_family(random_demo.tiny(), seed=1)
                                .transformer.state_dict().items()), sglang_metadata)[0]
    marks = [tmp_path / f"mark{i}" for i in range(4)]
    hostile = {
        "os.system": _Reduces(os.system, f"touch {marks[0]}"),
        "builtins.eval": _Reduces(builtins.eval, f"open({str(marks[1])!r}, 'w')"),
        "builtins.open": _Reduces(builtins.open, str(marks[2]), "w"),
        "inside a bucket": {"transformer": {**benign["transformer"], "x": _Reduces(os.system, f"touch {marks[3]}")}},
        "torch.load": _Reduces(torch.load, str(marks[0])),
        "getattr": _Reduces(getattr, "text", "upper"),
    }
    for what, payload in hostile.items():
        response = client.post("/update_weights_from_tensor", json=body(payload), headers=AUTH)
        assert 400 <= response.status_code < 500, what
        answer = response.json()
        assert answer["success"] is False and answer["error"]["field"] == "serialized_named_tensors", what
        assert what == "inside a bucket" or "refused global" in answer["message"], (what, answer["message"])
    # torch.multiprocessing's sharing (MultiprocessingSerializer's default): shared memory, refused by name
    from multiprocessing.reduction import ForkingPickler

    shared = io.BytesIO()
    ForkingPickler(shared).dump(benign)
    response = client.post("/update_weights_from_tensor", json=body(None, data=shared.getvalue()), headers=AUTH)
    assert response.status_code == 400 and "torch.multiprocessing" in response.json()["message"]
    assert "pickled by value" in response.json()["message"]
    not_base64 = client.post("/update_weights_from_tensor", json={**body(benign), "serialized_named_tensors": ["%%"]},
                             headers=AUTH)
    assert not_base64.status_code == 400

    assert not any(mark.exists() for mark in marks)
    assert engine.weight_version == 0 and sample_bits(client) == bits
    assert all(torch.equal(t, before[name]) for name, t in state(engine).items())


def test_a_bad_bucket_changes_nothing(tiny_family, sglang_metadata):
    engine = Engine(tiny_family)
    client = client_for(engine)
    before = state(engine)
    named = list(random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict().items())
    bucket = miles_buckets(named, sglang_metadata)[0]
    meta = bucket["transformer"]["metadata"]
    cases = {
        "beyond the bucket": [*meta[:-1], sglang_metadata(**{**meta[-1].__dict__, "end_idx": meta[-1].end_idx + 4})],
        "wrong shape": [*meta[:-1], sglang_metadata(**{**meta[-1].__dict__, "shape": torch.Size([3, 3, 3])})],
        "unknown name": [*meta[:-1], sglang_metadata(**{**meta[-1].__dict__, "name": "no.such.weight"})],
    }
    for what, metadata in cases.items():
        payload = {"transformer": {**bucket["transformer"], "metadata": metadata}}
        response = client.post("/update_weights_from_tensor", json=body(payload), headers=AUTH)
        assert response.status_code == 400 and response.json()["success"] is False, what
    wrong_module = client.post("/update_weights_from_tensor", headers=AUTH,
                               json={**body(bucket), "target_modules": ["vae"]})
    assert wrong_module.status_code == 400 and wrong_module.json()["error"]["field"] == "target_modules"
    assert engine.weight_version == 0
    assert all(torch.equal(t, before[name]) for name, t in state(engine).items())


def test_off_by_default_and_only_with_the_token_on_loopback(tiny_family, sglang_metadata, tmp_path):
    engine = Engine(tiny_family)
    bucket = miles_buckets(list(random_demo.random_family(random_demo.tiny(), seed=1)
                                .transformer.state_dict().items()), sglang_metadata)[0]
    mark = tmp_path / "mark"
    payload = body({**bucket, "trap": _Reduces(builtins.open, str(mark), "w")})

    off = TestClient(create_app(engine, update_token=TOKEN), base_url=BASE_URL)
    response = off.post("/update_weights_from_tensor", json=payload, headers=AUTH)
    assert response.status_code == 404 and "--update-weights-from-tensor" in response.json()["error"]["message"]
    no_token = client_for(engine, token=None)
    assert no_token.post("/update_weights_from_tensor", json=payload).status_code == 403
    guarded = client_for(engine)
    assert guarded.post("/update_weights_from_tensor", json=payload).status_code == 401
    assert guarded.post("/update_weights_from_tensor", json=payload,
                        headers={"authorization": "Bearer nope"}).status_code == 401
    exposed = TestClient(create_app(engine, update_token=TOKEN, exposed=True,
                                    limits=ServerLimits(tensor_updates=True)))
    assert exposed.post("/update_weights_from_tensor", json=payload, headers=AUTH).status_code == 403
    assert not mark.exists() and engine.weight_version == 0

    with pytest.raises(ValueError, match="loopback"):
        check_tensor_updates(True, exposed=True, token=TOKEN)
    with pytest.raises(ValueError, match="--update-token"):
        check_tensor_updates(True, exposed=False, token=None)
    check_tensor_updates(True, exposed=False, token=TOKEN)
    check_tensor_updates(False, exposed=True, token=None)
