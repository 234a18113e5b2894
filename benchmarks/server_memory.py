"""`diffrl serve`'s resident memory under bursts of concurrent requests (CPU, the shipped demo model).

Starts `diffrl serve` in a subprocess, sends `--bursts` bursts of `--concurrency` concurrent
`/rollout/generate` requests (one output, `--steps` steps, each its own seed), and reads the server's
RSS (/proc/<pid>/status) at start (after one warm-up request), after each burst, and at the end.
The claim checked: the final RSS stays within 2× of the start. `--malloc-arena-max 0` runs the server
with glibc's default arenas, for comparison.

    .venv/bin/python benchmarks/server_memory.py [--bursts 10] [--concurrency 256] [--malloc-arena-max 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def burst(url: str, n: int, steps: int, offset: int) -> int:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        async def one(i: int) -> int:
            r = await client.post(f"{url}/rollout/generate", json={"prompt": "a red circle", "seed": offset + i,
                                                                   "num_inference_steps": steps})
            return r.status_code
        codes = await asyncio.gather(*(one(i) for i in range(n)))
    return sum(c == 200 for c in codes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bursts", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--malloc-arena-max", type=int, default=2)
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    server = subprocess.Popen([sys.executable, "-m", "diffrl.cli.main", "serve", "--device", "cpu", "--port", str(port),
                               "--malloc-arena-max", str(args.malloc_arena_max)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline or server.poll() is not None:
                raise SystemExit("server did not start")
            time.sleep(0.5)
        asyncio.run(burst(url, 1, args.steps, 0))  # warm-up: first forward, allocator steady
        start = rss_mb(server.pid)
        print(f"malloc_arena_max={args.malloc_arena_max} start RSS {start:.0f} MB")
        t0 = time.time()
        for b in range(args.bursts):
            ok = asyncio.run(burst(url, args.concurrency, args.steps, b * args.concurrency))
            print(f"burst {b + 1}: {ok}/{args.concurrency} ok, RSS {rss_mb(server.pid):.0f} MB", flush=True)
        end = rss_mb(server.pid)
        print(f"end RSS {end:.0f} MB = {end / start:.2f}x start ({time.time() - t0:.0f} s for "
              f"{args.bursts} x {args.concurrency} requests)")
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
