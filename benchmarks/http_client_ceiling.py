"""The most images per second one rollout client takes in over HTTP, whatever the engines' speed.

Issue 6's engine-scaling run topped out near 930 NFT images/s with two engine servers whatever
their queue, and Flow-GRPO (bigger responses) scaled worst; what the engines share is the client
process (the rollout manager: it sends every request and reads and decodes every response). This
measures that client alone: K stand-in servers answer each `/rollout/generate` at once with the
bytes of a real response of the same kind (made once by the shipped demo model's engine, on the
CPU), so the client's throughput is all that is timed.

    python benchmarks/http_client_ceiling.py --kind nft --engines 1 2 --groups 64
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing
import socket
import time

import httpx
import uvicorn
from fastapi import FastAPI, Response
from report import emit
from rollout_timing import REQUESTS, add_scaling_args, record_engines, rollout_seconds

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.wire import MEDIA_TYPE, decode_outputs, encode_outputs
from diffrl.models import resolve_family
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rollout import HttpEngineClient


def canned_response(kind: str, n: int) -> bytes:
    """The wire bytes of one real response of `n` outputs for this kind of rollout request."""
    family = resolve_family(None, SHIPPED_DEMO_MODEL).load(SHIPPED_DEMO_MODEL, device="cpu")
    engine = Engine(family, EngineConfig(max_outputs_per_request=n))
    request = RolloutRequest(prompt="three red squares", seed=0, num_outputs_per_prompt=n, **REQUESTS[kind])
    return encode_outputs(engine.generate(request))


def serve_canned(body: bytes, port: int) -> None:
    app = FastAPI()

    @app.post("/rollout/generate")
    async def generate() -> Response:
        return Response(content=body, media_type=MEDIA_TYPE)

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
    raise TimeoutError(f"stand-in server on port {port} did not come up")


def sequential_ms(port: int, repeats: int = 60) -> dict[str, float]:
    """Milliseconds per request, one at a time, through httpx's async and blocking clients and the
    standard library's `http.client`: what reading one response costs each of them."""
    url = f"http://127.0.0.1:{port}"
    result = {}
    with httpx.Client(base_url=url) as client:
        start = time.perf_counter()
        for _ in range(repeats):
            client.post("/rollout/generate", json={}).read()
        result["httpx_blocking"] = (time.perf_counter() - start) / repeats * 1e3

    async def async_loop() -> float:
        async with httpx.AsyncClient(base_url=url) as client:
            start = time.perf_counter()
            for _ in range(repeats):
                await (await client.post("/rollout/generate", json={})).aread()
            return (time.perf_counter() - start) / repeats * 1e3

    result["httpx_async"] = asyncio.run(async_loop())
    connection = http.client.HTTPConnection("127.0.0.1", port)
    start = time.perf_counter()
    for _ in range(repeats):
        connection.request("POST", "/rollout/generate", body=b"{}", headers={"content-type": "application/json"})
        connection.getresponse().read()
    result["http_client"] = (time.perf_counter() - start) / repeats * 1e3
    connection.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    add_scaling_args(parser, kind="nft", groups=64)
    args = parser.parse_args()
    body = canned_response(args.kind, args.m)
    start = time.perf_counter()
    for _ in range(20):
        decode_outputs(body)
    decode_ms = (time.perf_counter() - start) / 20 * 1e3
    results = {"kind": args.kind, "groups": args.groups, "n": args.n, "m": args.m, "concurrency": args.concurrency,
               "response_bytes": len(body), "bytes_per_image": len(body) / args.m, "decode_ms_per_response": decode_ms,
               "images_per_s": {}}
    print(f"{args.kind}: {len(body) / 1e6:.2f} MB per response of {args.m} outputs", flush=True)
    spawn = multiprocessing.get_context("spawn")
    for k in args.engines:
        ports = [free_port() for _ in range(k)]
        servers = [spawn.Process(target=serve_canned, args=(body, port), daemon=True) for port in ports]
        for server in servers:
            server.start()
        try:
            for port in ports:
                wait_healthy(port)
            if k == 1:
                results["sequential_ms_per_response"] = sequential_ms(ports[0])
                print("one at a time, ms per response:", {n: round(v, 1) for n, v in
                                                          results["sequential_ms_per_response"].items()}, flush=True)
            clients = [HttpEngineClient(f"http://127.0.0.1:{port}") for port in ports]
            seconds = rollout_seconds(clients, REQUESTS[args.kind], args.groups, args.n, args.m, args.concurrency,
                                      args.repeats)
        finally:
            for server in servers:
                server.terminate()
                server.join(timeout=10)
        record_engines(results, k, seconds, args.groups * args.n)
        print(f"  = {results['images_per_s'][k] * results['bytes_per_image'] / 1e6:.0f} MB/s into the client",
              flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
