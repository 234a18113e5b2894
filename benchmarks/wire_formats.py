"""What sglang compatibility costs: the JSON rollout format against diffrl's compact msgpack one.

Two measures, on the shipped demo model (CPU is enough; the formats' costs do not depend on the GPU):
- client intake: images/s `HttpEngineClient` decodes from one response body of each format (the
  trainer's side of the wire), and the server's encoding time and the body size;
- end to end: one rollout request after another to `diffrl serve` (uvicorn on loopback, in this
  process) through `HttpEngineClient` asking for each format: seconds per request, images/s.

    python benchmarks/wire_formats.py --outputs 16 --steps 10 --rounds 5 --out results.json
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from report import emit

from diffrl.serving import sglang
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.serving.wire import decode_outputs, encode_outputs
from diffrl.models import resolve_family
from diffrl.models.demo import SHIPPED_DEMO_MODEL
from diffrl.rollout import HttpEngineClient


def flow_grpo_request(outputs: int, steps: int) -> RolloutRequest:
    """A Flow-GRPO microgroup: SDE on a window of two steps, trajectory and conditioning returned."""
    return RolloutRequest(prompt="a blue square to the left of a yellow circle", seed=0, num_outputs_per_prompt=outputs,
                          num_inference_steps=steps, guidance_scale=3.0, rollout=True,
                          rollout_sde_step_indices=[2, 3], rollout_return_dit_trajectory=True,
                          rollout_return_denoising_env=True)


def median_seconds(fn, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=int, default=16, help="outputs per request")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="also write the results (JSON) here")
    args = parser.parse_args()

    family = resolve_family(None, SHIPPED_DEMO_MODEL).load(SHIPPED_DEMO_MODEL, device="cpu")
    family_cls = type(family)
    engine = Engine(family, EngineConfig(max_outputs_per_request=args.outputs))
    request = flow_grpo_request(args.outputs, args.steps)
    n = args.outputs

    compact_outputs = engine.generate(request)
    json_outputs = engine.generate(sglang.engine_request(request))
    compact_body = encode_outputs(compact_outputs)
    json_body = sglang.encode_response(json_outputs, request, family, "bench")
    results: dict = {"outputs_per_request": n, "steps": args.steps, "sde_steps": 2}
    for name, body, encode, decode in (
        ("compact", compact_body, lambda: encode_outputs(compact_outputs), lambda: decode_outputs(compact_body)),
        ("sglang_json", json_body, lambda: sglang.encode_response(json_outputs, request, family, "bench"),
         lambda: sglang.decode_response(json_body, request, family_cls)),
    ):
        decode_s = median_seconds(decode, args.rounds)
        results[name] = {"body_mb": len(body) / 1e6, "server_encode_ms": 1e3 * median_seconds(encode, args.rounds),
                         "client_decode_ms": 1e3 * decode_s, "client_intake_images_per_s": n / decode_s}

    with serving_in_thread(create_app(engine)) as url:
        for name, wire_format in (("compact", "compact"), ("sglang_json", "sglang")):
            client = HttpEngineClient(url, wire_format=wire_format)
            try:
                asyncio.run(client.generate(request))  # warm: connection, family lookup
                seconds = median_seconds(lambda c=client: asyncio.run(c.generate(request)), args.rounds)
            finally:
                client.close()
            results[name].update(http_rollout_s_per_request=seconds, http_rollout_images_per_s=n / seconds)
    results["engine_only_s_per_request"] = median_seconds(lambda: engine.generate(request), args.rounds)
    emit(results, args.out)


if __name__ == "__main__":
    main()
