"""sglang-diffusion's wire format: the server's default answer, the negotiated compact fast path,
every sglang request field, and diffrl's client reading sglang responses (built here by an encoder
written from sglang's public description, not by diffrl's) into outputs a trainer can replay."""

import asyncio
import base64
import json

import pytest
import torch
from fastapi import FastAPI, Request
from fastapi.responses import Response
from fastapi.testclient import TestClient
from safetensors.torch import save

from diffrl.algorithms.pairs import grpo_pairs
from diffrl.serving import sglang
from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread, wants_compact
from diffrl.serving.wire import WireFormatError, decode_outputs
from diffrl.models.base import Latents, PromptEmbeds
from diffrl.models.demo import DemoFamily
from diffrl.rollout import HttpEngineClient
from diffrl.sampling import transition

STEPS = 4
ROLLOUT = dict(num_inference_steps=STEPS, guidance_scale=3.0, rollout=True, rollout_sde_step_indices=[1, 2],
               rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
# Every field of sglang-diffusion's RolloutRequest (Rockdu/sglang 0372158dd,
# entrypoints/post_training/io_struct.py), with values a miles-diffusion recipe sends.
SGLANG_REQUEST = dict(prompt="a red circle", negative_prompt=" ", seed=11, generator_device="cuda", width=64,
                      height=64, num_inference_steps=STEPS, num_outputs_per_prompt=2, guidance_scale=3.0,
                      true_cfg_scale=None, num_frames=None, fps=None, rollout=True, rollout_sde_type="sde",
                      rollout_noise_level=0.7, rollout_log_prob_no_const=False, rollout_debug_mode=False,
                      rollout_return_denoising_env=True, rollout_return_dit_trajectory=True,
                      rollout_sde_step_indices=None, rollout_return_step_indices=None, image_path=None,
                      suppress_logs=True, extra_sampling_params=None)
ENV_KEYS = ("prompt_embeds", "negative_prompt_embeds", "text_ids", "negative_text_ids", "image_ids")


@pytest.fixture
def engine(tiny_family):
    return Engine(tiny_family, EngineConfig(max_outputs_per_request=8))


def _same(a, b, *, timesteps=True):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.seed == y.seed
        assert torch.equal(x.generated_output, y.generated_output)
        assert (x.rollout_log_probs is None) == (y.rollout_log_probs is None)
        if x.rollout_log_probs is not None:
            assert torch.equal(x.rollout_log_probs, y.rollout_log_probs)
        names = ("latents", "sigmas", "latent_step_indices") + (("timesteps",) if timesteps else ())
        for name in names:
            assert torch.equal(getattr(x.dit_trajectory, name), getattr(y.dit_trajectory, name)), name
        assert (x.denoising_env is None) == (y.denoising_env is None)
        for key in ENV_KEYS if x.denoising_env is not None else ():
            assert torch.equal(x.denoising_env[key], y.denoising_env[key]), key


def test_server_answers_sglang_json_by_default_and_msgpack_when_asked_with_the_same_tensors(engine):
    client = TestClient(create_app(engine))
    body = dict(prompt="two blue squares", seed=5, num_outputs_per_prompt=3, **ROLLOUT)
    default = client.post("/rollout/generate", json=body)
    compact = client.post("/rollout/generate", json=body, headers={"accept": "application/msgpack"})
    assert default.headers["content-type"] == "application/json"
    assert compact.headers["content-type"] == "application/msgpack"
    records = default.json()
    assert len(records) == 3 and len({r["request_id"] for r in records}) == 1
    first = records[0]
    assert [r["seed"] for r in records] == [5, 5, 5]  # sglang reports the request's seed; output i drew seed + i
    assert first["generated_output"]["shape"] == [3, 1, 64, 64] and first["generated_output"]["dtype"] == "torch.float32"
    log_probs = sglang.tensor_from_json(first["rollout_log_probs"], "log_probs")
    assert log_probs.shape == (STEPS,) and log_probs[0] == 0 and log_probs[3] == 0 and log_probs[1] != 0
    trajectory = first["dit_trajectory"]
    assert trajectory["latents"]["shape"][0] == STEPS + 1  # every step and the final latent
    assert trajectory["timesteps"]["shape"] == [STEPS] and trajectory["sigmas"]["shape"] == [STEPS + 1]
    assert all(r["denoising_env"] == first["denoising_env"] for r in records)  # on every record
    assert set(first["denoising_env"]) == {"image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"}
    pos = first["denoising_env"]["pos_cond_kwargs"]
    assert isinstance(pos["encoder_hidden_states"], list) and pos["txt_seq_lens"] == [16]

    request = RolloutRequest(**body)
    in_process = engine.generate(request)
    _same(sglang.decode_response(default.content, request, DemoFamily), in_process)
    _same(decode_outputs(compact.content), in_process)
    # The full trajectory (JSON) holds what the compact path returns, at the same steps.
    full = sglang.tensor_from_json(trajectory["latents"], "latents")
    assert torch.equal(full[[1, 2, 3]], in_process[0].dit_trajectory.latents)


@pytest.mark.parametrize("accept,compact", [
    (None, False), ("*/*", False), ("application/json", False), ("application/msgpack", True),
    ("application/msgpack, application/json;q=0.5", True), ("application/json, application/msgpack;q=0.2", False),
    ("application/msgpack;q=0", False), ("application/msgpack, */*", True),
])
def test_accept_negotiation(accept, compact):
    assert wants_compact(accept) is compact


def test_every_sglang_request_field_is_accepted_and_unknown_ones_are_refused_by_name(engine):
    assert set(SGLANG_REQUEST) <= set(RolloutRequest.model_fields)
    client = TestClient(create_app(engine))
    ok = client.post("/rollout/generate", json=SGLANG_REQUEST)
    assert ok.status_code == 200 and len(ok.json()) == 2
    unknown = client.post("/rollout/generate", json={**SGLANG_REQUEST, "cfg_truncation": 0.5})
    assert unknown.status_code == 422 and "cfg_truncation" in unknown.text
    extra = client.post("/rollout/generate", json={**SGLANG_REQUEST, "extra_sampling_params": {"eta": 1.0}})
    assert extra.status_code == 422 and "extra_sampling_params.eta" in extra.text
    device = client.post("/rollout/generate", json={**SGLANG_REQUEST, "generator_device": "tpu"})
    assert device.status_code == 400 and device.json()["error"]["field"] == "generator_device"
    refused = client.post("/rollout/generate", json={**SGLANG_REQUEST, "image_path": ["cat.png"]})
    assert refused.status_code == 400 and refused.json()["error"]["field"] == "image_path"
    # sglang-diffusion accepts true_cfg_scale on every model: on a family without true CFG it switches CFG on or off.
    true_cfg = client.post("/rollout/generate", json={**SGLANG_REQUEST, "true_cfg_scale": 4.0})
    assert true_cfg.status_code == 200 and len(true_cfg.json()) == 2
    below = client.post("/rollout/generate", json={**SGLANG_REQUEST, "true_cfg_scale": 4.0, "guidance_scale": 0.5})
    assert below.status_code == 400 and below.json()["error"]["field"] == "guidance_scale"
    assert client.get("/health").json()["in_flight"] == 0
    assert client.get("/health_generate").status_code == 200


def test_sglang_fields_mean_what_they_mean_there(tiny_family):
    """extra_sampling_params override top-level fields; sglang's nulls are diffrl's defaults; generator_device
    "cuda" on a CPU engine is the engine's device; true_cfg_scale is the CFG scale of a true-CFG family."""
    class TrueCfgDemo(DemoFamily):
        has_true_cfg = True

    family = TrueCfgDemo(tiny_family.config, tiny_family.transformer, tiny_family.text_encoder, tiny_family.tokenizer,
                         batch_invariant=False)  # the transformer is batch-invariant already
    engine = Engine(family)
    base = dict(prompt="a red circle", seed=3, num_inference_steps=2, rollout=True)

    def image(**fields):
        return engine.generate(RolloutRequest(**{**base, **fields}))[0].generated_output

    reference = image(guidance_scale=2.0)
    assert torch.equal(image(guidance_scale=1.0, extra_sampling_params={"guidance_scale": 2.0}), reference)
    assert torch.equal(image(guidance_scale=1.0, true_cfg_scale=2.0), reference)
    assert torch.equal(image(guidance_scale=2.0, generator_device="cuda"), reference)
    assert torch.equal(image(guidance_scale=2.0, generator_device="cpu", negative_prompt=None), reference)
    assert not torch.equal(image(guidance_scale=1.0), reference)


# ---------------------------------------------------------------------------- a stand-in sglang server
def _b64_tensor(t):
    """sglang's tensor encoding, as its post-training utils describe it."""
    t = t.detach().contiguous().cpu()
    return {"__tensor__": True, "data": base64.b64encode(save({"t": t})).decode(), "shape": list(t.shape),
            "dtype": str(t.dtype)}


def _sglang_stand_in(engine, *, with_sigmas=True):
    """A server answering `/rollout/generate` as sglang-diffusion does, written from its description and not
    with diffrl's encoder: every step's latents and the final one, one log-prob per step (0 on ODE steps),
    timesteps σ·1000, cond kwargs (sglang's names, FLUX-style position ids) and the image [C, 1, H, W] on
    every record, the request's seed on every record, JSON whatever the Accept header says."""
    app = FastAPI()

    @app.get("/health")
    async def health():  # sglang's health check names no diffrl family
        return {}

    @app.post("/rollout/generate")
    async def generate(http: Request):
        body = await http.json()
        request = RolloutRequest(**body)
        n = request.num_inference_steps
        requested = range(n) if request.rollout_return_step_indices is None else request.rollout_return_step_indices
        rows = sorted({i for i in requested if i < n}) + [n]
        run = request.model_copy(update={"rollout_return_step_indices": rows, "rollout_return_denoising_env": True})
        outputs = await engine.agenerate(run)
        sde = range(n) if request.rollout_sde_step_indices is None else request.rollout_sde_step_indices
        env = outputs[0].denoising_env

        def cond(embeds, ids):
            return {"encoder_hidden_states": [_b64_tensor(embeds[0])], "txt_seq_lens": [embeds.shape[1]],
                    "txt_ids": _b64_tensor(ids), "img_ids": _b64_tensor(env["image_ids"])}

        records = []
        for out in outputs:
            log_probs = torch.zeros(n)
            log_probs[list(sorted(sde))] = out.rollout_log_probs
            sigmas = out.dit_trajectory.sigmas
            trajectory = {"latents": _b64_tensor(out.dit_trajectory.latents),
                          "timesteps": _b64_tensor(sigmas[rows[:-1]] * 1000)}
            if with_sigmas:
                trajectory["sigmas"] = _b64_tensor(sigmas)
            records.append({
                "request_id": "abc", "prompt": request.prompt, "seed": request.seed,
                "generated_output": _b64_tensor(out.generated_output[:, None]),
                "rollout_log_probs": _b64_tensor(log_probs), "rollout_debug_tensors": None,
                "denoising_env": {"image_kwargs": None, "guidance": None,
                                  "pos_cond_kwargs": cond(env["prompt_embeds"], env["text_ids"]),
                                  "neg_cond_kwargs": cond(env["negative_prompt_embeds"], env["negative_text_ids"])},
                "dit_trajectory": trajectory, "inference_time_s": 0.1, "peak_memory_mb": 1.0,
            })
        return Response(json.dumps(records), media_type="application/json")

    return app


def test_http_client_reads_sglang_responses_into_the_in_process_outputs(engine):
    request = RolloutRequest(prompt="a purple triangle", seed=40, num_outputs_per_prompt=3, **ROLLOUT)
    in_process = engine.generate(request)
    with serving_in_thread(_sglang_stand_in(engine)) as url:
        client = HttpEngineClient(url)
        try:
            over_json = asyncio.run(client.generate(request))
        finally:
            client.close()
    # Same tensors; timesteps come in sglang's σ·1000 (the demo model's own are σ).
    _same(over_json, in_process, timesteps=False)
    assert [o.seed for o in over_json] == [40, 41, 42]
    assert over_json[0].generated_output.shape == (3, 64, 64)
    assert all(o.denoising_env is None for o in over_json[1:])  # the conditioning kept once, as in-process


def test_sglang_responses_train_a_step(engine, tiny_family):
    """What a trainer does with a response: pairs from its trajectory, log-probs and denoising_env, and the
    replayed step's log-prob equals the rollout's (the conditioning from the wire is enough)."""
    request = RolloutRequest(prompt="a red circle", seed=7, num_outputs_per_prompt=2, **ROLLOUT)
    with serving_in_thread(_sglang_stand_in(engine, with_sigmas=False)) as url:
        client = HttpEngineClient(url, family="demo")
        try:
            outputs = asyncio.run(client.generate(request))
        finally:
            client.close()
    env = outputs[0].denoising_env
    trajectory = outputs[0].dit_trajectory
    pairs = grpo_pairs([o.dit_trajectory.latents for o in outputs], trajectory.latent_step_indices.tolist(),
                       [o.rollout_log_probs for o in outputs], trajectory.sigmas, torch.tensor([1.0, -1.0]),
                       [env["prompt_embeds"][0]] * 2, [env["negative_prompt_embeds"][0]] * 2, [1, 2])
    assert len(pairs) == 4
    cond = PromptEmbeds(pairs.cond, env["text_ids"])
    uncond = PromptEmbeds(pairs.uncond, env["negative_text_ids"])
    sigmas = trajectory.sigmas
    transformer = tiny_family.transformer
    transformer.requires_grad_(True)
    v = tiny_family.velocity(transformer, Latents(pairs.x, env["image_ids"]), pairs.sigma, cond, uncond, 3.0)
    step = transition("sde", pairs.x, v, pairs.sigma[:, None, None], pairs.sigma_next[:, None, None], 0.7,
                      sigma_max=float(sigmas[1]), next_latents=pairs.x_next)
    # sigmas rebuilt from σ·1000 timesteps (no sigmas on the wire) agree to float rounding
    torch.testing.assert_close(step.log_prob.detach(), pairs.old_log_prob, rtol=0, atol=1e-4)
    loss = -(pairs.advantages * torch.exp(step.log_prob - pairs.old_log_prob)).mean()
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in transformer.parameters())


def test_grpo_pairs_read_per_step_and_per_sde_step_log_probs_alike():
    latents = [torch.randn(5, 3, 2)]
    sigmas = torch.linspace(1, 0, 5)
    per_sde = [torch.tensor([-1.0, -2.0])]
    per_step = [torch.tensor([0.0, -1.0, -2.0, 0.0])]
    args = ([0, 1, 2, 3, 4], sigmas, torch.tensor([1.0]), [torch.zeros(2, 2)], [torch.zeros(2, 2)], [1, 2])
    a = grpo_pairs(latents, args[0], per_sde, *args[1:])
    b = grpo_pairs(latents, args[0], per_step, *args[1:])
    assert torch.equal(a.old_log_prob, torch.tensor([-1.0, -2.0])) and torch.equal(a.old_log_prob, b.old_log_prob)


def test_decoder_refuses_malformed_tensors_and_records(engine):
    good = sglang.tensor_to_json(torch.ones(2, 3))
    assert torch.equal(sglang.tensor_from_json(good, "x"), torch.ones(2, 3))
    bad = [
        ({**good, "data": "not base64!"}, "base64"),
        ({**good, "data": base64.b64encode(b"\x80\x04pickle").decode()}, "safetensors"),
        ({**good, "shape": [3, 2]}, "declared"),
        (sglang.tensor_to_json(torch.tensor([1.0, float("nan")])), "non-finite"),
        ({"__tensor__": True, "data": base64.b64encode(save({"u": torch.ones(1)})).decode()}, "named"),
        ({"data": good["data"]}, "expected a tensor"),
    ]
    for obj, message in bad:
        with pytest.raises(WireFormatError, match=message):
            sglang.tensor_from_json(obj, "x")
    request = RolloutRequest(prompt="a circle", **ROLLOUT)
    payload = TestClient(create_app(engine)).post("/rollout/generate", json=request.model_dump()).json()
    short = json.loads(json.dumps(payload))
    short[0]["rollout_log_probs"] = sglang.tensor_to_json(torch.zeros(2))
    with pytest.raises(WireFormatError, match="one per step"):
        sglang.decode_response(json.dumps(short).encode(), request)
    with pytest.raises(WireFormatError, match="JSON"):
        sglang.decode_response(b"\x00 not json", request)
    with pytest.raises(WireFormatError, match="list"):
        sglang.decode_response(b'{"detail": "x"}', request)


def test_video_outputs_keep_their_frame_axis(tiny_family):
    from diffrl.engine.protocol import RolloutOutput

    class Video:
        generates_video = True

    video = torch.rand(3, 5, 8, 8)
    output = RolloutOutput(seed=0, generated_output=video, rollout_log_probs=None, dit_trajectory=None,
                           denoising_env=None, weight_version=0, inference_time_s=0.0, peak_memory_mb=0.0)
    request = RolloutRequest(prompt="x", num_frames=5)
    records = json.loads(sglang.encode_response([output], request, Video(), "id"))
    assert records[0]["generated_output"]["shape"] == [3, 5, 8, 8]
    assert torch.equal(sglang.decode_response(json.dumps(records).encode(), request)[0].generated_output, video)


def test_http_client_reads_a_diffrl_servers_json_the_same_as_its_msgpack(engine):
    request = RolloutRequest(prompt="a red circle", seed=2, num_outputs_per_prompt=2, **ROLLOUT)
    with serving_in_thread(create_app(engine)) as url:
        compact, json_client = HttpEngineClient(url), HttpEngineClient(url, wire_format="sglang")
        try:
            _same(asyncio.run(json_client.generate(request)), asyncio.run(compact.generate(request)))
        finally:
            compact.close()
            json_client.close()


@pytest.mark.parametrize("key,why", [("eta", "not a sampling parameter"), ("rollout", "cannot be set")])
def test_a_refused_extra_sampling_params_key_is_the_error_field(engine, key, why):
    """A refused `extra_sampling_params` key is named in `error.field` (and in `detail`'s loc), as every
    other refusal names its field, not reported as the whole body."""
    client = TestClient(create_app(engine))
    response = client.post("/rollout/generate", json={**SGLANG_REQUEST, "extra_sampling_params": {key: 1.0}})
    assert response.status_code == 422
    body = response.json()
    assert body["error"]["field"] == f"extra_sampling_params.{key}"
    name, _, rest = body["error"]["message"].partition(": ")
    assert name == f"extra_sampling_params.{key}" and rest.startswith(why)  # named once, then why
    assert body["detail"][0]["loc"] == ["body", "extra_sampling_params", key]
