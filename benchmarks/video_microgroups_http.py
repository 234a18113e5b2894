"""Microgroup size M for a video family over HTTP, with responses streamed to the scorer or not.

miles-diffusion runs LTX-2.3 with 8 samples per prompt in microgroups of 1, "because a multi-output video
response stops overlapping with scoring". This measures that claim on `diffrl serve`'s engine: one engine
behind HTTP on loopback, a rollout of G prompts × n samples through `RolloutManager` and `HttpEngineClient`
at each microgroup size M, with a scorer of stated cost, streaming on (the server writes each body as it
sends it, the client hands each output to the scorer as it lands: `RolloutManager(stream_scoring=...)`) and off
(the body is built, sent, read whole, then scored as one batch per microgroup). Per M and mode: rollout wall
seconds, seconds to the first scored sample, scoring seconds and the part of them hidden under engine work
(the engine's batches, timed on the server: denoising and decoding), and the seconds left after the engine's
last batch (transfer, decoding, scoring).

    # CPU, the tiny random LTX-2.3 built in code:
    python benchmarks/video_microgroups_http.py --tiny --device cpu --checkpoint /tmp/ltx2-tiny \\
        --num-frames 33 --steps 4 --prompts 2 --scorer sleep:0.25 --out results/video_microgroups_http_cpu.json
    # GPU, the real-size random LTX-2.3: scripts/device/bench_video.sh with JOBS="http:ltx2:1:57"

The engine denoises each request alone (`--max-batch-outputs 1`: the LTX-2.3 recipe runs in deterministic
mode, which sets it, and sglang-diffusion runs one request at a time), so M = 1 requests finish one by one
and an M = 8 request all at once; every microgroup is in flight from the start (`--engine-concurrency`,
default n × G). All configurations use the same group indices, so they make the same videos (compared by a
fingerprint per sample; equal on CPU).

Scorers (`--scorer`): `sleep:S` waits S seconds per sample, one call at a time, without using the CPU (a
reward model on another device or server); any `diffrl.rewards.get_reward` name, e.g.
`temporal_consistency`, runs for real (in the event loop, as a synchronous reward does in training).

`--response-frames F ...` also measures one response per frame count and M with the engine's outputs
replayed (so only writing the body is timed): body bytes, seconds to the first byte and to the last, and
the server process's peak RSS above its resident set before the response, streamed and built
(`--server process`, the default). `real_size_bytes` in the JSON: LTX-2.3's response sizes at real size,
computed from its shapes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch

BENCHMARKS = Path(__file__).resolve().parent


# ---------------------------------------------------------------------------- sizes
def response_bytes(*, pixels: int, latent_tokens: int, latent_width: int, text_tokens: int, text_width: int,
                   id_values: int, steps: int, sde_steps: list[int], m: int) -> dict:
    """Bytes of one rollout response of `m` outputs (float32 everywhere, as the engine returns them), from the
    shapes: each output's video (`pixels` values) and trajectory rows (`latent_tokens` × `latent_width`), the
    conditioning (`text_tokens` × `text_width` prompt states, `id_values` position ids) once per request in the
    compact format and on every record in sglang's JSON (base64: × 4/3), and the trajectory rows each format
    returns (compact: each SDE step and the one after; JSON: every step and the final latent). Headers, keys
    and the small tensors are left out (< 2 KB per output)."""
    video, row = 4 * pixels, 4 * latent_tokens * latent_width
    env = 4 * (text_tokens * text_width + text_tokens + id_values)
    compact_rows = len({j for i in sde_steps for j in (i, i + 1)})
    per_compact = video + compact_rows * row + 4 * len(sde_steps)
    per_json = math.ceil((video + (steps + 1) * row + env + 4 * steps) * 4 / 3)
    return {"outputs": m, "video_per_output": video, "trajectory_row": row, "conditioning": env,
            "compact": m * per_compact + env, "sglang_json": m * per_json}


def ltx23_real_size_bytes(frames: int, height: int, width: int, steps: int, sde_steps: list[int], m: int) -> dict:
    """`response_bytes` for LTX-2.3 at its real size (`random_checkpoints.ltx2.real()`): 128-wide video tokens
    (32× in space, 8× in time), 25 audio tokens per second of 24 fps video beside them, 1,024 text tokens of
    4,096 (video) + 2,048 (audio) connector channels, 6 position values per video token."""
    video_tokens = ((frames - 1) // 8 + 1) * (height // 32) * (width // 32)
    audio_tokens = round(frames / 24.0 * 25.0)
    return response_bytes(pixels=3 * frames * height * width, latent_tokens=video_tokens + audio_tokens,
                          latent_width=128, text_tokens=1024, text_width=4096 + 2048, id_values=6 * video_tokens,
                          steps=steps, sde_steps=sde_steps, m=m)


# ---------------------------------------------------------------------------- intervals
def union(intervals) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted((s, e) for s, e, *_ in intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def measure(intervals) -> float:
    return sum(e - s for s, e in intervals)


def overlap(a, b) -> float:
    """Seconds covered by both unions of intervals."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# ---------------------------------------------------------------------------- the scorer
class TimedScorer:
    """The rollout's reward, with every call timed: `sleep:S` (S seconds per sample, one call at a time, no
    CPU) or a `diffrl.rewards` reward. Also a fingerprint of each video, to check every configuration made the
    same ones."""

    def __init__(self, spec: str, device: str | None):
        self.spec = spec
        self.per_sample = float(spec.removeprefix("sleep:")) if spec.startswith("sleep:") else None
        if self.per_sample is None:
            from diffrl.rewards import get_reward

            self.fn = get_reward(spec, device=device)
        self.reset()

    def reset(self) -> None:
        self.calls: list[tuple[float, float, int]] = []
        self.fingerprints: dict[tuple[int, int], float] = {}
        self._lock = None  # made in the rollout's event loop

    def __call__(self, images, prompts, metadata):
        flat = images.reshape(images.shape[0], -1)
        prints = flat[:, ::max(1, flat.shape[1] // 4096)].double().sum(1).tolist()
        for meta, value in zip(metadata, prints):
            self.fingerprints[(meta["group_index"], meta["sample_index"])] = value
        if self.per_sample is not None:
            return self._sleep(len(prompts))
        start = time.monotonic()
        rewards = self.fn(images, prompts, metadata)
        if inspect.isawaitable(rewards):
            return self._timed(start, rewards, len(prompts))
        self.calls.append((start, time.monotonic(), len(prompts)))
        return rewards

    async def _sleep(self, n: int) -> list[float]:
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            start = time.monotonic()
            await asyncio.sleep(self.per_sample * n)
            self.calls.append((start, time.monotonic(), n))
        return [0.0] * n

    async def _timed(self, start: float, rewards, n: int) -> list[float]:
        rewards = await rewards
        self.calls.append((start, time.monotonic(), n))
        return rewards


# ---------------------------------------------------------------------------- the server
def load_family(args):
    from diffrl.models import resolve_family

    dtype = getattr(torch, args.dtype)
    return resolve_family(args.family, args.checkpoint).load(args.checkpoint, device=torch.device(args.device),
                                                             dtype=dtype)


def bench_apps(args) -> dict:
    """Two apps on one engine, streaming on and off, each with /bench routes: the engine's batches
    (monotonic start and end), the process's memory (peak RSS since the last call, which resets it), and
    replaying the engine's outputs for a repeated request."""
    from diffrl.engine.engine import Engine, EngineConfig
    from diffrl.serving.server import create_app, trim_malloc_heap

    engine = Engine(load_family(args), EngineConfig(max_outputs_per_request=max(args.n_samples, 64),
                                                    max_batch_outputs=args.max_batch_outputs))
    batches: list[tuple[float, float, int]] = []
    run_batch, agenerate = engine._run_batch, engine.agenerate
    replay: dict = {"on": False, "outputs": {}}

    def timed_batch(batch):
        start = time.monotonic()
        try:
            run_batch(batch)
        finally:
            batches.append((start, time.monotonic(), sum(t.req.num_outputs_per_prompt for t in batch)))

    async def replayed(req, cancel=None):
        if not replay["on"]:
            return await agenerate(req, cancel)
        key = req.model_dump_json()
        if key not in replay["outputs"]:
            replay["outputs"][key] = await agenerate(req, cancel)
        return replay["outputs"][key]

    engine._run_batch, engine.agenerate = timed_batch, replayed
    apps = {}
    for mode, streaming in (("stream", True), ("built", False)):
        app = apps[mode] = create_app(engine, stream_responses=streaming)

        @app.get("/bench/batches")
        def _batches(since: float = 0.0) -> list:
            return [b for b in batches if b[1] >= since]

        @app.get("/bench/memory")
        def _memory() -> dict:
            status = _proc_status()
            trim_malloc_heap()
            rss = _proc_status()["VmRSS"]
            with contextlib.suppress(OSError):  # resets the peak (VmHWM) to the resident set now
                Path("/proc/self/clear_refs").write_text("5")
            return {"peak_mb": status["VmHWM"] / 1024, "rss_mb": rss / 1024}

        @app.get("/bench/replay")
        def _replay(on: int) -> dict:
            replay["on"] = bool(on)
            replay["outputs"].clear()
            return {"on": replay["on"]}
    return apps


def _proc_status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            fields[name] = int(value.split()[0])
    return fields


def serve_main(args) -> None:
    """The server process: both apps on free loopback ports, their URLs in `--ready-file`, until stdin closes."""
    from diffrl.serving.server import limit_malloc_arenas, serving_in_thread

    limit_malloc_arenas(2)  # as `diffrl serve` does
    with contextlib.ExitStack() as stack:
        urls = {mode: stack.enter_context(serving_in_thread(app)) for mode, app in bench_apps(args).items()}
        ready = Path(args.ready_file)
        ready.with_suffix(".tmp").write_text(json.dumps(urls))
        ready.with_suffix(".tmp").rename(ready)
        sys.stdin.read()
    os._exit(0)


@contextlib.contextmanager
def engine_server(args, argv: list[str]):
    """URLs of the two apps: in this process (`--server thread`) or in a subprocess started with this script's
    own arguments (`--server process`)."""
    if args.server == "thread":
        from diffrl.serving.server import serving_in_thread

        with contextlib.ExitStack() as stack:
            yield {mode: stack.enter_context(serving_in_thread(app)) for mode, app in bench_apps(args).items()}
        return
    with tempfile.TemporaryDirectory() as folder:
        ready = Path(folder) / "ready.json"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCHMARKS.parent), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.Popen([sys.executable, __file__, *argv, "--serve", "--ready-file", str(ready)],
                                stdin=subprocess.PIPE, env=env)
        try:
            deadline = time.monotonic() + args.server_start_timeout_s
            while not ready.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the engine server did not start (exit code {proc.poll()})")
                time.sleep(0.2)
            yield json.loads(ready.read_text())
        finally:
            with contextlib.suppress(OSError):
                proc.stdin.close()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def get_json(url: str, path: str):
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return json.loads(response.read())
    finally:
        connection.close()


# ---------------------------------------------------------------------------- rollouts
def request_fields(args) -> dict:
    fields = {"num_inference_steps": args.steps, "rollout": True, "rollout_sde_type": args.sde_type,
              "rollout_noise_level": args.noise_level, "rollout_sde_step_indices": args.sde_steps,
              "rollout_log_prob_no_const": True, "rollout_return_dit_trajectory": True,
              "rollout_return_denoising_env": True, "guidance_scale": args.guidance_scale}
    for name in ("height", "width", "num_frames"):
        if getattr(args, name) is not None:
            fields[name] = getattr(args, name)
    return fields


def one_rollout(urls: dict, args, m: int, streaming: bool, scorer: TimedScorer, prompts: list[str]) -> dict:
    from diffrl.rollout import HttpEngineClient, RolloutManager, RolloutSettings

    url = urls["stream" if streaming else "built"]
    concurrency = args.engine_concurrency or args.n_samples * len(prompts)
    client = HttpEngineClient(url, stream=streaming, max_in_flight=concurrency, wire_format=args.wire_format,
                              family=args.family)
    manager = RolloutManager([client], RolloutSettings(
        n_samples_per_prompt=args.n_samples, rollout_microgroup_size=m, rollout_seed=args.seed), reward_fn=scorer,
        engine_concurrency=concurrency, stream_scoring=streaming)
    scorer.reset()
    start = time.monotonic()
    try:
        groups = asyncio.run(manager.rollout(prompts, request_fields(args)))
    finally:
        client.close()
    end = time.monotonic()
    batches = get_json(url, f"/bench/batches?since={start}")
    scoring, busy = union(scorer.calls), union(b for b in batches if b[0] >= start - 1e-3)
    scoring_s, hidden_s = measure(scoring), overlap(scoring, busy)
    samples = sum(len(g) for g in groups)
    return {
        "microgroup": m, "streaming": streaming, "samples": samples, "requests": manager.last_stats.requests,
        "wall_s": end - start, "samples_per_s": samples / (end - start),
        "first_scored_s": min(e for _, e, _ in scorer.calls) - start,
        "scoring_s": scoring_s, "scoring_hidden_s": hidden_s,
        "overlap": hidden_s / scoring_s if scoring_s else None,
        "engine_busy_s": measure(busy), "engine_batches": len(batches),
        "after_engine_s": end - max(e for _, e in busy) if busy else None,
        "scorer_batches": sorted({n for _, _, n in scorer.calls}),
        "fingerprints": {f"{g},{k}": v for (g, k), v in sorted(scorer.fingerprints.items())},
    }


# ---------------------------------------------------------------------------- responses
def time_response(url: str, fields: dict, compact: bool) -> dict:
    """One request's body read and dropped: bytes, seconds to the response head, to the first body bytes,
    and to the last."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=3600)
    body = json.dumps(fields).encode()
    headers = {"content-type": "application/json", "accept": "application/msgpack" if compact else "application/json"}
    try:
        start = time.monotonic()
        connection.request("POST", "/rollout/generate", body=body, headers=headers)
        response = connection.getresponse()
        head, first, size = time.monotonic(), None, 0
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}: {response.read()[:300]!r}")
        while chunk := response.read1(4 << 20):
            first = first or time.monotonic()
            size += len(chunk)
        end = time.monotonic()
    finally:
        connection.close()
    return {"bytes": size, "head_s": head - start, "first_byte_s": (first or end) - start, "last_byte_s": end - start}


def measure_responses(urls: dict, args) -> list[dict]:
    rows = []
    get_json(urls["stream"], "/bench/replay?on=1")
    try:
        for frames in args.response_frames:
            for m in args.microgroups:
                fields = {**request_fields(args), "num_frames": frames, "prompt": "a red cat running in the rain",
                          "seed": 1, "num_outputs_per_prompt": m}
                for fmt in args.response_formats:
                    compact = fmt == "compact"
                    time_response(urls["stream"], fields, compact)  # generates the outputs (kept for replay)
                    for mode in ("built", "stream"):
                        before = get_json(urls[mode], "/bench/memory")
                        timing = time_response(urls[mode], fields, compact)
                        after = get_json(urls[mode], "/bench/memory")
                        rows.append({"num_frames": frames, "microgroup": m, "format": fmt,
                                     "streaming": mode == "stream", **timing,
                                     "server_rss_before_mb": before["rss_mb"],
                                     "server_peak_above_mb": after["peak_mb"] - before["rss_mb"]})
                        print(json.dumps(rows[-1]), flush=True)
    finally:
        get_json(urls["stream"], "/bench/replay?on=0")
    return rows


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", default="ltx2", choices=["ltx2", "wan2_2", "cosmos3"])
    parser.add_argument("--checkpoint", type=Path, required=True, help="built here first when missing")
    parser.add_argument("--tiny", action="store_true", help="build the family's tiny random checkpoint (CPU)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                        help="default: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--height", type=int, default=None, help="default: the family's")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--num-frames", type=int, default=None)
    parser.add_argument("--steps", type=int, default=24, help="denoising steps (LTX-2.3's recipe: 24)")
    parser.add_argument("--sde-steps", type=int, nargs="+", default=[1, 4, 7],
                        help="steps that inject noise (the recipe draws 3 in steps 0-9)")
    parser.add_argument("--sde-type", default="cps")
    parser.add_argument("--noise-level", type=float, default=0.8)
    parser.add_argument("--guidance-scale", type=float, default=1.0)
    parser.add_argument("--prompts", type=int, default=1, help="prompt groups per rollout (G)")
    parser.add_argument("--n-samples", type=int, default=8, help="samples per prompt (LTX-2.3's recipe: 8)")
    parser.add_argument("--microgroups", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--streaming", nargs="+", default=["on", "off"], choices=["on", "off"])
    parser.add_argument("--repeats", type=int, default=1, help="rounds over every configuration (medians)")
    parser.add_argument("--scorer", default="temporal_consistency",
                        help="sleep:SECONDS_PER_SAMPLE or a diffrl reward name")
    parser.add_argument("--scorer-device", default="cpu")
    parser.add_argument("--wire-format", default="compact", choices=["compact", "sglang"])
    parser.add_argument("--max-batch-outputs", type=int, default=1)
    parser.add_argument("--engine-concurrency", type=int, default=None, help="default: every microgroup at once")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server", default="process", choices=["process", "thread"])
    parser.add_argument("--server-start-timeout-s", type=float, default=1200.0)
    parser.add_argument("--stop-by", type=float, default=None,
                        help="unix time: no configuration starts that would end later (by the longest so far)")
    parser.add_argument("--response-frames", type=int, nargs="*", default=[],
                        help="also time single responses at these frame counts (server process only)")
    parser.add_argument("--response-formats", nargs="+", default=["compact"], choices=["compact", "sglang"])
    parser.add_argument("--skip-rollouts", action="store_true", help="only --response-frames")
    parser.add_argument("--out", default=None)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def main(argv: list[str] | None = None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.serve:
        return serve_main(args)
    if args.response_frames and args.server != "process":
        raise SystemExit("--response-frames measures the server's memory: it needs --server process")
    if not args.checkpoint.exists():
        sys.path.insert(0, str(BENCHMARKS))
        from family_rollout import make_checkpoint

        make_checkpoint(args.family, args.checkpoint, torch.device(args.device), tiny=args.tiny)
    scorer = TimedScorer(args.scorer, args.scorer_device)
    prompts = [f"a red cat running in the rain, take {g}" for g in range(args.prompts)]
    report = {"settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                           if k not in ("serve", "ready_file")},
              "started": time.strftime("%Y-%m-%d %H:%M:%S"), "rollouts": [], "stopped": None}
    steps, sde = args.steps, args.sde_steps
    report["real_size_bytes"] = {f"ltx23 {f}x512x768 M={m}": ltx23_real_size_bytes(f, 512, 768, steps, sde, m)
                                 for f in (57, 121) for m in (1, 8)}

    def save() -> None:
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    with engine_server(args, argv) as urls:
        start = time.monotonic()
        one_rollout(urls, argparse.Namespace(**{**vars(args), "n_samples": 1}), 1, True, scorer, prompts[:1])
        report["warmup_s"] = time.monotonic() - start
        longest = 0.0
        configurations = [(r, m, mode == "on") for r in range(args.repeats) for m in args.microgroups
                          for mode in args.streaming]
        for repeat, m, streaming in [] if args.skip_rollouts else configurations:
            if args.stop_by is not None and time.time() + longest > args.stop_by:
                report["stopped"] = f"before M={m} streaming={streaming} (repeat {repeat}): --stop-by"
                break
            row = {"repeat": repeat, **one_rollout(urls, args, m, streaming, scorer, prompts)}
            longest = max(longest, row["wall_s"])
            report["rollouts"].append(row)
            report["summary"] = summary(report["rollouts"])
            print(json.dumps({k: v for k, v in row.items() if k != "fingerprints"}), flush=True)
            save()
        if args.response_frames:
            report["responses"] = measure_responses(urls, args)
    prints = [row.pop("fingerprints") for row in report["rollouts"]]
    report["same_samples_in_every_configuration"] = all(p == prints[0] for p in prints)
    if prints:
        first = prints[0]
        report["largest_fingerprint_difference"] = max(
            (abs(p[k] - first[k]) for p in prints for k in first if k in p), default=0.0)
    save()
    print(table(report))
    return report


SUMMARY = ("wall_s", "first_scored_s", "scoring_s", "scoring_hidden_s", "overlap", "engine_busy_s", "after_engine_s")


def summary(rows: list[dict]) -> list[dict]:
    """Per microgroup size and mode, the median of each timing over the repeats."""
    out = {}
    for row in rows:
        out.setdefault((row["microgroup"], row["streaming"]), []).append(row)
    return [{"microgroup": m, "streaming": streaming, "runs": len(runs),
             **{k: statistics.median(r[k] or 0.0 for r in runs) for k in SUMMARY}}
            for (m, streaming), runs in out.items()]


def table(report: dict) -> str:
    lines = ["| M | streaming | wall s | first scored s | scoring s | hidden under engine | engine busy s | "
             "after engine s |", "|---|---|---|---|---|---|---|---|"]
    for row in report.get("summary", []):
        lines.append(f"| {row['microgroup']} | {'on' if row['streaming'] else 'off'} | {row['wall_s']:.2f} | "
                     f"{row['first_scored_s']:.2f} | {row['scoring_s']:.2f} | {100 * row['overlap']:.0f}% | "
                     f"{row['engine_busy_s']:.2f} | {row['after_engine_s']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
