"""`POST /update_weights_from_tensor`: miles-diffusion's weight sync, its pickles read by a restricted unpickler.

miles' `DiffusionUpdateWeightFromTensor.update_bucket_weights` groups a state dict's tensors by dtype, flattens
each group into one uint8 tensor with sglang's `FlattenedTensorBucket` (metadata: `FlattenedTensorMetadata`
dataclasses of name, shape, dtype, start_idx, end_idx, numel), wraps it as `{"transformer": {"flattened_tensor",
"metadata"}}`, and posts its base64 pickle as `{"serialized_named_tensors": [...], "load_format":
"flattened_bucket", "target_modules": ["transformer"], "weight_version": "N"}`, one request per dtype. The
buckets here are built so by `diffrl.serving.tensor_bucket` (the GPU script's builder too), pickled by value
(`pickle.dumps`).

What miles really sends is that bucket on its GPU, pickled by sglang's `MultiprocessingSerializer` (torch's
ForkingPickler) after sglang's `monkey_patch_torch_reductions`: the flattened tensor becomes a call of
`sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified` with torch's fifteen `rebuild_cuda_tensor` arguments,
the device given by its UUID. Without a GPU here, `miles_ipc_payload` writes that stream with ForkingPickler from
the same globals and an argument tuple laid out as torch's `reduce_tensor` lays it out, and the tests stand in for
the one step that needs CUDA (mapping the handle, `tensor_pickle.open_ipc_tensor`). The real mapping is what
scripts/device/ipc_weight_sync.sh checks on a GPU (not yet run).
"""

from __future__ import annotations

import builtins
import io
import os
import pickle
import sys

import pytest
import torch
from fastapi.testclient import TestClient
from torch.multiprocessing import reductions

from diffrl.engine.engine import Engine
from diffrl.serving import tensor_bucket, tensor_pickle
from diffrl.serving.server import ServerLimits, check_tensor_updates, create_app
from diffrl.models.random_checkpoints import demo as random_demo

BASE_URL = "http://127.0.0.1:30000"
TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
SAMPLE = {"prompt": "a red circle", "seed": 11, "num_outputs_per_prompt": 2, "width": 64, "height": 64,
          "num_inference_steps": 3, "guidance_scale": 1.0, "rollout": True, "rollout_sde_type": "sde",
          "rollout_noise_level": 0.7}


@pytest.fixture
def sglang_metadata():
    """sglang's `FlattenedTensorMetadata` under its module name, so that pickle writes that global."""
    with tensor_bucket.sglang_modules():
        yield tensor_bucket.FlattenedTensorMetadata


def body(obj, version: str = "1", data: bytes | None = None) -> dict:
    return tensor_bucket.request_body(pickle.dumps(obj) if data is None else data, version)


def client_for(engine: Engine, *, enabled: bool = True, token: str | None = TOKEN, peer: str = "testclient",
               **kwargs) -> TestClient:
    app = create_app(engine, update_token=token, limits=ServerLimits(tensor_updates=enabled), **kwargs)
    return TestClient(app, base_url=BASE_URL, client=(peer, 50000))


def sample_bits(client: TestClient) -> list[tuple[str, str]]:
    response = client.post("/rollout/generate", json=SAMPLE)
    assert response.status_code == 200, response.text
    return [(r["generated_output"]["data"], r["rollout_log_probs"]["data"]) for r in response.json()]


def state(engine: Engine) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in engine.family.transformer.state_dict().items()}


def test_the_payload_builder_is_read_back_by_the_parser(sglang_metadata):
    """`tensor_bucket`'s buckets and request bodies (what these tests and scripts/device/ipc_weight_sync.py send),
    read by the endpoint's own parser: the named tensors come back, bit for bit, with their names, dtypes and
    shapes, one bucket per dtype, and the pickle names sglang's metadata class."""
    import pickletools

    state = random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict()
    named = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(state.items())]
    named.append(("scalar", torch.tensor(3, dtype=torch.int64)))  # a 0-d tensor in a bucket of its own
    bodies = [tensor_bucket.request_body(pickle.dumps(b), 7) for b in tensor_bucket.flattened_buckets(named)]
    assert len(bodies) == 3 and all(b["weight_version"] == "7" and b["target_modules"] == ["transformer"]
                                    and b["load_format"] == "flattened_bucket" for b in bodies)
    data = tensor_pickle.decode(bodies[0]["serialized_named_tensors"][0])
    assert isinstance(data["transformer"]["metadata"][0], tensor_pickle.Metadata)
    strings = {arg for _, arg, _ in pickletools.genops(pickle.dumps(tensor_bucket.flattened_buckets(named[:1])))
               if isinstance(arg, str)}
    assert {tensor_bucket.METADATA_MODULE, "FlattenedTensorMetadata"} <= strings
    read = {}
    for b in bodies:
        payload = tensor_pickle.decode(b["serialized_named_tensors"][0])
        part = tensor_pickle.named_tensors(payload, b["load_format"], {"transformer": ""})
        assert len({t.dtype for t in part.values()}) == 1
        read.update(part)
    assert sorted(read) == sorted(n for n, _ in named)
    assert all(read[n].dtype == t.dtype and torch.equal(read[n], t) for n, t in named)


def test_sglang_stand_ins_are_put_back_on_exit():
    """`sglang_modules` leaves `sys.modules` as it found it, nested too; outside it pickle cannot write sglang's
    metadata class by its name."""
    before = set(sys.modules)
    with tensor_bucket.sglang_modules():
        outer = sys.modules[tensor_bucket.METADATA_MODULE]
        with tensor_bucket.sglang_modules(f=lambda: None) as patch_module:
            assert sys.modules[tensor_bucket.PATCH_MODULE] is patch_module and patch_module.f.__qualname__ == "f"
        assert sys.modules[tensor_bucket.METADATA_MODULE] is outer and not hasattr(
            sys.modules[tensor_bucket.PATCH_MODULE], "f")
    assert set(sys.modules) == before
    with pytest.raises(pickle.PicklingError):
        pickle.dumps(tensor_bucket.flattened_buckets([("w", torch.ones(2))]))


def test_a_miles_update_loads_the_weights_as_a_direct_load_does(tiny_family, sglang_metadata):
    engine = Engine(tiny_family)
    client = client_for(engine)
    before = sample_bits(client)
    trained = random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict()
    # Two dtypes (miles sends one request per dtype): a bf16 copy of half of the tensors, cast back on load.
    names = list(trained)
    named = [(n, trained[n].to(torch.bfloat16) if i % 2 else trained[n]) for i, n in enumerate(names)]

    for bucket in tensor_bucket.flattened_buckets(named):
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
    benign = tensor_bucket.flattened_buckets(
        random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict().items())[0]
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
    bucket = tensor_bucket.flattened_buckets(named)[0]
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


def test_off_by_default_then_a_loopback_peer_or_the_token(tiny_family, sglang_metadata, tmp_path):
    engine = Engine(tiny_family)
    bucket = tensor_bucket.flattened_buckets(
        random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict().items())[0]
    mark = tmp_path / "mark"
    payload = body({**bucket, "trap": _Reduces(builtins.open, str(mark), "w")})
    good = body(bucket)

    off = TestClient(create_app(engine, update_token=TOKEN), base_url=BASE_URL, client=("127.0.0.1", 1))
    response = off.post("/update_weights_from_tensor", json=payload, headers=AUTH)
    assert response.status_code == 404 and "--update-weights-from-tensor" in response.json()["error"]["message"]
    # No token (miles sends none): only a peer on this host's loopback.
    assert client_for(engine, token=None, peer="10.1.2.3").post("/update_weights_from_tensor",
                                                                json=good).status_code == 403
    assert client_for(engine, token=None, peer="::ffff:127.0.0.1").post("/update_weights_from_tensor",
                                                                        json=good).status_code == 200
    # A token on the server: always required, from loopback too.
    guarded = client_for(engine, peer="127.0.0.1")
    assert guarded.post("/update_weights_from_tensor", json=payload).status_code == 401
    assert guarded.post("/update_weights_from_tensor", json=payload,
                        headers={"authorization": "Bearer nope"}).status_code == 401
    # An exposed server: the token, from anywhere; without a token it refuses to start (and every update).
    exposed = TestClient(create_app(engine, update_token=TOKEN, exposed=True,
                                    limits=ServerLimits(tensor_updates=True)), client=("10.1.2.3", 1))
    assert exposed.post("/update_weights_from_tensor", json=payload, headers=AUTH).status_code == 400
    assert exposed.post("/update_weights_from_tensor", json=payload).status_code == 401
    assert not mark.exists()

    with pytest.raises(ValueError, match="--update-token"):
        check_tensor_updates(True, exposed=True, token=None)
    check_tensor_updates(True, exposed=True, token=TOKEN)
    check_tensor_updates(True, exposed=False, token=None)
    check_tensor_updates(False, exposed=True, token=None)


# ------------------------------------------------------------------------------------------------ CUDA IPC (miles)
DEVICE_UUID = "GPU-5f2a6c1e-0b7d-4e3a-9c41-2d8e7f6a1b30"
REF_COUNTER = b"/torch_4242_1234567_0"


@pytest.fixture
def sglang_patch(sglang_metadata):
    """sglang's `patch_torch` module with its `_rebuild_cuda_tensor_modified`, so that pickle writes that global
    (miles calls `monkey_patch_torch_reductions`, which puts it where torch's `rebuild_cuda_tensor` was)."""
    def _rebuild_cuda_tensor_modified(*args):
        raise AssertionError("the server must never call the sender's function")

    with tensor_bucket.sglang_modules(_rebuild_cuda_tensor_modified=_rebuild_cuda_tensor_modified):
        yield _rebuild_cuda_tensor_modified


class _SharedOnGpu:
    """A tensor as torch's `reduce_tensor` writes a CUDA one (after sglang's patch: the device as its UUID)."""

    def __init__(self, rebuild, tensor: torch.Tensor, memory_handle: bytes, **overrides):
        self.rebuild, self.tensor, self.handle, self.overrides = rebuild, tensor, memory_handle, overrides

    def __reduce__(self):
        t = self.tensor
        args = dict(tensor_cls=torch.Tensor, size=t.size(), stride=t.stride(), offset=t.storage_offset(),
                    storage_cls=torch.storage.TypedStorage, dtype=t.dtype, device=DEVICE_UUID, handle=self.handle,
                    storage_bytes=t.untyped_storage().nbytes(), storage_offset_bytes=0, requires_grad=False,
                    ref_counter=REF_COUNTER, ref_counter_offset=3, event_handle=bytes(64), event_sync=True)
        args.update(self.overrides)
        return self.rebuild, tuple(args.values())


def ipc_handle(i: int) -> bytes:
    """torch's caching-allocator handle: version 2, `c` (a cudaMalloc block), a 64-byte cudaIpcMemHandle."""
    return b"\x02c" + bytes([i]) * 64


def miles_ipc_payload(named, rebuild, **overrides) -> tuple[list[bytes], dict[bytes, torch.Tensor]]:
    """miles' `update_bucket_weights`: per dtype a FlattenedTensorBucket, `{"transformer": {"flattened_tensor",
    "metadata"}}`, pickled by ForkingPickler (MultiprocessingSerializer). Also what each handle maps to."""
    from multiprocessing.reduction import ForkingPickler

    payloads, memory = [], {}
    for i, bucket in enumerate(tensor_bucket.flattened_buckets(named)):
        flat = bucket["transformer"]["flattened_tensor"]
        handle = ipc_handle(i)
        memory[handle] = flat
        bucket["transformer"]["flattened_tensor"] = _SharedOnGpu(rebuild, flat, handle, **overrides)
        stream = io.BytesIO()
        ForkingPickler(stream).dump(bucket)
        payloads.append(stream.getvalue())
    return payloads, memory


def mapped_from(memory: dict[bytes, torch.Tensor], opened: list):
    """Stands in for `open_ipc_tensor` (which needs CUDA): the tensor each handle names, copied, as it copies."""
    def open_ipc_tensor(record: tensor_pickle.IpcTensor, max_bytes: int) -> torch.Tensor:
        opened.append(record)
        source = memory[record.handle]
        return torch.as_strided(source, record.size, record.stride, record.offset).clone()
    return open_ipc_tensor


def test_miles_cuda_ipc_payload_is_read_as_records_and_loads_the_weights(tiny_family, sglang_patch, monkeypatch):
    import pickletools

    named = list(random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict().items())
    named = [(n, t.to(torch.bfloat16) if i % 2 else t) for i, (n, t) in enumerate(named)]
    payloads, memory = miles_ipc_payload(named, sglang_patch)
    strings = {arg for op, arg, _ in pickletools.genops(payloads[0]) if isinstance(arg, str)}
    assert {"sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified", "TypedStorage"} <= strings

    record = tensor_pickle.loads(payloads[0])["transformer"]["flattened_tensor"]
    assert isinstance(record, tensor_pickle.IpcTensor)
    assert record.device == DEVICE_UUID and record.handle == ipc_handle(0) and record.event_sync is True
    assert record.size == tuple(memory[ipc_handle(0)].shape) and record.ref_counter == REF_COUNTER

    engine = Engine(tiny_family)
    opened: list = []
    monkeypatch.setattr(tensor_pickle, "open_ipc_tensor", mapped_from(memory, opened))
    local = client_for(engine, token=None, peer="127.0.0.1")  # miles sends no token; it posts from this host
    for data in payloads:
        response = local.post("/update_weights_from_tensor", json=body(None, version="3", data=data))
        assert response.status_code == 200, response.text
    assert len(opened) == len(payloads) and engine.weight_version == 3
    direct = Engine(random_demo.random_family(random_demo.tiny(), seed=0))
    direct.update_weights(dict(named))
    assert all(torch.equal(a, b) for a, b in zip(state(engine).values(), state(direct).values()))
    # torch's own reduction (a sender without sglang's patch) names the device by index: read the same way
    plain, _ = miles_ipc_payload(named[:2], reductions.rebuild_cuda_tensor, device=0)
    assert tensor_pickle.loads(plain[0])["transformer"]["flattened_tensor"].device == 0


def test_cuda_ipc_only_for_a_loopback_peer_and_only_with_cuda(tiny_family, sglang_patch, monkeypatch):
    named = list(random_demo.random_family(random_demo.tiny(), seed=1).transformer.state_dict().items())
    payloads, memory = miles_ipc_payload(named, sglang_patch)
    engine = Engine(tiny_family)
    before = state(engine)
    # A token holder from another host: by-value pickles are read, CUDA IPC handles are not opened.
    remote = client_for(engine, peer="10.1.2.3")
    response = remote.post("/update_weights_from_tensor", json=body(None, data=payloads[0]), headers=AUTH)
    assert response.status_code == 403 and "loopback peer" in response.json()["message"]
    assert response.json()["error"]["field"] == "serialized_named_tensors"
    # This machine has no CUDA: the real opener refuses in one line, naming the alternatives.
    local = client_for(engine, token=None, peer="127.0.0.1")
    response = local.post("/update_weights_from_tensor", json=body(None, data=payloads[0]))
    assert response.status_code == 400, response.text
    message = response.json()["message"]
    assert "no CUDA device" in message and "/update_weights_from_disk" in message and "\n" not in message
    assert engine.weight_version == 0 and all(torch.equal(t, before[n]) for n, t in state(engine).items())
    # Without an opener (the module's default) a record is refused, never opened.
    with pytest.raises(tensor_pickle.RefusedPayload, match="loopback peer"):
        tensor_pickle.named_tensors(tensor_pickle.loads(payloads[0]), "flattened_bucket", {"transformer": ""})
    with pytest.raises(tensor_pickle.RefusedPayload, match="above this endpoint's limit"):
        tensor_pickle.open_ipc_tensor(tensor_pickle.loads(payloads[0])["transformer"]["flattened_tensor"], 16)


def test_cuda_ipc_records_are_checked_as_data(sglang_patch):
    from multiprocessing.reduction import ForkingPickler

    flat = torch.zeros(64, dtype=torch.uint8)

    def read(**overrides):
        return tensor_pickle.loads(ForkingPickler.dumps(_SharedOnGpu(sglang_patch, flat, ipc_handle(1), **overrides)))

    assert isinstance(read(), tensor_pickle.IpcTensor)
    assert read(handle=bytes(64)).handle == bytes(64)  # torch before 2.2: the cudaIpcMemHandle alone
    bad = {
        "beyond its storage": dict(size=torch.Size([65])),
        "beyond its storage ": dict(offset=60, size=torch.Size([8])),
        "whole": dict(dtype=torch.float32, storage_bytes=63),
        "expandable segment": dict(handle=b"\x02e" + bytes(80)),
        "not the layout torch writes": dict(handle=b"\x02c" + bytes(10)),
        "memory handle must be bytes": dict(handle="x" * 66),
        "reference counter must be named": dict(ref_counter=b"/../../home/user/.bashrc"),
        "reference counter 10000": dict(ref_counter_offset=10_000),
        "event handle": dict(event_handle=bytes(8)),
        "index or a device UUID": dict(device="cuda:0; rm -rf /"),
        "out of range": dict(device=5000),
        "must be a boolean": dict(requires_grad=1),
        "non-negative integer": dict(storage_offset_bytes=-1),
        "must be a torch.Tensor": dict(tensor_cls=torch.storage.TypedStorage),
        "must be empty": dict(handle=None),
    }
    for what, overrides in bad.items():
        with pytest.raises(tensor_pickle.RefusedPayload, match=what.strip()):
            read(**overrides)
    # A payload that tries to call the classes the reduction names (torch.Tensor(2**40) would allocate) gets markers.
    for cls in (torch.Tensor, torch.storage.TypedStorage):
        with pytest.raises(tensor_pickle.RefusedPayload, match="not a readable pickle"):
            tensor_pickle.loads(pickle.dumps(_Reduces(cls, 1 << 40)))
    with pytest.raises(tensor_pickle.RefusedPayload, match="refused global torch.nn.parameter.Parameter"):
        read(tensor_cls=torch.nn.Parameter)
    with pytest.raises(tensor_pickle.RefusedPayload, match="refused global torch.storage.UntypedStorage"):
        read(storage_cls=torch.UntypedStorage)


def _a_function_of_the_sender(*args):
    return args


def calling(module: str, name: str) -> bytes:
    """A pickle that calls `module.name("true")`, naming the global exactly as written."""
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + b"X\x04\x00\x00\x00true\x85R."


def test_any_other_global_is_refused_by_name(tiny_family, tmp_path):
    client = client_for(Engine(tiny_family), token=None, peer="127.0.0.1")
    mark = tmp_path / "mark"
    cases = {
        "os.system": calling("os", "system"),
        "posix.system": pickle.dumps(_Reduces(os.system, f"touch {mark}")),
        "builtins.eval": pickle.dumps(_Reduces(builtins.eval, "1")),
        "builtins.exec": pickle.dumps(_Reduces(builtins.exec, "1")),
        "subprocess.Popen": calling("subprocess", "Popen"),
        "__main__.<lambda>": calling("__main__", "<lambda>"),  # a lambda can only be named, never pickled by value
        f"{__name__}._a_function_of_the_sender": pickle.dumps(_Reduces(_a_function_of_the_sender, 1)),
        "torch.multiprocessing.reductions.rebuild_storage_fd": pickle.dumps(_Reduces(reductions.rebuild_storage_fd, 1)),
        "torch.serialization.load": pickle.dumps(_Reduces(torch.load, "x")),
    }
    for name, data in cases.items():
        response = client.post("/update_weights_from_tensor", json=body(None, data=data))
        assert 400 <= response.status_code < 500, name
        assert f"refused global {name}" in response.json()["message"], (name, response.json()["message"])
    assert not mark.exists()


def test_the_allow_list_is_exactly_what_sglang_payloads_need():
    """Growing the allow-list is a security decision: this test names every admitted global, and fails on one more."""
    dtypes = {("torch", name) for name in tensor_pickle.DTYPES}
    assert set(tensor_pickle.ADMITTED) - dtypes == {
        ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_parameter"),
        ("torch.storage", "_load_from_bytes"), ("collections", "OrderedDict"), ("torch", "Size"),
        ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
        ("sglang.srt.model_executor.model_runner", "FlattenedTensorMetadata"),
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
        ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified"),
        ("torch", "Tensor"), ("torch.storage", "TypedStorage"),
    }
    assert set(tensor_pickle.DTYPES) <= {"float64", "float32", "float16", "bfloat16", "uint8", "int8", "int16",
                                         "int32", "int64", "bool", "float8_e4m3fn", "float8_e5m2"}
    # Nothing admitted is a function or class of Python or torch: each is this module's checked function, a dtype,
    # torch.Size (a tuple), OrderedDict (a dict), the metadata record or an inert marker.
    for key, value in tensor_pickle.ADMITTED.items():
        assert (getattr(value, "__module__", None) == tensor_pickle.__name__ or isinstance(value, torch.dtype)
                or value in (torch.Size, __import__("collections").OrderedDict)
                or isinstance(value, tensor_pickle._Marker)), key
