"""A request abandoned inside a shared denoising batch (cancelled, or past its deadline) leaves the batch
before the next step: it is answered with `RequestCancelled` at once, its rows are not computed again,
and the batch's other requests get exactly the outputs they would have had without it (per-output
generators; bit-identical on CPU), in process and over HTTP."""

import asyncio
import dataclasses
import json
import socket
import threading
import time

import httpx
import pytest
import torch

from diffrl.engine.engine import Engine, EngineConfig, RequestCancelled
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.serving.wire import decode_outputs

STEPS = 5
SDE = {"rollout": True, "rollout_noise_level": 0.7, "rollout_sde_step_indices": [0, 2, 3],
       "rollout_return_dit_trajectory": True}
REQUESTS = [  # (prompt, negative prompt, seed, outputs): three requests of one batch, rows 0-1, 2-4, 5-6
    ("a red circle", "", 5, 2), ("two blue squares", "blurry", 40, 3), ("a green triangle", "dark", 90, 2)]
CASES = {  # settings, and {step: [(request, how)]}: abandoned while that step is computed
    "cfg-sde": ({"guidance_scale": 3.0, "rollout_sde_type": "sde", "rollout_return_denoising_env": True, **SDE},
                {0: [(1, "cancel")]}),
    "cfg-ode": ({"guidance_scale": 3.0, "rollout_return_denoising_env": True, "rollout_return_dit_trajectory": True,
                 "rollout_return_step_indices": [0, 2, 5]},
                {1: [(0, "deadline")], 3: [(2, "cancel")]}),
    "nocfg-cps": ({"guidance_scale": 1.0, "rollout_sde_type": "cps", **SDE}, {2: [(0, "cancel")]}),
    "nocfg-ode": ({"guidance_scale": 1.0}, {0: [(2, "deadline")], 1: [(1, "cancel")]}),
}


def _requests(settings: dict) -> list[RolloutRequest]:
    return [RolloutRequest(prompt=p, negative_prompt=neg, seed=seed, num_outputs_per_prompt=n,
                           num_inference_steps=STEPS, **settings) for p, neg, seed, n in REQUESTS]


def _one_batch(family, monkeypatch, requests, drops: dict[int, list[tuple[int, str]]]):
    """`requests` denoised as one batch, in order; during step s each (request, how) of `drops[s]` is abandoned.
    Returns the results, the batch size of every velocity call, and whether each abandoned request was
    already answered when the next step began."""
    engine = Engine(family, EngineConfig(max_outputs_per_request=8, max_batch_outputs=8, worker_threads=1,
                                         batch_wait_s=0.2))
    events = [threading.Event() for _ in requests]
    batches, sizes, answered, pending = [], [], {}, []
    run_batch, velocity = engine._run_batch, family.velocity_and_uncond

    def record_batch(batch):
        batches.append(batch)
        run_batch(batch)

    def counted(transformer, latents, *args, **kwargs):
        for k in pending:
            answered[k] = batches[0][k].result.done()
        pending.clear()
        for k, how in drops.get(len(sizes), []):
            if how == "cancel":
                events[k].set()
            else:
                batches[0][k].deadline = 0.0
            pending.append(k)
        sizes.append(latents.tokens.shape[0])
        return velocity(transformer, latents, *args, **kwargs)

    monkeypatch.setattr(engine, "_run_batch", record_batch)
    monkeypatch.setattr(family, "velocity_and_uncond", counted)

    async def together():
        return await asyncio.gather(*(engine.agenerate(r, e) for r, e in zip(requests, events)), return_exceptions=True)

    results = asyncio.run(together())
    assert [[t.req for t in b] for b in batches] == [requests]  # one batch, in arrival order
    assert engine.in_flight == 0
    return results, sizes, answered


def _same(got, want) -> None:
    """Equal outputs: every tensor bit for bit (timings aside)."""
    if dataclasses.is_dataclass(got):
        for f in dataclasses.fields(got):
            if f.name not in ("inference_time_s", "peak_memory_mb"):
                _same(getattr(got, f.name), getattr(want, f.name))
    elif isinstance(got, list):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    elif isinstance(got, dict):
        assert got.keys() == want.keys()
        for key in got:
            _same(got[key], want[key])
    elif isinstance(got, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want)
    else:
        assert got == want


@pytest.mark.parametrize("case", CASES)
def test_live_requests_are_unchanged_and_the_abandoned_rows_stop_within_one_step(tiny_family, monkeypatch, case):
    settings, drops = CASES[case]
    requests = _requests(settings)
    expected, full_sizes, _ = _one_batch(tiny_family, monkeypatch, requests, {})
    assert full_sizes == [7] * STEPS
    results, sizes, answered = _one_batch(tiny_family, monkeypatch, requests, drops)

    # Velocity calls per step: an abandoned request's rows are computed for the step under way, never again.
    rows, want_sizes = [n for *_, n in REQUESTS], []
    for step in range(STEPS):
        want_sizes.append(sum(rows))
        for k, _ in drops.get(step, []):
            rows[k] = 0
    assert sizes == want_sizes
    gone = {k: how for step_drops in drops.values() for k, how in step_drops}
    assert answered == dict.fromkeys(gone, True)  # answered before the next step, not at the end of the batch
    for k, result in enumerate(results):
        if k in gone:
            assert isinstance(result, RequestCancelled)
            assert ("went away" if gone[k] == "cancel" else "request_timeout_s") in result.reason
        else:
            assert len(result) == REQUESTS[k][3]
            _same(result, expected[k])
            assert (result[0].denoising_env is not None) == bool(settings.get("rollout_return_denoising_env"))
    live = [r for k, r in enumerate(results) if k not in gone]
    if settings.get("rollout_sde_type") in ("sde", "cps"):
        assert all(o.rollout_log_probs.abs().sum() > 0 for r in live for o in r)


def test_a_batch_whose_requests_all_leave_stops(tiny_family, monkeypatch):
    results, sizes, _ = _one_batch(tiny_family, monkeypatch, _requests({"guidance_scale": 3.0}),
                                   {0: [(1, "cancel")], 1: [(0, "cancel"), (2, "deadline")]})
    assert sizes == [7, 4]
    assert all(isinstance(r, RequestCancelled) for r in results)


def test_the_server_keeps_answering_exactly_after_a_batchmate_left(tiny_family, monkeypatch):
    """Over HTTP: a client that goes away mid-batch loses its rows at the next step; the request it shared
    the batch with is answered with exactly its samples, and so is the next one."""
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8, max_batch_outputs=8))
    settings = {"num_inference_steps": 8, "guidance_scale": 3.0, "rollout": True, "rollout_sde_type": "sde",
                "rollout_noise_level": 0.7, "rollout_sde_step_indices": [1, 2]}
    staying = {"prompt": "a red circle", "seed": 7, "num_outputs_per_prompt": 2, **settings}
    leaving = {**staying, "prompt": "two blue squares", "seed": 40, "num_outputs_per_prompt": 3}
    expected = engine.generate(RolloutRequest(**staying))
    velocity, sizes = tiny_family.velocity_and_uncond, []

    def slow(transformer, latents, *args, **kwargs):  # time to leave while both requests are denoised
        sizes.append(latents.tokens.shape[0])
        time.sleep(0.1 if sizes[-1] == 5 else 0)
        return velocity(transformer, latents, *args, **kwargs)

    monkeypatch.setattr(tiny_family, "velocity_and_uncond", slow)
    compact = {"accept": "application/msgpack"}
    with serving_in_thread(create_app(engine)) as url:
        host, port = url.removeprefix("http://").split(":")
        body = json.dumps(leaving).encode()
        head = (f"POST /rollout/generate HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        answers = []
        stays = threading.Thread(target=lambda: answers.append(
            httpx.post(f"{url}/rollout/generate", json=staying, headers=compact, timeout=60)))
        deadline = time.monotonic() + 30
        with socket.create_connection((host, int(port))) as client:
            with engine._model_lock:  # the model is busy until both requests wait: they share one batch
                client.sendall(head + body)
                while engine.in_flight == 0 and time.monotonic() < deadline:
                    time.sleep(0.005)
                stays.start()
                while engine.in_flight < 2 and time.monotonic() < deadline:
                    time.sleep(0.005)
            while len(sizes) < 2 and time.monotonic() < deadline:  # both are being denoised
                time.sleep(0.005)
        stays.join()  # the leaving client has closed its connection
        assert sizes[0] == 5 and sizes[-1] == 2 and len(sizes) == 8, sizes  # its rows left mid-batch
        assert answers[0].status_code == 200, answers[0].text
        for got, want in zip(decode_outputs(answers[0].content), expected, strict=True):
            assert torch.equal(got.generated_output, want.generated_output)
            assert torch.equal(got.rollout_log_probs, want.rollout_log_probs)
        again = httpx.post(f"{url}/rollout/generate", json={**staying, "seed": 8, "num_outputs_per_prompt": 1},
                           headers=compact, timeout=60)  # the second sample of `staying`, alone
        assert again.status_code == 200, again.text
        assert torch.equal(decode_outputs(again.content)[0].generated_output, expected[1].generated_output)
        assert engine.in_flight == 0
