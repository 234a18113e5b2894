"""The rollout manager against instrumented fake engines: cap, routing, streaming, order, retries."""

import asyncio
import time

import pytest
import torch

from diffrl.engine.protocol import RolloutOutput
from diffrl.errors import RequestError
from diffrl.rollout import EngineUnavailable, RolloutManager, RolloutSettings


class FakeEngine:
    """Answers after `delay(request)` seconds; records concurrency across all fakes of a test."""

    def __init__(self, name, tracker, delay=lambda req: 0.02, fail_times=0):
        self.name, self.tracker, self.delay, self.fail_times = name, tracker, delay, fail_times
        self.requests = []

    async def generate(self, request):
        self.tracker["now"] += 1
        self.tracker["max"] = max(self.tracker["max"], self.tracker["now"])
        self.requests.append(request)
        try:
            await asyncio.sleep(self.delay(request))
            if self.fail_times > 0:
                self.fail_times -= 1
                raise EngineUnavailable(f"{self.name} died")
            self.tracker["finished"].append((time.perf_counter(), request.seed))
            return [RolloutOutput(seed=request.seed + i, generated_output=torch.full((3, 2, 2), float(request.seed + i)),
                                  rollout_log_probs=None, dit_trajectory=None, denoising_env=None, weight_version=0,
                                  inference_time_s=0.0, peak_memory_mb=0.0) for i in range(request.num_outputs_per_prompt)]
        finally:
            self.tracker["now"] -= 1


def _tracker():
    return {"now": 0, "max": 0, "finished": []}


def test_in_flight_cap_is_never_exceeded():
    tracker = _tracker()
    engines = [FakeEngine(f"e{i}", tracker) for i in range(3)]
    manager = RolloutManager(engines, RolloutSettings(n_samples_per_prompt=8, rollout_microgroup_size=1), engine_concurrency=2)
    groups = asyncio.run(manager.rollout([f"p{i}" for i in range(6)]))  # 48 requests
    assert tracker["max"] == 6  # 2 × 3 engines: reached, never exceeded
    assert sum(len(e.requests) for e in engines) == 48
    assert [len(g) for g in groups] == [8] * 6


def test_routing_prefers_the_least_loaded_engine():
    tracker = _tracker()
    slow = FakeEngine("slow", tracker, delay=lambda req: 0.3)
    fast = FakeEngine("fast", tracker, delay=lambda req: 0.01)
    manager = RolloutManager([slow, fast], RolloutSettings(n_samples_per_prompt=12, rollout_microgroup_size=1),
                             engine_concurrency=2)
    asyncio.run(manager.rollout(["p"]))
    # The slow engine holds its 2 slots for the whole run; every other request goes to the fast one.
    assert len(slow.requests) == 2 and len(fast.requests) == 10
    assert manager.in_flight() == [0, 0]


def test_scoring_starts_before_the_last_microgroup_finishes_and_order_is_kept():
    tracker = _tracker()
    # Later microgroups finish first (reverse delays), to check the result order does not follow finish order.
    engine = FakeEngine("e", tracker, delay=lambda req: 0.05 + 0.02 * (15 - req.seed % 16))
    scored_at = []

    async def reward(images, prompts, meta):
        scored_at.append(time.perf_counter())
        return [float(img.mean()) for img in images]

    manager = RolloutManager([engine], RolloutSettings(n_samples_per_prompt=16, rollout_microgroup_size=4, rollout_seed=0),
                             reward_fn=reward, engine_concurrency=4)
    groups = asyncio.run(manager.rollout(["a", "b"]))
    last_finish = max(t for t, _ in tracker["finished"])
    assert min(scored_at) < last_finish  # streamed: the first microgroup was scored while others ran
    for g, group in enumerate(groups):
        assert [s.sample_index for s in group] == list(range(16))
        assert [s.seed for s in group] == [g * 16 + k for k in range(16)]
        assert [s.reward for s in group] == [float(s.seed) for s in group]
        assert all(s.prompt == "ab"[g] for s in group)


def test_group_index_sets_the_seeds_across_rollouts():
    tracker = _tracker()
    manager = RolloutManager([FakeEngine("e", tracker)], RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=1,
                                                                       rollout_seed=10), engine_concurrency=1)
    first = asyncio.run(manager.rollout(["a", "b"], first_group_index=0))
    second = asyncio.run(manager.rollout(["c"], first_group_index=2))  # a new event loop, as a training loop calls it
    assert [g[0].group_index for g in first + second] == [0, 1, 2]
    assert second[0][0].seed == 10 + 2 * 4


def test_a_dead_engine_costs_a_retry_not_a_sample():
    tracker = _tracker()
    flaky = FakeEngine("flaky", tracker, fail_times=100)
    healthy = FakeEngine("healthy", tracker)
    manager = RolloutManager([flaky, healthy], RolloutSettings(n_samples_per_prompt=4, rollout_microgroup_size=1),
                             engine_concurrency=1)
    groups = asyncio.run(manager.rollout(["p"]))
    assert [s.seed for s in groups[0]] == [0, 1, 2, 3]
    assert all(s.engine == "healthy" for s in groups[0])
    assert manager.last_stats.retries >= 1


def test_a_refused_request_is_not_retried():
    class Refusing(FakeEngine):
        async def generate(self, request):
            self.requests.append(request)
            raise RequestError("height", "no")

    tracker = _tracker()
    a, b = Refusing("a", tracker), Refusing("b", tracker)
    manager = RolloutManager([a, b], RolloutSettings(n_samples_per_prompt=1, rollout_microgroup_size=1))
    with pytest.raises(RequestError, match="height"):
        asyncio.run(manager.rollout(["p"]))
    assert len(a.requests) + len(b.requests) == 1
