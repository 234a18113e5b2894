"""What a colocated engine's sleep gives the device back, and what the trainer's optimizer offload does (CPU).

The bug: at level 2 the engine moved its weights to host memory and freed them (allocated 4.98 -> 0.03 GiB on
an H100), yet kept every byte reserved, the allocator's cache included: `Engine.sleep` emptied the cache only
when `family.device` was a GPU, and that property reads the transformer's first parameter, on the host once
the weights have moved. Without a GPU, these tests run the real sleep code against a fake CUDA caching
allocator: the family's (CPU) tensors stand for device blocks, `torch.cuda.empty_cache` returns a block to the
"driver" only when no reference to its storage is left, and `mem_get_info` reports what the driver has.
The family's `device` reads its first parameter, as `FamilyAdapter.device` does on a GPU: "cuda:0" while the
weights are in place, "cpu" once they are host copies.
"""

import types
import weakref

import pytest
import torch

import diffrl.utils.offload as offload_module
from diffrl.serving.colocated import ColocatedEngineClient, _EngineServer
from diffrl.engine.engine import Engine
from diffrl.train.policy import Policy
from diffrl.utils.offload import OptimizerOffload, family_modules

GPU = torch.device("cuda", 0)
TOTAL = 80 * 2**30


class FakeAllocator:
    """The CUDA calls the sleep path makes, recorded in order, over blocks that are the given tensors' storages."""

    def __init__(self, monkeypatch, tensors):
        self.events: list[tuple] = []
        self.blocks = {}  # id -> (weakref to the storage, bytes): reserved until emptied after its storage died
        for t in tensors:
            storage = t.untyped_storage()
            self.blocks.setdefault(id(storage), (weakref.ref(storage), storage.nbytes()))
        self.hosts: list[torch.Tensor] = []  # host copies made by the offload (kept: their addresses stay unique)
        real_host_copy = offload_module.host_copy

        def host_copy(tensor):
            host = real_host_copy(tensor)
            self.hosts.append(host)
            self.events.append(("copy",))
            return host

        monkeypatch.setattr(offload_module, "host_copy", host_copy)
        monkeypatch.setattr(offload_module, "_same_device", lambda a, b: True)  # the CPU plays the GPU
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: self.events.append(("synchronize",)))
        monkeypatch.setattr(torch.cuda, "empty_cache", self.empty_cache)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (TOTAL - self.reserved(), TOTAL))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved())
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated())
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.allocated())
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [
            {"device": 0, "total_size": n, "allocated_size": n if ref() is not None else 0}
            for ref, n in self.blocks.values()])

    def on_host(self, tensor) -> bool:
        return any(tensor.data_ptr() == h.data_ptr() for h in self.hosts)

    def live_blocks(self) -> int:
        return sum(ref() is not None for ref, _ in self.blocks.values())

    def reserved(self) -> int:
        return sum(n for _, n in self.blocks.values())

    def allocated(self) -> int:
        return sum(n for ref, n in self.blocks.values() if ref() is not None)

    def empty_cache(self) -> None:
        released = {k for k, (ref, _) in self.blocks.items() if ref() is None}
        self.events.append(("empty_cache", len(released), self.live_blocks()))
        for k in released:
            del self.blocks[k]


@pytest.fixture
def fake_gpu(monkeypatch, tiny_family):
    """The tiny demo family "on cuda:0" over a fake allocator whose blocks are its tensors' storages."""
    tensors = [t for m in family_modules(tiny_family) for t in (*m.parameters(), *m.buffers())]
    allocator = FakeAllocator(monkeypatch, tensors)
    first = next(tiny_family.transformer.parameters())
    monkeypatch.setattr(type(tiny_family), "device",
                        property(lambda self: torch.device("cpu") if allocator.on_host(first) else GPU))
    assert tiny_family.device == GPU and allocator.live_blocks() == len(allocator.blocks) > 0
    return tiny_family, allocator, tensors


def _engine_server(engine: Engine) -> _EngineServer:
    """The engine process's server around `engine`, as `_EngineServer.__init__` leaves it (without loading a
    model): `device` is the family's device read at load, with the weights on it."""
    server = object.__new__(_EngineServer)
    server.engine, server.device, server.bucket_buffer = engine, engine.family.device, None
    return server


def _assert_released_after_the_copies(allocator: FakeAllocator, tensors) -> None:
    """Every weight is a complete host copy, no reference to a device storage survives, and the cache was
    emptied after the copies were waited for: every block went back to the driver."""
    assert all(allocator.on_host(t) for t in tensors if t.numel())
    assert allocator.live_blocks() == 0, "a reference to the device weights survived the sleep"
    events = allocator.events
    last_copy = max(i for i, e in enumerate(events) if e[0] == "copy")
    synced = [i for i, e in enumerate(events) if e[0] == "synchronize" and i > last_copy]
    emptied = [i for i, e in enumerate(events) if e[0] == "empty_cache" and e[1] > 0]
    assert synced, f"the device was not synchronized after the copies to the host: {events[last_copy:]}"
    assert emptied and emptied[-1] > synced[0], (
        f"the cache was not emptied after the weights reached the host (events after the last copy: "
        f"{events[last_copy:]}): the device gets nothing back")
    assert allocator.reserved() == 0, f"{allocator.reserved()} bytes stay reserved"


def test_colocated_level_two_sleep_gives_the_weights_memory_back_and_says_so(fake_gpu):
    family, allocator, tensors = fake_gpu
    server = _engine_server(Engine(family))
    weights = allocator.reserved()
    reply = server._sleep(2)
    assert reply["level"] == 2 and reply["moved_bytes"] >= weights > 0
    _assert_released_after_the_copies(allocator, tensors)
    assert reply["before"]["reserved"] == weights and reply["after"]["reserved"] == 0
    assert reply["released_bytes"] == weights  # the device's free memory gained, as cudaMemGetInfo counts it
    assert reply["stranded_bytes"] == 0


def test_in_process_engine_level_two_sleep_gives_the_weights_memory_back(fake_gpu):
    """`Engine.sleep` alone (diffrl serve's /release_memory_occupation): the offload releases what it moved."""
    family, allocator, tensors = fake_gpu
    assert Engine(family).sleep(2) > 0
    _assert_released_after_the_copies(allocator, tensors)


def test_level_one_sleep_keeps_the_weights_and_reports_no_gain(fake_gpu):
    family, allocator, tensors = fake_gpu
    reply = _engine_server(Engine(family))._sleep(1)
    assert reply["moved_bytes"] == 0 and reply["released_bytes"] == 0
    assert allocator.live_blocks() == len(allocator.blocks) and family.device == GPU  # the weights stay


def test_cpu_engine_sleep_reply_and_client_carry_the_released_figure(tiny_family):
    server = _engine_server(Engine(tiny_family))
    reply = server._sleep(2)
    assert reply["moved_bytes"] > 0 and reply["released_bytes"] == 0 and reply["stranded_bytes"] == 0
    assert server.engine.wake() == reply["moved_bytes"]

    client = object.__new__(ColocatedEngineClient)  # the trainer's side, its pipe stubbed
    client._request = lambda header, payload=None, what="": {"level": header["level"], "released_bytes": 5 * 2**30}
    assert client.sleep(2)["released_bytes"] == 5 * 2**30 and client.released_bytes == 5 * 2**30


class _FakeEngine:
    def __init__(self, released: int):
        self.released, self.calls = released, []

    def wake(self):
        self.calls.append("wake")

    def sleep(self, level: int = 1) -> dict:
        self.calls.append(("sleep", level))
        return {"level": level, "released_bytes": self.released}


def _policy(**fields):
    defaults = {"optimizer_offload": None, "colocated": [], "colocated_rewards": [], "device": torch.device("cpu"),
                "engine_sleep_level": 2}
    return types.SimpleNamespace(**{**defaults, **fields})


def test_policy_keeps_what_the_engines_sleep_released_summed_in_gib():
    policy = _policy(colocated=[_FakeEngine(3 * 2**30), _FakeEngine(2**29)])
    with Policy._sampling_memory(policy):
        assert policy.engine_released_gib is None  # nothing slept yet in this block
    assert policy.engine_released_gib == pytest.approx(3.5)
    assert [e.calls for e in policy.colocated] == [["wake", ("sleep", 2)]] * 2
    for fields in ({"colocated": []}, {"engine_sleep_level": 0}):  # no engine put to sleep: None
        policy = _policy(**{"colocated": [_FakeEngine(2**30)], **fields})
        with Policy._sampling_memory(policy):
            pass
        assert policy.engine_released_gib is None


def test_optimizer_offload_holds_no_device_tensor_and_the_trainer_releases_it_before_the_engine_wakes(monkeypatch):
    """Not the bug (the trainer's release names its own device), a guard: the optimizer state's old tensors are
    unreferenced once offloaded, so the trainer's release gives them back before the engine wakes; the state
    comes back bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    state = [v for s in optimizer.state.values() for v in s.values()]
    saved = [v.clone() for v in state]
    allocator = FakeAllocator(monkeypatch, state)
    del state
    engine = _FakeEngine(0)
    engine.wake = lambda: allocator.events.append(("wake", allocator.reserved()))
    policy = _policy(optimizer_offload=OptimizerOffload(optimizer), colocated=[engine], device=GPU)
    with Policy._sampling_memory(policy):
        assert allocator.live_blocks() == 0 and allocator.reserved() == 0
        kinds = [e[0] for e in allocator.events]
        assert kinds.index("empty_cache") < kinds.index("wake") and allocator.events[-1] == ("wake", 0)
    restored = [v for s in optimizer.state.values() for v in s.values()]
    assert all(torch.equal(a, b) for a, b in zip(restored, saved, strict=True))


def _row(level, moved, alloc, reserved, gained, stranded=0):
    """A sleep row of benchmarks/weight_sync.py (GiB figures as bytes): allocated and reserved (before, asleep)."""
    g = 2**30
    return {"level": level, "moved_bytes": int(moved * g), "allocated_before": int(alloc[0] * g),
            "allocated_asleep": int(alloc[1] * g), "reserved_before": int(reserved[0] * g),
            "reserved_asleep": int(reserved[1] * g), "allocated_freed": int((alloc[0] - alloc[1]) * g),
            "device_free_gained": int(gained * g), "stranded_bytes": int(stranded * g),
            "releasable_bytes": int((reserved[0] - alloc[1] - stranded) * g)}


def test_weight_sync_benchmark_fails_on_the_issues_level_two_rows_only(monkeypatch):
    """The sleep check of benchmarks/weight_sync.py on the rows the issue measured on an H100 (level 2 kept every
    byte reserved) and on healthy ones (level 1's 0.15 GiB left in segments with live blocks is not a failure)."""
    from benchmark_scripts import load_benchmark

    check = load_benchmark("weight_sync", monkeypatch).sleep_failures
    issue = {"lora": {"sleep": [_row(1, 0, (4.98, 4.97), (8.89, 5.12), 3.78, stranded=0.15),
                                _row(2, 4.95, (4.98, 0.03), (8.89, 8.89), -0.02)]}}
    failures = check({"modes": issue})
    assert len(failures) == 2 and all("lora sleep #2 (level 2)" in f for f in failures)
    assert "the engine kept the weights' memory reserved" in failures[0]
    healthy = {"lora": {"sleep": [_row(1, 0, (4.98, 4.97), (8.89, 5.12), 3.78, stranded=0.15),
                                  _row(2, 4.95, (4.98, 0.03), (8.89, 0.04), 8.84, stranded=0.01)]},
               "full": {"sleep": [_row(1, 0, (9.49, 9.48), (14.77, 9.76), 5.01, stranded=0.28),
                                  _row(2, 9.43, (9.49, 0.03), (13.41, 0.08), 13.29, stranded=0.05)]}}  # the H200's
    assert check({"modes": healthy}) == []
    skipped_cache = {"lora": {"sleep": [_row(1, 0, (4.98, 4.97), (8.89, 8.89), 0.0, stranded=0.15)]}}
    assert "could release 3.77 GiB" in check({"modes": skipped_cache})[0]  # level 1 without empty_cache
    cpu = {"lora": {"sleep": [{**_row(2, 1, (0, 0), (0, 0), 0), "device_free_gained": None}]}}
    assert check({"modes": cpu}) == []
