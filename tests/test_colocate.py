"""A colocated engine process: bucketed weight sync by torch's tensor sharing (shared memory on a CPU,
where a GPU uses CUDA IPC handles), sleep and wake, optimizer offload, and `diffrl train --colocate`
against the embedded default."""

import asyncio
import copy
import itertools
import json
import math
import os
import pickle

import pytest
import torch
from benchmark_scripts import load_benchmark

from diffrl.serving.colocated import ColocatedEngineClient, EngineProcessSpec
from diffrl.engine.engine import Engine
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.weight_sync import (
    ALIGN,
    pack,
    packed_bytes,
    plan_buckets,
    receive_tensor,
    share_tensor,
    unpack,
)
from diffrl.errors import RequestError
from diffrl.models.lora import LoraSpec
from diffrl.models.registry import get_family
from diffrl.rollout.clients import EngineUnavailable
from diffrl.utils.offload import ModuleOffload, OptimizerOffload, family_modules

REQUEST = RolloutRequest(prompt="a red circle", seed=5, num_outputs_per_prompt=2, num_inference_steps=3,
                         guidance_scale=2.0, rollout=True, rollout_sde_step_indices=[0, 1],
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)


def _assert_same_outputs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.seed == y.seed and x.weight_version == y.weight_version
        assert torch.equal(x.generated_output, y.generated_output)
        assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        assert torch.equal(x.dit_trajectory.latents, y.dit_trajectory.latents)


# ---------------------------------------------------------------------------------------------- buckets
def test_buckets_are_bounded_in_order_and_hold_every_tensor_once():
    sizes = [10, 300, 5, 2000, 7, 7, 0, 64, 250, 1]  # float32 elements; 2000 × 4 bytes is above the buffer
    tensors = {f"t{i}": torch.zeros(n) for i, n in enumerate(sizes)}
    buckets = plan_buckets(tensors, 1024)
    assert [name for bucket in buckets for name in bucket] == list(tensors)  # each once, order kept
    for bucket in buckets:
        assert packed_bytes(tensors, bucket) <= 1024 or len(bucket) == 1
    assert ["t3"] in buckets  # the oversize tensor goes alone
    for first, second in itertools.pairwise(buckets):  # greedy: no bucket could have taken the next tensor
        assert packed_bytes(tensors, first + second[:1]) > 1024
    assert plan_buckets(tensors, 10**9) == [list(tensors)]
    assert plan_buckets({}, 1024) == []
    with pytest.raises(ValueError):
        plan_buckets(tensors, 0)


def test_pack_and_unpack_round_trip_mixed_dtypes_through_a_json_layout():
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b": torch.randn(7, generator=gen).bfloat16(),
               "c": torch.arange(5), "d": torch.tensor([True, False, True]), "e": torch.empty(0, 4),
               "f": torch.randn(2, 3, generator=gen).t()}  # not contiguous
    buffer = torch.zeros(packed_bytes(tensors, list(tensors)), dtype=torch.uint8)
    layout = json.loads(json.dumps(pack(tensors, list(tensors), buffer)))
    assert all(entry["offset"] % ALIGN == 0 for entry in layout)
    out = unpack(buffer, layout)
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert out[name].dtype == tensor.dtype and torch.equal(out[name], tensor), name

    def refused(bad_layout, match):
        with pytest.raises(RequestError, match=match) as err:
            unpack(buffer, bad_layout)
        assert err.value.field == "weights"

    refused([{**layout[0], "offset": buffer.numel()}], "outside")
    refused([{**layout[0], "offset": 3}], "offset")
    refused([{**layout[0], "dtype": "complex64"}], "bad layout entry")
    refused([{**layout[0], "shape": [-1]}], "shape")
    refused([layout[0], layout[0]], "repeated")
    refused([{"name": "a"}], "bad layout entry")
    refused({"a": 1}, "list")


def test_only_a_shared_tensor_is_unpickled():
    tensor = torch.arange(6, dtype=torch.float32).share_memory_()
    assert torch.equal(receive_tensor(share_tensor(tensor)), tensor)

    class Payload:
        def __reduce__(self):
            return os.system, ("echo unpickled",)

    for payload in (pickle.dumps(Payload()), pickle.dumps({"weights": 1}), b"not a pickle"):
        with pytest.raises(RequestError, match="shared tensor|not a tensor"):
            receive_tensor(payload)


# ---------------------------------------------------------------------------------------------- the engine process
@pytest.fixture(scope="module")
def model_dir():
    from diffrl.models.demo import SHIPPED_DEMO_MODEL

    return SHIPPED_DEMO_MODEL  # 3 M parameters: 12 buckets of 1 MiB


@pytest.fixture(scope="module")
def colocated(model_dir):
    client = ColocatedEngineClient(EngineProcessSpec(model_path=str(model_dir), family="demo"),
                                   buffer_bytes=2**20)
    yield client
    client.close()
    assert client.process.exitcode == 0


def _generate(client, request=REQUEST):
    return asyncio.run(client.generate(request))


def test_engine_process_receives_full_weights_and_a_lora_adapter_in_buckets(colocated, model_dir):
    """Full weights, then a LoRA adapter (hosted unmerged, only its tensors sent), each in several
    shared-memory buckets: the process then samples exactly what an in-process engine with the same weights does."""
    engine = Engine(get_family("demo").load(model_dir))
    gen = torch.Generator().manual_seed(1)
    full = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=gen)
            for n, p in engine.family.transformer.named_parameters()}
    assert colocated.push_weights(full, version=3) > 1
    engine.update_weights(full, 3)
    _assert_same_outputs(_generate(colocated), engine.generate(REQUEST))
    assert colocated.health()["weight_version"] == 3

    spec = LoraSpec(rank=2, alpha=4.0, target_modules=sorted(engine.family.lora_target_modules))
    assert colocated.add_lora_adapter(spec) is True and colocated.add_lora_adapter(spec) is False
    engine.add_lora_adapter(spec)
    lora = {n: 0.2 * torch.randn(p.shape, generator=gen) for n, p in engine.family.transformer.named_parameters()
            if "lora_" in n}
    colocated.buffer_bytes = 4096  # the adapter is small
    assert colocated.push_weights(lora, version=4) > 1
    engine.update_weights(lora, 4)
    before = _generate(colocated)
    _assert_same_outputs(before, engine.generate(REQUEST))
    assert before[0].weight_version == 4
    with pytest.raises(EngineUnavailable, match="LoRA adapter refused: lora: .*different"):
        colocated.add_lora_adapter(LoraSpec(rank=4, alpha=4.0, target_modules=spec.target_modules))


def test_a_bad_bucket_changes_nothing_and_is_reported(colocated, model_dir):
    before, version = _generate(colocated), colocated.health()["weight_version"]
    family = get_family("demo").load(model_dir)
    # A weight no LoRA adapter wraps, so its name is the same whether or not the engine hosts one.
    name, param = next((n, p) for n, p in family.transformer.named_parameters()
                       if p.dim() == 2 and not any(t in n for t in family.lora_target_modules))
    shape = tuple(param.shape)
    cases = {
        "unknown tensor": {"not.a.weight": torch.zeros(3)},
        "shape": {name: torch.zeros(shape[0] + 1, *shape[1:])},
        "cannot stand for": {name: torch.zeros(shape, dtype=torch.int64)},
        "non-finite": {name: torch.full(shape, math.nan)},
    }
    for match, tensors in cases.items():
        with pytest.raises(EngineUnavailable, match=f"weight bucket 1/1 refused: weights: .*{match}"):
            colocated.push_weights(tensors, version=99)
    # The first of two buckets is refused: the sync stops there and the second is never sent.
    with pytest.raises(EngineUnavailable, match="weight bucket 1/2 refused"):
        colocated.push_weights({name: torch.full(shape, math.inf), "x": torch.zeros(colocated.buffer_bytes)},
                               version=99)
    assert colocated.health()["weight_version"] == version
    _assert_same_outputs(_generate(colocated), before)


def test_sleep_and_wake_round_trip_bit_identical(colocated, tiny_family):
    before = _generate(colocated)
    report = colocated.sleep(2)
    assert report["level"] == 2 and report["moved_bytes"] > 0
    assert report["after"]["allocated"] is None  # a CPU engine: no device memory to report
    with pytest.raises(EngineUnavailable, match="asleep"):
        _generate(colocated)
    with pytest.raises(EngineUnavailable, match="asleep"):
        colocated.push_weights({"x": torch.zeros(1)}, version=1)
    assert colocated.wake()["moved_bytes"] == report["moved_bytes"]
    _assert_same_outputs(_generate(colocated), before)
    assert colocated.sleep(1)["moved_bytes"] == 0 and colocated.wake()["moved_bytes"] == 0
    with pytest.raises(EngineUnavailable, match="sleep refused: level"):
        colocated.sleep(3)


def test_module_offload_moves_every_tensor_and_brings_it_back(tiny_family):
    modules = family_modules(tiny_family)
    assert tiny_family.transformer in modules and tiny_family.text_encoder in modules
    tensors = list({id(t): t for m in modules for t in (*m.parameters(), *m.buffers())}.values())
    saved = [(t.clone(), t.data_ptr()) for t in tensors]
    offload = ModuleOffload(modules, torch.device("cpu"))
    assert offload.offload() == sum(t.numel() * t.element_size() for t in tensors)
    assert all(t.data_ptr() != ptr for t, (_, ptr) in zip(tensors, saved) if t.numel())  # new storage
    assert offload.offload() == 0  # already away
    offload.restore()
    assert all(torch.equal(t, copy) for t, (copy, _) in zip(tensors, saved))


def test_offloaded_optimizer_state_gives_the_same_steps():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    plain, offloaded = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, twin))
    offload = OptimizerOffload(offloaded)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(5, 8, generator=gen)
        moved = offload.offload()  # as around a rollout: away, then back before the update
        state = [v for s in offloaded.state.values() for v in s.values()]
        assert moved == (0 if step == 0 else sum(v.numel() * v.element_size() for v in state))
        offload.restore()
        for m, optimizer in ((model, plain), (twin, offloaded)):
            optimizer.zero_grad()
            m(x).square().mean().backward()
            optimizer.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(plain.state.values(), offloaded.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------------------------------------- the trainer
def test_colocate_flags_parse():
    from diffrl.cli.main import parse

    cfg = parse(["train", "--colocate", "--update-weight-buffer-size", "4096", "--engine-sleep-level", "2",
                 "--offload-optimizer"])
    assert cfg.engine.colocate and cfg.engine.update_weight_buffer_size == 4096
    assert cfg.engine.engine_sleep_level == 2 and cfg.optim.offload_optimizer
    with pytest.raises(ValueError, match="--load-rollout-data trains without engines"):
        cfg.replace(load_rollout_data="records").check()


@pytest.mark.parametrize("use_lora", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_train_colocate_equals_the_embedded_default(tiny_model_dir, tmp_path, use_lora):
    """Two rollouts with an update between them: the colocated engine process (weights in small buckets,
    asleep with its weights on the host while the trainer trains, the optimizer state offloaded while it
    samples) gives the run the embedded engine gives, metric for metric, to the final weights."""
    from test_trainer import _records, tiny_config

    from diffrl.train.trainer import Trainer

    flags = {"num_rollout": 2, "eval_images_per_category": 0, "checkpoint_interval": 10, "use_lora": use_lora,
             "lora_rank": 2}
    embedded = Trainer(tiny_config(tiny_model_dir, tmp_path / "embedded", **flags))
    embedded.train()
    trainer = Trainer(tiny_config(tiny_model_dir, tmp_path / "colocated", colocate=True, offload_optimizer=True,
                                  engine_sleep_level=2, update_weight_buffer_size=4096, **flags))
    trainer.train()
    assert trainer.colocated.process.exitcode == 0  # stopped at the end of the run
    timing = ("seconds", "per_s", "elapsed")
    released = "memory/engine_released_gib"  # what the engine's sleep gave the device (0 on a CPU), colocated only
    colocated = _records(tmp_path / "colocated")
    assert [r[released] for r in colocated if "rollout/reward/raw_mean" in r] == [0.0, 0.0]
    for a, b in zip(_records(tmp_path / "embedded"), colocated, strict=True):
        assert {k: v for k, v in a.items() if not any(t in k for t in timing)} == \
               {k: v for k, v in b.items() if not any(t in k for t in timing) and k != released}
    for a, b in zip(embedded.policy.params, trainer.policy.params, strict=True):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_weight_sync_benchmark_runs_on_a_cpu(tmp_path, monkeypatch):
    """benchmarks/weight_sync.py's CPU fallback on the shipped demo model: both paths sync both modes, the
    engine samples the same after waking, and the report is written."""
    module = load_benchmark("weight_sync", monkeypatch)
    results = module.main(["--device", "cpu", "--lora-rank", "2", "--buffer-mib", "1", "--repeats", "1", "--n", "1",
                           "--steps", "2", "--out", str(tmp_path / "weight_sync.json")])
    for mode in ("lora", "full"):
        entry = results["modes"][mode]
        assert entry["ipc_1MiB"]["buckets"] >= 1 and entry["http"]["seconds"] > 0
        assert [r["level"] for r in entry["sleep"]] == [1, 2, 2]
        assert all(r["bit_identical_after_wake"] for r in entry["sleep"])
    assert results["modes"]["full"]["optimizer_offload"]["moved_bytes"] > 0
    assert json.loads((tmp_path / "weight_sync.json").read_text())["family"] == "demo"
