"""Rollout throughput with K engine servers, one per GPU (issue 6: two engines >= 1.8x one).

For each K, starts K `diffrl serve` processes (server i sees only GPU i through
CUDA_VISIBLE_DEVICES), routes whole rollouts across them with the rollout manager over HTTP, and
prints images/s and the ratio to K = 1. This is the single-machine, no-Ray placement; the same
measure through Ray actors is `benchmarks/ray_engines.py`.

    python benchmarks/http_engines.py --engines 1 2 --device cuda --groups 64 --n 16 --m 16 --kind nft
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx
from report import emit
from rollout_timing import REQUESTS, add_scaling_args, record_engines, rollout_seconds

from diffrl.rollout import HttpEngineClient


def start_servers(k: int, device: str, port: int, max_batch_outputs: int) -> list[subprocess.Popen]:
    servers = []
    for i in range(k):
        env = dict(os.environ)
        if device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(i)
        servers.append(subprocess.Popen(
            [sys.executable, "-m", "diffrl.cli.main", "serve", "--device", device, "--port", str(port + i),
             "--max-batch-outputs", str(max_batch_outputs)], env=env,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    deadline = time.time() + 180
    for i, server in enumerate(servers):
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"engine server {i} exited: {server.stderr.read().decode()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{port + i}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise TimeoutError(f"engine server {i} did not come up in 180 s")
            time.sleep(0.5)
    return servers


def main() -> None:
    parser = argparse.ArgumentParser()
    add_scaling_args(parser, kind="nft", groups=64)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-batch-outputs", type=int, default=512)
    parser.add_argument("--port", type=int, default=31000)
    args = parser.parse_args()
    results = {"device": args.device, "kind": args.kind, "groups": args.groups, "n": args.n, "m": args.m,
               "concurrency": args.concurrency, "max_batch_outputs": args.max_batch_outputs, "images_per_s": {}}
    for k in args.engines:
        servers = start_servers(k, args.device, args.port, args.max_batch_outputs)
        try:
            clients = [HttpEngineClient(f"http://127.0.0.1:{args.port + i}", max_in_flight=args.concurrency)
                       for i in range(k)]
            seconds = rollout_seconds(clients, REQUESTS[args.kind], args.groups, args.n, args.m,
                                      args.concurrency, args.repeats)
        finally:
            for server in servers:
                server.terminate()
            for server in servers:
                server.wait(timeout=30)
        record_engines(results, k, seconds, args.groups * args.n)
    emit(results, args.out)


if __name__ == "__main__":
    main()
