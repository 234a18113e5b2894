"""Property-based fuzzing of every `diffrl serve` endpoint (hypothesis, seeded, CI-sized): whatever
arrives, the answer is never a 5xx, and a fixed-seed sample is bit-identical before and after.

The engine's limits are set small, so that every request it accepts is cheap; the strategies mix
valid values, boundary values and hostile ones (NaN, huge numbers, lone surrogates, bytes that are
not UTF-8, unknown fields, wrong dtypes, foreign headers)."""

import json
import math
import os

import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.serving.server import create_app
from diffrl.serving.wire import decode_outputs

FUZZ = dict(deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
# A generation case runs the model; an update case is cheap. DIFFRL_FUZZ_SCALE=N runs N times as many
# cases (the CI size is 1; `DIFFRL_FUZZ_SCALE=17 pytest tests/test_server_fuzz.py` is over 5,000 requests).
SCALE = int(os.environ.get("DIFFRL_FUZZ_SCALE", "1"))
GENERATION_CASES, UPDATE_CASES = 110 * SCALE, 200 * SCALE
SAMPLE = {"prompt": "a red circle", "seed": 3, "num_inference_steps": 2, "rollout": True,
          "rollout_return_dit_trajectory": True}

floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 1.0, 4.0, 1e308, -1.0]))
ints = st.one_of(st.integers(-3, 70), st.sampled_from([2**63 - 1, 2**63, -(2**63), 10**30, 0]))
texts = st.one_of(st.text(max_size=40), st.sampled_from(["\ud800", "\udfff x", "\x00", "a red circle", "x" * 300]))
# Values a JSON body can carry (Python's json writes NaN/Infinity and lone surrogates as escapes).
values = st.one_of(st.none(), st.booleans(), ints, floats, texts, st.lists(ints, max_size=6),
                   st.dictionaries(texts, ints, max_size=3))


def mostly(valid, hostile, odds=12):
    """One draw in `odds` hostile, the rest from values the engine accepts: with some twenty fields per
    request, accepted requests get fuzzed too, not only the refusals."""
    return st.integers(1, odds).flatmap(lambda i: hostile if i == 1 else valid)


prompts = mostly(st.sampled_from(["a red circle", "two blue squares", "", "x" * 150]), texts)
steps = st.lists(st.integers(0, 1), max_size=2, unique=True)
ROLLOUT_FIELDS = {
    "negative_prompt": mostly(st.sampled_from([None, "", "blurry"]), texts), "seed": mostly(st.integers(0, 2**63 - 1), ints),
    "num_outputs_per_prompt": mostly(st.integers(1, 4), ints),
    "width": mostly(st.sampled_from([None, 64]), st.sampled_from([0, -1, 16, 65, 10**9])),
    "height": mostly(st.sampled_from([None, 64]), st.sampled_from([0, 4096, 1.5])),
    "num_frames": mostly(st.sampled_from([None, 1]), ints), "fps": mostly(st.sampled_from([None, 8]), ints),
    "num_inference_steps": mostly(st.integers(1, 2), ints),
    "guidance_scale": mostly(st.one_of(st.none(), st.floats(0, 6)), floats),
    "guidance_scale_2": mostly(st.none(), floats), "true_cfg_scale": mostly(st.none(), floats),
    "generator_device": mostly(st.sampled_from([None, "cpu", "cuda", "device"]), st.sampled_from(["tpu", "\ud800"])),
    "rollout": st.one_of(st.none(), st.booleans()), "rollout_sde_type": mostly(st.sampled_from(["sde", "cps", "ode"]), texts),
    "rollout_noise_level": mostly(st.floats(0, 1.5), floats),
    "rollout_sde_step_indices": mostly(st.one_of(st.none(), steps), st.lists(ints, max_size=5)),
    "rollout_return_step_indices": mostly(st.one_of(st.none(), steps), st.lists(ints, max_size=5)),
    "rollout_return_denoising_env": st.booleans(), "rollout_return_dit_trajectory": st.booleans(),
    "rollout_log_prob_no_const": st.booleans(), "rollout_debug_mode": st.booleans(), "suppress_logs": st.booleans(),
    "extra_sampling_params": st.one_of(st.none(), st.dictionaries(st.sampled_from(
        ["guidance_scale", "seed", "prompt", "eta", "num_inference_steps", "\udc00"]), values, max_size=2)),
    "image_path": mostly(st.none(), st.lists(texts, max_size=2)), "image": mostly(st.none(), texts),
}
IMAGE_FIELDS = {"n": mostly(st.integers(1, 4), ints), "size": mostly(st.sampled_from([None, "64x64"]),
                                                                     st.one_of(texts, st.sampled_from(["0x0", "１x1"]))),
                "seed": mostly(st.integers(0, 2**63 - 1), ints), "negative_prompt": prompts,
                "num_inference_steps": mostly(st.integers(1, 2), ints),
                "guidance_scale": mostly(st.one_of(st.none(), st.floats(0, 6)), floats),
                "response_format": mostly(st.just("b64_json"), texts), "model": st.one_of(st.none(), texts)}


def _objects(fields: dict):
    """Mostly schema-shaped objects (a random subset of the fields, sometimes an unknown one); sometimes
    any JSON value at all."""
    # The request's defaults (10 steps) are above the fuzz engine's work limit: steps are mostly sent.
    required = ({"prompt": prompts, "num_inference_steps": fields["num_inference_steps"]}
                if "num_inference_steps" in fields else {})
    optional = {k: v for k, v in fields.items() if k not in required}
    shaped = st.fixed_dictionaries(required, optional=optional).flatmap(
        lambda d: mostly(st.just(d), st.dictionaries(texts, values, max_size=2).map(lambda extra: {**d, **extra})))
    return mostly(shaped, values, odds=6)


def _encode(obj) -> bytes:
    return json.dumps(obj, allow_nan=True).encode()


raw_bodies = st.one_of(st.binary(max_size=64), st.sampled_from([b"", b"{", b'{"prompt": NaN}', b"\xff\xfe\x00",
                                                                b'{"prompt": "\\ud800"}', b"[]", b"null"]))
content_types = st.sampled_from(["application/json", "text/plain", "application/octet-stream", "", "application/json; charset=latin-1"])
accepts = st.sampled_from([None, "application/msgpack", "*/*", "application/json;q=0.1, application/msgpack"])


def _app(tiny_family):
    # Small limits: every request the engine accepts costs a few tiny forwards.
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=4, max_output_steps=8, max_batch_outputs=4,
                                              batch_wait_s=0, max_prompt_chars=200, max_lora_rank=4))
    return engine, TestClient(create_app(engine), base_url="http://127.0.0.1", raise_server_exceptions=False)


def _sample(client) -> list[torch.Tensor]:
    response = client.post("/rollout/generate", json=SAMPLE, headers={"accept": "application/msgpack"})
    assert response.status_code == 200, response.text
    out = decode_outputs(response.content)[0]
    return [out.generated_output, out.rollout_log_probs, out.dit_trajectory.latents]


def _no_5xx(response):
    assert response.status_code < 500, (response.status_code, response.text[:300])
    if response.status_code >= 400:  # a refusal names what it refuses, on one line
        error = response.json()["error"]
        assert error["field"] and "\n" not in error["message"]


def _post(client, path, body, kind, accept=None):
    headers = {"content-type": kind} if kind else {}
    if accept:
        headers["accept"] = accept
    return client.post(path, content=body, headers=headers)


def test_fuzz_generation_endpoints(tiny_family):
    _, client = _app(tiny_family)
    before = _sample(client)

    @settings(max_examples=GENERATION_CASES, **FUZZ)
    @given(path=st.sampled_from(["/rollout/generate", "/v1/images/generations"]), data=st.data(), accept=accepts)
    def case(path, data, accept):
        fields = ROLLOUT_FIELDS if path == "/rollout/generate" else IMAGE_FIELDS
        if data.draw(st.integers(0, 9)) == 0:
            body, kind = data.draw(raw_bodies), data.draw(content_types)
        else:
            body, kind = _encode(data.draw(_objects(fields))), "application/json"
        _no_5xx(_post(client, path, body, kind, accept))

    case()
    for path in ("/health", "/health_generate", "/docs", "/openapi.json", "/nowhere"):
        _no_5xx(client.get(path))
    after = _sample(client)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def _weight_updates(names_shapes):
    """Safetensors bodies: the model's own values (so an accepted update changes nothing) in various
    dtypes, or values that must be refused, or unknown names and wrong shapes."""
    def build(draw):
        name, param = draw(st.sampled_from(names_shapes))
        kind = draw(st.sampled_from(["same", "float64", "float16_exact", "huge", "nan", "int8", "bool", "shape", "name"]))
        value = param.detach().clone()
        tensor = {"same": value, "float64": value.double(),
                  "float16_exact": value.half().float() if torch.equal(value.half().float(), value) else value,
                  "huge": torch.full_like(value, 1e300, dtype=torch.float64),
                  "nan": value.masked_fill(torch.rand_like(value) < 0.5, math.nan),
                  "int8": torch.ones_like(value, dtype=torch.int8), "bool": torch.ones_like(value, dtype=torch.bool),
                  "shape": torch.zeros(value.numel() + 1), "name": value}[kind]
        return {(f"{name}.nope" if kind == "name" else name): tensor}
    return st.composite(lambda draw: build(draw))()


def test_fuzz_state_changing_endpoints(tiny_family):
    engine, client = _app(tiny_family)
    before = _sample(client)
    state = {k: v.clone() for k, v in engine.family.transformer.state_dict().items()}
    names_shapes = list(engine.family.transformer.named_parameters())
    targets = sorted(engine.family.lora_target_modules)
    lora_fields = {"rank": mostly(st.sampled_from([2, 4]), st.one_of(ints, st.sampled_from([5, 16384]))),
                   "alpha": mostly(st.floats(0.5, 8), floats),
                   "target_modules": mostly(st.lists(st.sampled_from(targets), min_size=1, max_size=3),
                                            st.one_of(st.lists(st.sampled_from([*targets, "nope", "", "\ud800"]),
                                                               max_size=3), values))}
    versions = st.one_of(st.none(), st.integers(0, 2**63 - 1).map(str),
                         st.sampled_from(["100000000000000000000000", "-1", "1.5", "", "0x10", str(2**63)]))
    hosts = mostly(st.sampled_from([None, "127.0.0.1:1", "localhost", "[::1]:80"]), st.sampled_from(["evil.example", ""]))
    origins = mostly(st.none(), st.sampled_from(["http://evil.example", "null"]))

    @settings(max_examples=UPDATE_CASES, **FUZZ)
    @given(which=st.sampled_from(["weights", "lora"]), data=st.data(), host=hosts, origin=origins)
    def case(which, data, host, origin):
        headers = {k: v for k, v in (("host", host), ("origin", origin)) if v is not None}
        draw_raw = data.draw(st.integers(0, 9)) == 0
        if which == "weights":
            body = data.draw(raw_bodies) if draw_raw else save(data.draw(_weight_updates(names_shapes)))
            headers["content-type"] = data.draw(st.sampled_from(["application/octet-stream"] * 4 + ["text/plain", ""]))
            if (version := data.draw(versions)) is not None:
                headers["x-weight-version"] = version
            response = client.post("/update_weights", content=body, headers=headers)
        else:
            spec = st.fixed_dictionaries({}, optional=lora_fields)
            body = data.draw(raw_bodies) if draw_raw else _encode(data.draw(mostly(spec, _objects(lora_fields))))
            headers["content-type"] = data.draw(st.sampled_from(["application/json"] * 4 + ["text/plain"]))
            response = client.post("/lora_adapter", content=body, headers=headers)
        _no_5xx(response)

    case()
    after = _sample(client)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    current = engine.family.transformer.state_dict()
    for name, value in state.items():  # base weights as they were (a hosted adapter renames them base_layer)
        key = name if name in current else name.replace(".weight", ".base_layer.weight").replace(
            ".bias", ".base_layer.bias")
        assert torch.equal(current[key], value), name


def _encoded_sources() -> list[bytes]:
    """One 64x64 picture (the editing demo model's source size) in every mode and format Pillow writes here, plus
    other sizes, an animated GIF and a PNG whose header claims 100,000² pixels: what mutations start from."""
    import io
    import struct
    import zlib

    import numpy as np
    from PIL import Image

    picture = Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    sources = []
    for mode in ("RGB", "L", "LA", "P", "RGBA", "CMYK", "I", "F", "1", "I;16"):
        for fmt in ("PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP", "PPM", "TGA", "ICO"):
            buffer = io.BytesIO()
            try:
                picture.convert(mode).save(buffer, format=fmt)
            except (OSError, ValueError, KeyError):  # a mode the format cannot hold
                continue
            sources.append(buffer.getvalue())
    for size in ((1, 1), (1, 4096), (63, 64), (2048, 2049)):
        buffer = io.BytesIO()
        Image.new("RGB", size).save(buffer, format="PNG")
        sources.append(buffer.getvalue())
    frames = [Image.new("P", (64, 64), i) for i in range(3)]
    buffer = io.BytesIO()
    frames[0].save(buffer, format="GIF", save_all=True, append_images=frames[1:])
    header = b"IHDR" + struct.pack(">IIBBBBB", 100_000, 100_000, 8, 2, 0, 0, 0)
    bomb = b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + header + struct.pack(">I", zlib.crc32(header))
    return [*sources, buffer.getvalue(), bomb, b"", b"not an image"]


@st.composite
def _hostile_image(draw, sources):
    """An encoded source as it is, or with bytes overwritten, cut short, lengthened or cut out."""
    data = bytearray(draw(st.sampled_from(sources)))
    kind = draw(st.sampled_from(["as is", "overwrite", "truncate", "append", "cut"]))
    if kind == "overwrite" and data:
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    elif kind == "truncate":
        data = data[:draw(st.integers(0, max(0, len(data) - 1)))]
    elif kind == "append":
        data += draw(st.binary(min_size=1, max_size=64))
    elif kind == "cut" and data:
        start = draw(st.integers(0, len(data) - 1))
        data = data[:start] + data[start + draw(st.integers(1, 32)):]
    return bytes(data)


def test_fuzz_condition_images_of_an_editing_model():
    """Hostile condition images (every mode and format Pillow writes, mutated; wrong sizes; a decompression bomb's
    header) sent as data: URLs to the editing demo model: each is served or refused by name, never a 5xx, and a
    fixed-seed edit is bit-identical before and after. `DIFFRL_FUZZ_SCALE=8` sends 880 (passed on a 2-core CPU, 49 s,
    2026-12-07)."""
    import base64

    from diffrl.assets import SHIPPED_EDIT_MODEL
    from diffrl.models.registry import resolve_family

    family = resolve_family(None, SHIPPED_EDIT_MODEL).load(SHIPPED_EDIT_MODEL)
    engine = Engine(family, EngineConfig(max_outputs_per_request=2, max_output_steps=4, batch_wait_s=0))
    client = TestClient(create_app(engine), base_url="http://127.0.0.1", raise_server_exceptions=False)
    sources = _encoded_sources()

    def edit(data: bytes):
        body = {"prompt": "make the square green", "seed": 1, "num_inference_steps": 1, "rollout": True,
                "image_path": ["data:image/png;base64," + base64.b64encode(data).decode()]}
        return client.post("/rollout/generate", json=body, headers={"accept": "application/msgpack"})

    def sample():
        response = edit(sources[0])
        assert response.status_code == 200, response.text
        return decode_outputs(response.content)[0].generated_output

    before = sample()
    codes = set()

    @settings(max_examples=GENERATION_CASES, **FUZZ)
    @given(data=_hostile_image(sources))
    def case(data):
        response = edit(data)
        codes.add(response.status_code)
        _no_5xx(response)

    case()
    assert codes >= {200, 400}  # the strategy reaches both the decodable and the refused
    assert torch.equal(before, sample())
