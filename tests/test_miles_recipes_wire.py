"""miles-diffusion's published client, request for request, against `diffrl serve`; and diffrl's own client
against answers shaped as sglang-diffusion's rollout endpoint builds them.

The client side follows radixark/miles_diffusion as published: the request builder and microgroup seed
layout of `miles/rollout/sglang_diffusion_rollout.py`, the flow_grpo-style SDE window of
`miles/rollout/step_strategy_hub.py` (`sde_window`), the response parser of
`miles/utils/diffusion_rollout_response.py` and the Qwen-Image trainer's use of what it parsed
(`miles/backends/fsdp_utils/actor.py`, `configs/qwen_image.py`: latents[:-1] / latents[1:], σ taken as
timestep / 1000, log-probs indexed by the SDE window, `torch.cat(encoder_hidden_states)`, one
`txt_seq_lens` and one `img_shapes` entry per sample). The server side follows sglang-diffusion as
miles-diffusion pins it (Rockdu/sglang 0372158dd, `entrypoints/post_training/rollout_api.py`,
`post_training/rollout_denoising_mixin.py`, `post_training/scheduler_rl_mixin.py`). All re-written
here from those facts.

Recipe values: miles' four published scripts (`scripts/run-diffusion-grpo-{ocr,pickscore}-{2,4}gpu-*.sh`)
are all Qwen-Image: 10 steps (50 for evaluation), guidance_scale 4 and true_cfg_scale 4, noise level 1.2,
sde_window of 2 steps drawn in [3, 5), debug mode on in three of them, 512 × 512, microgroups of 16 or 8.
They run here at 64 × 64 and microgroups of 2 (a CPU test); every other value is the recipe's. The other
families have no miles recipe: they get miles' argument defaults (10 steps, guidance 4, noise 0.7, no
true-CFG scale, 512 → 64 px), and video families their frame count through `extra_sampling_params`, the
one way miles' builder passes a field it does not name.
"""

from __future__ import annotations

import asyncio
import base64
import importlib
import json
import math
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from fastapi import FastAPI
from fastapi.responses import Response
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread
from diffrl.errors import RequestError
from diffrl.rollout import HttpEngineClient
from diffrl.rollout.clients import EngineUnavailable

SIZE = 64  # the recipes' 512, scaled down for CPU


# ============================================================== the client, as miles-diffusion publishes it
def recipe_args(**overrides) -> Namespace:
    """miles' argument defaults (miles/utils/arguments.py), then the Qwen-Image GRPO recipes' flags."""
    args = Namespace(
        diffusion_num_steps=10, diffusion_eval_num_steps=None, diffusion_guidance_scale=4.0, diffusion_noise_level=0.7,
        diffusion_height=512, diffusion_width=512, diffusion_negative_prompt=None, diffusion_true_cfg_scale=None,
        diffusion_generator_device="cuda", diffusion_sde_type="sde", diffusion_sde_window_size=0,
        diffusion_sde_window_range=None, diffusion_step_strategy_path=None, diffusion_log_prob_no_const=False,
        diffusion_debug_mode=False, diffusion_microgroup_size=1, n_samples_per_prompt=1, rollout_seed=42,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


QWEN_OCR_RECIPE = dict(  # scripts/run-diffusion-grpo-ocr-2gpu-flowgrpo-aligned.sh (size and group scaled)
    diffusion_num_steps=10, diffusion_eval_num_steps=50, diffusion_guidance_scale=4.0, diffusion_true_cfg_scale=4.0,
    diffusion_noise_level=1.2, diffusion_step_strategy_path="miles.rollout.step_strategy_hub.sde_window",
    diffusion_sde_window_size=2, diffusion_sde_window_range="3,5", diffusion_debug_mode=True,
    diffusion_height=SIZE, diffusion_width=SIZE, n_samples_per_prompt=4, diffusion_microgroup_size=2,
)


def sampling_params(args: Namespace, *, evaluation: bool = False, extra: dict | None = None) -> dict:
    """The static body fields miles sends: the image fields always, the rollout fields only when training
    (evaluation sends `rollout: false` and nothing else of the rollout's)."""
    steps = args.diffusion_eval_num_steps if evaluation and args.diffusion_eval_num_steps is not None \
        else args.diffusion_num_steps
    params = {"generator_device": args.diffusion_generator_device, "negative_prompt": args.diffusion_negative_prompt,
              "width": args.diffusion_width, "height": args.diffusion_height, "num_inference_steps": int(steps),
              "guidance_scale": args.diffusion_guidance_scale, "true_cfg_scale": args.diffusion_true_cfg_scale}
    if evaluation:
        params["rollout"] = False
    else:
        params.update(rollout=True, rollout_sde_type=args.diffusion_sde_type,
                      rollout_noise_level=float(args.diffusion_noise_level),
                      rollout_log_prob_no_const=bool(args.diffusion_log_prob_no_const),
                      rollout_debug_mode=bool(args.diffusion_debug_mode),
                      rollout_return_denoising_env=True, rollout_return_dit_trajectory=True)
    if extra:
        params["extra_sampling_params"] = extra
    return params


def sde_window(args: Namespace, num_steps: int, seed: int) -> tuple[list[int], None]:
    """flow_grpo's random contiguous window: its start drawn from numpy's default_rng(seed) in [lo, hi − size];
    nothing asked back but the whole trajectory (return indices null)."""
    size = int(args.diffusion_sde_window_size)
    lo, hi = (int(x) for x in args.diffusion_sde_window_range.split(",")) if args.diffusion_sde_window_range \
        else (0, num_steps)
    start = int(np.random.default_rng(seed).integers(lo, hi - size + 1))
    return list(range(start, start + size)), None


def microgroup_payloads(args: Namespace, prompt: str, group_index: int, *, extra: dict | None = None,
                        strategy=None) -> list[tuple[int, dict, list[int] | None]]:
    """(first sample index, body, SDE window) per microgroup of one prompt group, as miles builds them."""
    n, m = args.n_samples_per_prompt, args.diffusion_microgroup_size
    seed_base = (int(args.rollout_seed) + group_index * n) % 2**31
    out = []
    for start in range(0, n, m):
        params = sampling_params(args, extra=extra)
        params["seed"] = seed_base + start
        window = None
        if strategy is not None:
            window, returned = strategy(args, params["num_inference_steps"], params["seed"])
            params["rollout_sde_step_indices"], params["rollout_return_step_indices"] = window, returned
        params["prompt"] = prompt
        if params["negative_prompt"] is None:
            params["negative_prompt"] = " "  # miles' Flow-GRPO default
        params["num_outputs_per_prompt"] = min(m, n - start)
        out.append((start, params, window))
    return out


# ---------------------------------------------------------------- its response parser
def b64_tensor(obj: Any) -> torch.Tensor | None:
    """miles' tensor decoding: `{"__tensor__": true, "data": base64 safetensors}`, tensor "t"; a bare base64
    string read the same way (its log-prob path hands the `data` string on)."""
    if obj is None:
        return None
    if isinstance(obj, dict) and obj.get("__tensor__"):
        obj = obj["data"]
    if not isinstance(obj, str):
        raise TypeError(f"cannot read {type(obj).__name__} as a tensor")
    return st_load(base64.b64decode(obj.encode("ascii")))["t"].detach().cpu()


@dataclass
class Cond:
    txt_seq_lens: Any = None
    freqs_cis: list = field(default_factory=list)
    img_shapes: Any = None
    encoder_hidden_states: list = field(default_factory=list)


@dataclass
class Sample:
    index: int
    prompt: str = ""
    request_id: str | None = None
    seed: int | None = None
    generated_output: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    debug: Any = None
    env: dict | None = None  # image_kwargs, pos (Cond), neg (Cond), guidance
    latents: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
    sde_step_indices: list[int] | None = None


def read_cond(data: dict | None) -> Cond | None:
    if not data:
        return None
    return Cond(txt_seq_lens=data.get("txt_seq_lens"), img_shapes=data.get("img_shapes"),
                freqs_cis=[b64_tensor(x) for x in data.get("freqs_cis", [])],  # iterated: null would fail
                encoder_hidden_states=[b64_tensor(x) for x in data.get("encoder_hidden_states", [])])


def apply_record(sample: Sample, body: dict) -> Sample:
    """One record into one sample, as miles' parser fills its `Sample`."""
    sample.request_id = body.get("request_id") or sample.request_id
    if "prompt" in body:
        sample.prompt = str(body["prompt"])
    if "seed" in body:
        sample.seed = int(body["seed"])
    sample.generated_output = b64_tensor(body.get("generated_output"))
    log_probs = body.get("rollout_log_probs")
    if log_probs is not None:
        assert isinstance(log_probs, dict) and log_probs.get("__tensor__") is not None
        sample.rollout_log_probs = b64_tensor(log_probs["data"])
    debug = body.get("rollout_debug_tensors")
    sample.debug = {k: b64_tensor(v) for k, v in debug.items()} if debug else None
    env = body.get("denoising_env")
    sample.env = {"image_kwargs": env.get("image_kwargs"), "pos": read_cond(env.get("pos_cond_kwargs")),
                  "neg": read_cond(env.get("neg_cond_kwargs")), "guidance": env.get("guidance")} if env else None
    trajectory = body.get("dit_trajectory")
    if trajectory:
        sample.latents = b64_tensor(trajectory.get("latents"))
        sample.timesteps = b64_tensor(trajectory.get("timesteps"))
        sample.sigmas = b64_tensor(trajectory.get("sigmas"))
    if body.get("inference_time_s") is not None:
        sample.inference_time_s = float(body["inference_time_s"])
    if body.get("peak_memory_mb") is not None:
        sample.peak_memory_mb = float(body["peak_memory_mb"])
    return sample


def roll_out_group(url: str, args: Namespace, prompt: str, group_index: int, **kw) -> list[Sample]:
    """One prompt group through miles' microgroup loop: one POST per microgroup (httpx, `json=`, as its
    http_utils does), every record parsed, then seed `seed + i` and the SDE window stashed per sample."""
    samples = [Sample(index=k) for k in range(args.n_samples_per_prompt)]
    for start, body, window in microgroup_payloads(args, prompt, group_index, **kw):
        response = httpx.post(f"{url}/rollout/generate", json=body, timeout=300)
        response.raise_for_status()
        assert response.headers["content-type"].startswith("application/json")
        records = response.json()
        microgroup = samples[start:start + body["num_outputs_per_prompt"]]
        assert isinstance(records, list) and len(records) == len(microgroup)  # zip(strict=True) in miles
        for idx, (sample, record) in enumerate(zip(microgroup, records, strict=True)):
            apply_record(sample, record)
            assert sample.seed == body["seed"]  # the request's seed on every record
            sample.seed = body["seed"] + idx
            sample.sde_step_indices = window
    return samples


def assert_tensor_map(obj: dict) -> None:
    """sglang's `_maybe_serialize` map: exactly these four keys, shape and dtype spelled as torch does."""
    assert set(obj) == {"__tensor__", "data", "shape", "dtype"} and obj["__tensor__"] is True
    tensor = b64_tensor(obj)
    assert obj["shape"] == list(tensor.shape) and obj["dtype"] == str(tensor.dtype)


def assert_record_layout(record: dict) -> None:
    """The keys of sglang's `RolloutResponse.model_dump()`, and every tensor in its map form."""
    assert set(record) == {"request_id", "prompt", "seed", "generated_output", "rollout_log_probs",
                           "rollout_debug_tensors", "denoising_env", "dit_trajectory", "inference_time_s",
                           "peak_memory_mb"}

    def walk(value):
        if isinstance(value, dict) and "__tensor__" in value:
            assert_tensor_map(value)
        elif isinstance(value, dict):
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
    walk(record)


# ============================================================== families
FAMILIES = {
    "qwen_image": ("qwen_image", "QwenImageFamily", {}),
    "flux3_image": ("flux3_image", "Flux3ImageFamily", {}),
    "krea2": ("krea2", "Krea2Family", {}),
    "sd3": ("sd3", "SD3Family", {}),
    "wan2_2": ("wan2_2", "Wan22Family", {"num_frames": 5}),
    "ltx2": ("ltx2", "Ltx2Family", {"num_frames": 9}),
    "cosmos3": ("cosmos3", "Cosmos3Family", {"num_frames": 5}),
}


def load_family(name: str, root):
    module, cls, _ = FAMILIES[name]
    checkpoint = importlib.import_module(f"diffrl.models.random_checkpoints.{module}")
    family_cls = getattr(importlib.import_module(f"diffrl.models.{module}"), cls)
    return family_cls.load(checkpoint.save_random_checkpoint(root / f"{name}-tiny"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return load_family("qwen_image", tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def qwen_url(qwen):
    with serving_in_thread(create_app(Engine(qwen, EngineConfig(max_outputs_per_request=16)))) as url:
        yield url


# ============================================================== the Qwen-Image recipes
def sde_mean_and_std(x, v, sigma, sigma_next, noise_level, sigma_max=None):
    """sglang's `sde` transition (scheduler_rl_mixin.flow_sde_sampling); at σ = 1 the denominator takes
    `sigma_max`, the schedule's second σ."""
    dt = sigma_next - sigma
    std = math.sqrt(sigma / (1 - (sigma_max if sigma == 1 else sigma))) * noise_level
    mean = x * (1 + std**2 / (2 * sigma) * dt) + v * (1 + std**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std * math.sqrt(-dt)


def gaussian_log_prob(x_next, mean, std):
    """sglang's full log-density (rollout_log_prob_no_const false), averaged over the latent's elements."""
    return (-((x_next - mean) ** 2) / (2 * std**2) - math.log(std) - math.log(math.sqrt(2 * math.pi))).mean()


def qwen_velocity(family, latents, timestep, cond: Cond):
    """The Qwen-Image trainer's forward on one sample: its prepared cond kwargs (torch.cat of the text list,
    a batch axis added; img_shapes as sent), timestep / 1000 as diffusers' pipeline passes it."""
    text = torch.cat(cond.encoder_hidden_states)
    if text.dim() == 2:
        text = text[None]
    assert text.shape[1] == cond.txt_seq_lens[0]  # the mask it would build from txt_seq_lens covers every token
    transformer = family.transformer
    dtype = next(transformer.parameters()).dtype
    img_shapes = [[tuple(shape) for shape in cond.img_shapes[0]]]
    with torch.no_grad():
        return transformer(hidden_states=latents[None].to(dtype), encoder_hidden_states=text.to(dtype),
                           timestep=torch.tensor([timestep / 1000.0], dtype=dtype), img_shapes=img_shapes,
                           return_dict=False)[0][0].float()


def test_qwen_image_grpo_recipe_through_miles_client_and_trainer_reads(qwen, qwen_url):
    args = recipe_args(**QWEN_OCR_RECIPE)
    prompt = 'a sign that says "miles"'
    samples = roll_out_group(qwen_url, args, prompt, group_index=3, strategy=sde_window)

    # The same group in one microgroup (the 4-GPU pickscore recipe's larger M): sample k is the same.
    whole = roll_out_group(qwen_url, recipe_args(**{**QWEN_OCR_RECIPE, "diffusion_microgroup_size": 4}),
                           prompt, group_index=3, strategy=sde_window)
    steps, n = args.diffusion_num_steps, args.n_samples_per_prompt
    seed_base = args.rollout_seed + 3 * n
    assert [s.seed for s in samples] == [seed_base + k for k in range(n)] == [s.seed for s in whole]

    for sample in samples:
        window = sample.sde_step_indices
        assert window == sde_window(args, steps, seed_base + (sample.index // 2) * 2)[0]
        assert window[0] in (3,) and len(window) == 2  # range 3,5 with size 2: always [3, 4]
        assert sample.prompt == prompt and isinstance(sample.request_id, str) and sample.request_id
        # generated_output: [C, T, H, W] with T = 1 (its rewards read frame 0), float in [0, 1].
        image = sample.generated_output
        assert image.shape == (3, 1, SIZE, SIZE) and image.dtype == torch.float32
        assert 0 <= image.min() and image.max() <= 1
        # One log-prob per step; the steps outside the window ran ODE and carry 0.
        log_probs = sample.rollout_log_probs
        assert log_probs.shape == (steps,) and log_probs.dtype == torch.float32
        outside = [i for i in range(steps) if i not in window]
        assert torch.all(log_probs[outside] == 0) and torch.all(log_probs[window] != 0)
        # The whole trajectory (return indices null): T + 1 latents, T timesteps, T + 1 sigmas.
        assert sample.latents.shape[0] == steps + 1 and sample.latents.dtype == torch.float32
        assert sample.timesteps.shape == (steps,) and sample.sigmas.shape == (steps + 1,)
        # Its trainer takes σ = timestep / 1000 with a terminal 0; the sigmas snapshot is that schedule.
        assert torch.allclose(sample.timesteps / 1000, sample.sigmas[:-1], atol=1e-6) and sample.sigmas[-1] == 0
        # rollout_debug_mode is on in this recipe: no debug tensors come back (its trainer takes None).
        assert sample.debug is None
        assert sample.inference_time_s > 0 and sample.peak_memory_mb > 0

    # Sample k is the same whichever microgroup drew it (its own generator, seeded seed + i).
    for a, b in zip(samples, whole, strict=True):
        assert torch.equal(a.latents, b.latents) and torch.equal(a.rollout_log_probs, b.rollout_log_probs)
        assert torch.equal(a.generated_output, b.generated_output)

    # The conditioning, as its Qwen-Image config collates it: one text-length and one image-shape entry
    # per sample, the text list concatenated to [1, L, D], both CFG branches (true_cfg_scale 4 > 1).
    tokens = (SIZE // qwen.pixels_per_token)
    for sample in samples:
        env = sample.env
        assert env["image_kwargs"] is None and env["guidance"] is None
        for cond in (env["pos"], env["neg"]):
            assert isinstance(cond.txt_seq_lens, list) and len(cond.txt_seq_lens) == 1
            assert cond.img_shapes == [[[1, tokens, tokens]]]
            assert all(t.dim() == 2 for t in cond.encoder_hidden_states)
            assert torch.cat(cond.encoder_hidden_states).shape[0] == cond.txt_seq_lens[0]

    # The trainer's replay of the window steps gives back the rollout's log-probs: latents[:-1] / [1:]
    # sliced by the window, σ from the timesteps, CFG with the norm rescale, sglang's SDE density.
    for sample in samples[:2]:
        pos, neg = sample.env["pos"], sample.env["neg"]
        for i in sample.sde_step_indices:
            x, x_next = sample.latents[i], sample.latents[i + 1]
            t, t_next = sample.timesteps[i].item(), sample.timesteps[i + 1].item()
            v_pos, v_neg = qwen_velocity(qwen, x, t, pos), qwen_velocity(qwen, x, t, neg)
            v = v_neg + 4.0 * (v_pos - v_neg)
            v = v * (v_pos.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
            mean, std = sde_mean_and_std(x, v, t / 1000, t_next / 1000, args.diffusion_noise_level)
            replayed = gaussian_log_prob(x_next, mean, std)
            assert abs(replayed.item() - sample.rollout_log_probs[i].item()) < 1e-4, (i, replayed)


def test_qwen_image_recipe_records_are_sglangs_response_model(qwen_url):
    args = recipe_args(**{**QWEN_OCR_RECIPE, "n_samples_per_prompt": 2})
    [(_, body, _)] = microgroup_payloads(args, "a cat", 0, strategy=sde_window)
    records = httpx.post(f"{qwen_url}/rollout/generate", json=body, timeout=300).json()
    assert len({r["request_id"] for r in records}) == 1  # one id per request
    for record in records:
        assert_record_layout(record)
        assert record["rollout_debug_tensors"] is None
        assert set(record["dit_trajectory"]) == {"latents", "timesteps", "sigmas"}
        assert set(record["denoising_env"]) == {"image_kwargs", "pos_cond_kwargs", "neg_cond_kwargs", "guidance"}
        assert "freqs_cis" not in record["denoising_env"]["pos_cond_kwargs"]  # absent, never null
        assert record["generated_output"]["dtype"] == "torch.float32"


def test_qwen_image_recipe_evaluation_request(qwen_url):
    """Evaluation: `rollout: false`, the recipes' 50 steps, one output per request and seed rollout_seed + j."""
    args = recipe_args(**QWEN_OCR_RECIPE)
    for j in range(2):
        body = sampling_params(args, evaluation=True)
        body.update(seed=args.rollout_seed + j, prompt="a cat", negative_prompt=" ", num_outputs_per_prompt=1)
        assert body["num_inference_steps"] == 50 and "rollout_return_dit_trajectory" not in body
        response = httpx.post(f"{qwen_url}/rollout/generate", json=body, timeout=300)
        assert response.status_code == 200, response.text
        [record] = response.json()
        assert_record_layout(record)
        sample = apply_record(Sample(index=0), record)
        assert sample.generated_output.shape == (3, 1, SIZE, SIZE)
        assert sample.rollout_log_probs is None and sample.env is None and sample.latents is None
        assert sample.seed == args.rollout_seed + j


def test_return_step_indices_give_those_rows_then_the_final_latent(qwen_url):
    """A step strategy that asks back only its window gets sglang's rows: the latents entering those steps,
    ascending and once each, then the final latent; one timestep per returned step."""
    args = recipe_args(**{**QWEN_OCR_RECIPE, "n_samples_per_prompt": 1, "diffusion_microgroup_size": 1})
    [full] = roll_out_group(qwen_url, args, "a cat", 0, strategy=lambda a, n, s: ([3, 4], None))
    [part] = roll_out_group(qwen_url, args, "a cat", 0, strategy=lambda a, n, s: ([3, 4], [4, 3, 3]))
    assert part.latents.shape[0] == 3 and part.timesteps.shape == (2,)
    assert torch.equal(part.latents, full.latents[[3, 4, 10]])
    assert torch.equal(part.timesteps, full.timesteps[[3, 4]])
    assert torch.equal(part.sigmas, full.sigmas) and torch.equal(part.rollout_log_probs, full.rollout_log_probs)


# ============================================================== the other families, at miles' defaults
@pytest.mark.parametrize("name", ["flux3_image", "krea2", "sd3", "wan2_2", "ltx2", "cosmos3"])
def test_miles_defaults_on_each_family(name, tmp_path):
    family = load_family(name, tmp_path)
    extra = FAMILIES[name][2] or None
    args = recipe_args(diffusion_height=SIZE, diffusion_width=SIZE, n_samples_per_prompt=2,
                       diffusion_microgroup_size=2, diffusion_sde_window_size=2, diffusion_sde_window_range="3,5",
                       diffusion_num_steps=6)
    with serving_in_thread(create_app(Engine(family, EngineConfig(max_outputs_per_request=4)))) as url:
        samples = roll_out_group(url, args, "a red fox running", 0, extra=extra, strategy=sde_window)
    steps, frames = args.diffusion_num_steps, (extra or {}).get("num_frames", 1)
    for sample in samples:
        assert sample.generated_output.shape == (3, frames, SIZE, SIZE)  # image [C, 1, H, W], video [C, F, H, W]
        assert sample.generated_output.dtype == torch.float32
        log_probs = sample.rollout_log_probs
        assert log_probs.shape == (steps,)
        assert torch.all(log_probs[[0, 1, 2, 5]] == 0) and torch.all(log_probs[[3, 4]] != 0)
        assert sample.latents.shape[0] == steps + 1 and sample.timesteps.shape == (steps,)
        # What a miles trainer derives its schedule from: timestep / 1000 (num_train_timesteps).
        assert torch.allclose(sample.timesteps / 1000, sample.sigmas[:-1], atol=1e-5), (sample.timesteps, sample.sigmas)
        pos, neg = sample.env["pos"], sample.env["neg"]
        assert pos is not None and neg is not None  # guidance 4: both branches
        assert pos.encoder_hidden_states and all(t.dim() == 2 for t in pos.encoder_hidden_states)
        assert sample.env["image_kwargs"] is None and sample.env["guidance"] is None


# ============================================================== diffrl's client against sglang's answers
def sglang_tensor(tensor: torch.Tensor) -> dict:
    """sglang's `_maybe_serialize` of one tensor."""
    tensor = tensor.detach().contiguous().cpu()
    return {"__tensor__": True, "data": base64.b64encode(st_save({"t": tensor})).decode("ascii"),
            "shape": list(tensor.shape), "dtype": str(tensor.dtype)}


def sglang_qwen_records(req: RolloutRequest, outputs, family, *, with_sigmas: bool, batched_text: bool) -> list:
    """What sglang's rollout endpoint sends for Qwen-Image: per-step log-probs with 0 on ODE steps, the
    trajectory of every step plus the final latent, the conditioning on every record as its pipeline config
    builds it (text embeds as a one-entry list, [1, L, D] when the request has several outputs since the
    prompt is encoded once; txt_seq_lens; img_shapes; the RoPE caches as freqs_cis), debug tensors, the
    request's seed on every record."""
    env = outputs[0].denoising_env
    sde = sorted(req.rollout_sde_step_indices)

    def cond(embeds):
        length = int(embeds[0, 0, 0])
        text = embeds[0, 1:1 + length]
        rows, cols = (int(v) + 1 for v in env["image_ids"][-1, 1:])
        return {"txt_seq_lens": [length],
                "freqs_cis": [sglang_tensor(torch.randn(rows * cols, 8)), sglang_tensor(torch.randn(length, 8))],
                "img_shapes": [[[1, rows, cols]]],
                "encoder_hidden_states": [sglang_tensor(text[None] if batched_text else text)]}

    records = []
    for out in outputs:
        full = torch.zeros(req.num_inference_steps)
        full[sde] = out.rollout_log_probs
        trajectory = {"latents": sglang_tensor(out.dit_trajectory.latents),
                      "timesteps": sglang_tensor(out.dit_trajectory.timesteps[:-1])}  # σ·1000 already
        if with_sigmas:
            trajectory["sigmas"] = sglang_tensor(out.dit_trajectory.sigmas)
        records.append({
            "request_id": "abc", "prompt": req.prompt, "seed": req.seed,
            "generated_output": sglang_tensor(out.generated_output[:, None]),
            "rollout_log_probs": sglang_tensor(full),
            "rollout_debug_tensors": {k: sglang_tensor(torch.zeros(req.num_inference_steps, 2)) for k in (
                "rollout_variance_noises", "rollout_prev_sample_means", "rollout_noise_std_devs",
                "rollout_model_outputs")},
            "denoising_env": {"image_kwargs": None, "pos_cond_kwargs": cond(env["prompt_embeds"]),
                              "neg_cond_kwargs": cond(env["negative_prompt_embeds"]), "guidance": None},
            "dit_trajectory": trajectory, "inference_time_s": 1.5, "peak_memory_mb": 100.0,
        })
    return records


def canned_server(status: int, body: Any):
    app = FastAPI()

    @app.post("/rollout/generate")
    async def generate() -> Response:
        return Response(json.dumps(body), status_code=status, media_type="application/json")

    return serving_in_thread(app)


@pytest.mark.parametrize("with_sigmas", [True, False])
@pytest.mark.parametrize("batched_text", [True, False])
def test_http_client_reads_sglangs_qwen_image_answer(qwen, with_sigmas, batched_text):
    from diffrl.models.qwen_image import QwenImageFamily

    steps = 6
    req = RolloutRequest(prompt="a cat", negative_prompt=" ", seed=9, num_outputs_per_prompt=2, width=SIZE,
                         height=SIZE, num_inference_steps=steps, true_cfg_scale=4.0, rollout=True,
                         rollout_sde_step_indices=[2, 3], rollout_noise_level=1.2,
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    engine = Engine(qwen, EngineConfig(max_outputs_per_request=4))
    every_step = engine.generate(req.model_copy(update={"rollout_return_step_indices": list(range(steps + 1))}))
    in_process = engine.generate(req)
    records = sglang_qwen_records(req, every_step, qwen, with_sigmas=with_sigmas, batched_text=batched_text)
    for stream in (True, False):
        with canned_server(200, records) as url:
            client = HttpEngineClient(url, family=QwenImageFamily, stream=stream)
            try:
                got = asyncio.run(client.generate(req))
            finally:
                client.close()
        assert [o.seed for o in got] == [9, 10]
        for a, b in zip(got, in_process, strict=True):
            assert torch.equal(a.generated_output, b.generated_output)
            assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
            assert torch.equal(a.dit_trajectory.latent_step_indices, b.dit_trajectory.latent_step_indices)
            assert torch.equal(a.dit_trajectory.latents, b.dit_trajectory.latents)
            assert torch.allclose(a.dit_trajectory.sigmas, b.dit_trajectory.sigmas, atol=1e-6)
        env, ref = got[0].denoising_env, in_process[0].denoising_env
        assert got[1].denoising_env is None
        assert torch.equal(env["prompt_embeds"], ref["prompt_embeds"])
        assert torch.equal(env["negative_prompt_embeds"], ref["negative_prompt_embeds"])
        assert torch.equal(env["image_ids"], ref["image_ids"])


@pytest.mark.parametrize(("status", "body", "error"), [
    (400, {"detail": "Invalid sampling params: height must be divisible by 16"}, RequestError),
    (422, {"detail": [{"loc": ["body", "seed"], "msg": "Input should be a valid integer", "type": "int_parsing"}]},
     RequestError),
    (500, {"detail": "Generation failed: CUDA out of memory"}, EngineUnavailable),
])
def test_http_client_reads_sglangs_refusals(status, body, error):
    req = RolloutRequest(prompt="a cat", num_inference_steps=2)
    with canned_server(status, body) as url:
        client = HttpEngineClient(url, family="qwen_image")
        try:
            with pytest.raises(error) as caught:
                asyncio.run(client.generate(req))
        finally:
            client.close()
    if status == 422:
        assert caught.value.field == "seed"
    if status == 400:
        assert "divisible by 16" in str(caught.value)


# sglang's `RolloutRequest` fields (io_struct.py at 0372158dd). Its pydantic model drops any other field without
# a word; `extra_sampling_params` is merged over these into its sampling params, which declare many more.
SGLANG_REQUEST_FIELDS = {
    "prompt", "negative_prompt", "seed", "generator_device", "width", "height", "num_inference_steps",
    "num_outputs_per_prompt", "guidance_scale", "true_cfg_scale", "num_frames", "fps", "rollout", "rollout_sde_type",
    "rollout_noise_level", "rollout_log_prob_no_const", "rollout_debug_mode", "rollout_return_denoising_env",
    "rollout_return_dit_trajectory", "rollout_sde_step_indices", "rollout_return_step_indices", "image_path",
    "suppress_logs", "extra_sampling_params",
}


def sglang_sampling_kwargs(body: dict) -> dict:
    """What sglang's endpoint samples with: its declared fields, then extra_sampling_params over them (rollout
    kept from the request), nulls dropped (`_build_sampling_kwargs`)."""
    kwargs = {k: v for k, v in body.items() if k in SGLANG_REQUEST_FIELDS and k != "extra_sampling_params"}
    if body.get("extra_sampling_params"):
        kwargs.update(body["extra_sampling_params"])
        kwargs["rollout"] = body.get("rollout", True)
    return {k: v for k, v in kwargs.items() if v is not None}


def test_http_client_sends_every_sampling_field_where_sglang_reads_it():
    """A Wan2.2 recipe's second-expert scale reaches an sglang server (top-level, its request model would drop
    it silently), and reaches a diffrl server the same."""
    seen: list[dict] = []
    app = FastAPI()

    @app.post("/rollout/generate")
    async def generate(body: dict) -> Response:
        seen.append(body)
        return Response(json.dumps({"detail": "stop here"}), status_code=500, media_type="application/json")

    req = RolloutRequest(prompt="a fox", num_inference_steps=4, guidance_scale=4.0, guidance_scale_2=3.0,
                         num_frames=5, rollout=True)
    with serving_in_thread(app) as url:
        client = HttpEngineClient(url, family="wan2_2")
        try:
            with pytest.raises(EngineUnavailable):
                asyncio.run(client.generate(req))
        finally:
            client.close()
    [body] = seen
    sampled = sglang_sampling_kwargs(body)
    assert sampled["guidance_scale_2"] == 3.0 and sampled["guidance_scale"] == 4.0 and sampled["num_frames"] == 5
    assert not set(body) - SGLANG_REQUEST_FIELDS, "fields an sglang server drops without a word"
    assert RolloutRequest.model_validate(body) == req  # a diffrl server reads the same request


def cps_mean_and_std(x, v, sigma, sigma_next, noise_level):
    """sglang's `cps` transition."""
    std = sigma_next * math.sin(noise_level * math.pi / 2)
    x0, noise = x - sigma * v, x + v * (1 - sigma)
    return x0 * (1 - sigma_next) + noise * math.sqrt(sigma_next**2 - std**2), std


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_log_prob_no_const_is_sglangs_on_replay(qwen, qwen_url, sde_type):
    """`--diffusion-log-prob-no-const` (and the cps type): each SDE step's log-prob is −mean((x′ − mean)²)."""
    args = recipe_args(**{**QWEN_OCR_RECIPE, "n_samples_per_prompt": 1, "diffusion_microgroup_size": 1,
                          "diffusion_num_steps": 4, "diffusion_log_prob_no_const": True,
                          "diffusion_sde_type": sde_type})
    [sample] = roll_out_group(qwen_url, args, "a cat", 0, strategy=lambda a, n, s: ([1, 2], None))
    assert torch.all(sample.rollout_log_probs[[0, 3]] == 0)
    pos, neg = sample.env["pos"], sample.env["neg"]
    for i in (1, 2):
        x, x_next = sample.latents[i], sample.latents[i + 1]
        t, t_next = sample.timesteps[i].item(), sample.timesteps[i + 1].item()
        v_pos, v_neg = qwen_velocity(qwen, x, t, pos), qwen_velocity(qwen, x, t, neg)
        v = v_neg + 4.0 * (v_pos - v_neg)
        v = v * (v_pos.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
        step = sde_mean_and_std if sde_type == "sde" else cps_mean_and_std
        mean, _ = step(x, v, t / 1000, t_next / 1000, args.diffusion_noise_level)
        replayed = -((x_next - mean) ** 2).mean()
        assert abs(replayed.item() - sample.rollout_log_probs[i].item()) < 1e-4 * max(1.0, abs(replayed.item()))


@pytest.mark.parametrize("accept", ["application/json, application/msgpack", "application/msgpack, application/json",
                                    "application/json;q=0.9, application/msgpack;q=0.9"])
def test_a_client_that_names_json_as_high_as_msgpack_gets_sglangs_json(accept):
    """sglang-diffusion answers JSON whatever the client accepts; diffrl's msgpack is for a client that
    ranks it above JSON (or names no JSON at all: a wildcard of the same weight loses to msgpack)."""
    from diffrl.serving.server import wants_compact

    assert wants_compact(accept) is False
    assert wants_compact("application/msgpack, */*") is True
    assert wants_compact("application/msgpack;q=0.8, application/json;q=0.5, */*") is True


@pytest.mark.parametrize("outputs", [1, 2])
def test_sglangs_sd3_conditioning_decodes_with_one_or_several_outputs(tmp_path, outputs):
    """sglang's SD3 config sends `encoder_hidden_states` as the prompt's tensor and `pooled_projections` as its
    pooled tensor, each with the prompt batch axis (the prompt is encoded once, not per output); its endpoint
    strips that axis only when it equals the number of outputs. So a request for several outputs brings
    [1, L, D] and [1, P] on every record, one output [L, D] and [P]."""
    from diffrl.serving import sglang as wire
    from diffrl.models.base import PromptEmbeds
    from diffrl.models.sd3 import SD3Family

    family = load_family("sd3", tmp_path)
    req = RolloutRequest(prompt="a fox", negative_prompt=" ", seed=1, num_outputs_per_prompt=outputs, width=SIZE,
                         height=SIZE, num_inference_steps=3, guidance_scale=4.0, rollout=True,
                         rollout_return_dit_trajectory=True, rollout_return_denoising_env=True)
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    ran = engine.generate(wire.engine_request(req))
    env = ran[0].denoising_env

    def sglang_cond(embeds):
        ours = family.cond_kwargs_to_wire(PromptEmbeds(embeds, env["text_ids"]), env["image_ids"])
        tokens, pooled = torch.cat(ours["encoder_hidden_states"]), ours["pooled_projections"]
        if outputs > 1:  # the prompt batch axis of 1 stays: it is not the request's batch of outputs
            tokens, pooled = tokens[None], pooled[None]
        return {"encoder_hidden_states": sglang_tensor(tokens), "pooled_projections": sglang_tensor(pooled)}

    records = json.loads(wire.encode_response(ran, req, family, "r"))
    for record in records:
        record["denoising_env"]["pos_cond_kwargs"] = sglang_cond(env["prompt_embeds"])
        record["denoising_env"]["neg_cond_kwargs"] = sglang_cond(env["negative_prompt_embeds"])
    got = wire.decode_response(json.dumps(records).encode(), req, SD3Family)
    assert torch.equal(got[0].denoising_env["prompt_embeds"], env["prompt_embeds"])
    assert torch.equal(got[0].denoising_env["negative_prompt_embeds"], env["negative_prompt_embeds"])


def test_refusals_carry_sglangs_detail(qwen_url):
    """sglang-diffusion refuses with FastAPI's body, `{"detail": ...}`: a text for its 400 (bad sampling
    params) and 500, the list of schema errors for 422. diffrl's refusals carry it beside their `error`."""
    body = {**sampling_params(recipe_args(**QWEN_OCR_RECIPE)), "prompt": "a cat", "seed": 1, "negative_prompt": " ",
            "num_outputs_per_prompt": 1}
    refused = httpx.post(f"{qwen_url}/rollout/generate", json={**body, "rollout_sde_step_indices": [10]}, timeout=60)
    assert refused.status_code == 400
    answer = refused.json()
    assert isinstance(answer["detail"], str) and "rollout_sde_step_indices" in answer["detail"]
    assert answer["error"]["field"] == "rollout_sde_step_indices"
    schema = httpx.post(f"{qwen_url}/rollout/generate", json={**body, "num_inference_steps": "ten"}, timeout=60)
    assert schema.status_code == 422 and schema.json()["detail"][0]["loc"] == ["body", "num_inference_steps"]


def test_http_client_reads_sglangs_wan_video_answer(tmp_path):
    """Wan2.2 through sglang: video [C, F, H, W], latents [T + 1, C, F, H, W], the prompt's text tensor with its
    batch axis of 1 in a one-entry list (a two-output request), σ·1000 timesteps and no sigmas (as at the
    pinned commit): decoded to the in-process outputs."""
    from diffrl.serving import sglang as wire
    from diffrl.models.base import PromptEmbeds
    from diffrl.models.wan2_2 import Wan22Family

    family = load_family("wan2_2", tmp_path)
    req = RolloutRequest(prompt="a fox", negative_prompt=" ", seed=3, num_outputs_per_prompt=2, width=SIZE,
                         height=SIZE, num_frames=5, num_inference_steps=4, guidance_scale=4.0, rollout=True,
                         rollout_sde_step_indices=[1, 2], rollout_return_dit_trajectory=True,
                         rollout_return_denoising_env=True)
    engine = Engine(family, EngineConfig(max_outputs_per_request=4))
    in_process = engine.generate(req)
    ran = engine.generate(wire.engine_request(req))
    env = ran[0].denoising_env
    records = json.loads(wire.encode_response(ran, req, family, "r"))
    for record in records:
        for key, embeds in (("pos_cond_kwargs", env["prompt_embeds"]), ("neg_cond_kwargs", env["negative_prompt_embeds"])):
            ours = family.cond_kwargs_to_wire(PromptEmbeds(embeds, env["text_ids"]), env["image_ids"])
            record["denoising_env"][key] = {"encoder_hidden_states": [sglang_tensor(ours["encoder_hidden_states"][0][None])]}
        del record["dit_trajectory"]["sigmas"]
        assert b64_tensor(record["generated_output"]).shape == (3, 5, SIZE, SIZE)
    with canned_server(200, records) as url:
        client = HttpEngineClient(url, family=Wan22Family)
        try:
            got = asyncio.run(client.generate(req))
        finally:
            client.close()
    for a, b in zip(got, in_process, strict=True):
        assert torch.equal(a.generated_output, b.generated_output)
        assert torch.equal(a.rollout_log_probs, b.rollout_log_probs)
        assert torch.equal(a.dit_trajectory.latents, b.dit_trajectory.latents)
        assert torch.allclose(a.dit_trajectory.sigmas, b.dit_trajectory.sigmas, atol=1e-6)
    assert torch.equal(got[0].denoising_env["prompt_embeds"], in_process[0].denoising_env["prompt_embeds"])


def test_an_sde_window_at_the_first_step_replays(qwen, qwen_url):
    """miles' default window range is [0, steps): a window may start at step 0, where σ = 1."""
    args = recipe_args(**{**QWEN_OCR_RECIPE, "n_samples_per_prompt": 1, "diffusion_microgroup_size": 1,
                          "diffusion_num_steps": 4})
    [sample] = roll_out_group(qwen_url, args, "a cat", 0, strategy=lambda a, n, s: ([0, 1], None))
    assert sample.timesteps[0] == 1000 and torch.all(sample.rollout_log_probs[[2, 3]] == 0)
    pos, neg = sample.env["pos"], sample.env["neg"]
    sigma_max = sample.timesteps[1].item() / 1000
    for i in (0, 1):
        x, x_next = sample.latents[i], sample.latents[i + 1]
        t, t_next = sample.timesteps[i].item(), sample.timesteps[i + 1].item()
        v_pos, v_neg = qwen_velocity(qwen, x, t, pos), qwen_velocity(qwen, x, t, neg)
        v = v_neg + 4.0 * (v_pos - v_neg)
        v = v * (v_pos.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True))
        mean, std = sde_mean_and_std(x, v, t / 1000, t_next / 1000, args.diffusion_noise_level, sigma_max)
        replayed = gaussian_log_prob(x_next, mean, std)
        assert abs(replayed.item() - sample.rollout_log_probs[i].item()) < 1e-4, (i, replayed, sample.rollout_log_probs)
