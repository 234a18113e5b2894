"""A miles-diffusion client against `diffrl serve`, unchanged: its request builder and its response parser.

miles cannot be installed here (not on PyPI), so this file follows its client logic as published in
radixark/miles_diffusion (`miles/rollout/sglang_diffusion_rollout.py`: `build_rollout_sampling_params`,
`build_rollout_generate_payload`, the seed layout of `generate_and_rm_group`; `miles/utils/
diffusion_rollout_response.py`: `apply_rollout_image_response`; `miles/utils/types.py`: `Sample`,
`CondKwargs`, `DenoisingEnv`, `DiTTrajectory`), in our own code. One deviation: its current default
deserializer reads only `{"__tensor__": ...}` objects while its log-prob parser hands it the base64
string inside one (which would fail against sglang itself); the deserializer here also takes the
string, as miles' did before that clean-up.
"""

import base64
from argparse import Namespace
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
from safetensors.torch import load

from diffrl.engine.engine import Engine, EngineConfig
from diffrl.engine.protocol import RolloutRequest
from diffrl.serving.server import create_app, serving_in_thread


# ------------------------------------------------------------------ miles' types, as its parser fills them
@dataclass
class CondKwargs:
    txt_seq_lens: list | None = None
    freqs_cis: list | None = None
    img_shapes: list | None = None
    encoder_hidden_states: list | None = None


@dataclass
class DenoisingEnv:
    image_kwargs: Any = None
    pos_cond_kwargs: CondKwargs | None = None
    neg_cond_kwargs: CondKwargs | None = None
    guidance: Any = None


@dataclass
class DiTTrajectory:
    latents: torch.Tensor | None = None
    timesteps: torch.Tensor | None = None
    sigmas: torch.Tensor | None = None


@dataclass
class Sample:
    index: int = 0
    prompt: str = ""
    request_id: str | None = None
    seed: int | None = None
    generated_output: torch.Tensor | None = None
    rollout_log_probs: torch.Tensor | None = None
    rollout_debug_tensors: Any = None
    denoising_env: DenoisingEnv | None = None
    dit_trajectory: DiTTrajectory | None = None
    inference_time_s: float | None = None
    peak_memory_mb: float | None = None
    metadata: dict = field(default_factory=dict)


# ------------------------------------------------------------------ miles' request builder
def build_rollout_sampling_params(args: Namespace) -> dict:
    return {
        "generator_device": getattr(args, "diffusion_generator_device", "cuda"),
        "negative_prompt": getattr(args, "diffusion_negative_prompt", None),
        "width": getattr(args, "diffusion_width", None),
        "height": getattr(args, "diffusion_height", None),
        "num_inference_steps": args.diffusion_num_steps,
        "guidance_scale": getattr(args, "diffusion_guidance_scale", None),
        "true_cfg_scale": getattr(args, "diffusion_true_cfg_scale", None),
        "rollout": True,
        "rollout_sde_type": getattr(args, "diffusion_sde_type", "sde"),
        "rollout_noise_level": float(getattr(args, "diffusion_noise_level", 0.7)),
        "rollout_log_prob_no_const": bool(getattr(args, "diffusion_log_prob_no_const", False)),
        "rollout_debug_mode": bool(getattr(args, "diffusion_debug_mode", False)),
        "rollout_return_denoising_env": True,
        "rollout_return_dit_trajectory": True,
    }


def build_rollout_generate_payload(sampling_params: dict, prompt: str, num_outputs_per_prompt: int) -> dict:
    sampling_params["prompt"] = prompt
    if sampling_params["negative_prompt"] is None:
        sampling_params["negative_prompt"] = " "  # its Flow-GRPO default
    sampling_params["num_outputs_per_prompt"] = num_outputs_per_prompt
    return sampling_params


# ------------------------------------------------------------------ miles' response parser
def decode_tensor_base64(b64) -> torch.Tensor:
    return load(base64.b64decode(b64.encode("ascii") if isinstance(b64, str) else b64))["t"]


def deserialize(value):
    if value is None:
        return None
    if isinstance(value, str):
        return decode_tensor_base64(value).detach().cpu()
    if isinstance(value, dict) and value.get("__tensor__"):
        return decode_tensor_base64(value["data"]).detach().cpu()
    raise TypeError(f"Cannot deserialize {type(value)}")


def parse_log_probs(value):
    if value is None:
        return None
    assert isinstance(value, dict) and value.get("__tensor__") is not None
    return deserialize(value["data"]).detach().cpu()


def parse_cond_kwargs(data):
    if not data:
        return None
    return CondKwargs(txt_seq_lens=data.get("txt_seq_lens"),
                      freqs_cis=[deserialize(x) for x in data.get("freqs_cis", [])],
                      img_shapes=data.get("img_shapes"),
                      encoder_hidden_states=[deserialize(x) for x in data.get("encoder_hidden_states", [])])


def apply_rollout_image_response(sample: Sample, body: dict) -> Sample:
    sample.request_id = body.get("request_id") or sample.request_id
    if "prompt" in body:
        sample.prompt = str(body["prompt"])
    if "seed" in body:
        sample.seed = int(body["seed"])
    sample.generated_output = deserialize(body.get("generated_output"))
    sample.rollout_log_probs = parse_log_probs(body.get("rollout_log_probs"))
    env = body.get("denoising_env")
    sample.denoising_env = DenoisingEnv(
        image_kwargs=env.get("image_kwargs"), pos_cond_kwargs=parse_cond_kwargs(env.get("pos_cond_kwargs")),
        neg_cond_kwargs=parse_cond_kwargs(env.get("neg_cond_kwargs")), guidance=env.get("guidance"),
    ) if env else None
    trajectory = body.get("dit_trajectory")
    sample.dit_trajectory = DiTTrajectory(
        latents=deserialize(trajectory.get("latents")), timesteps=deserialize(trajectory.get("timesteps")),
        sigmas=deserialize(trajectory.get("sigmas")),
    ) if trajectory else None
    if body.get("inference_time_s") is not None:
        sample.inference_time_s = float(body["inference_time_s"])
    if body.get("peak_memory_mb") is not None:
        sample.peak_memory_mb = float(body["peak_memory_mb"])
    return sample


# ------------------------------------------------------------------ the test
def test_a_miles_client_rolls_out_against_diffrl_serve_and_parses_every_record(tiny_family):
    engine = Engine(tiny_family, EngineConfig(max_outputs_per_request=8))
    args = Namespace(diffusion_num_steps=4, diffusion_guidance_scale=3.0, diffusion_noise_level=0.7,
                     rollout_seed=100, n_samples_per_prompt=4, diffusion_microgroup_size=2)
    prompt, group_index = "a green triangle", 2
    seed_base = (args.rollout_seed + group_index * args.n_samples_per_prompt) % 2**31
    group = [Sample(index=k, prompt=prompt) for k in range(args.n_samples_per_prompt)]
    with serving_in_thread(create_app(engine)) as url:
        for start in range(0, len(group), args.diffusion_microgroup_size):
            microgroup = group[start:start + args.diffusion_microgroup_size]
            params = build_rollout_sampling_params(args)
            params["seed"] = seed_base + start
            payload = build_rollout_generate_payload(params, prompt, num_outputs_per_prompt=len(microgroup))
            response = httpx.post(f"{url}/rollout/generate", json=payload, timeout=60)  # httpx sends Accept: */*
            assert response.status_code == 200, response.text
            output = response.json()
            for idx, (sample, record) in enumerate(zip(microgroup, output, strict=True)):
                apply_rollout_image_response(sample, record)
                sample.seed = params["seed"] + idx  # as miles does: sglang reports the first seed only

    steps = args.diffusion_num_steps
    reference = engine.generate(RolloutRequest(
        prompt=prompt, negative_prompt=" ", seed=seed_base, num_outputs_per_prompt=4, num_inference_steps=steps,
        guidance_scale=3.0, rollout=True, rollout_return_dit_trajectory=True, rollout_return_denoising_env=True,
        rollout_return_step_indices=list(range(steps + 1))))
    for sample, ref in zip(group, reference, strict=True):
        assert sample.seed == ref.seed
        assert sample.generated_output.shape == (3, 1, 64, 64)  # the [C, T, H, W] its rewards expect
        assert torch.equal(sample.generated_output[:, 0], ref.generated_output)
        assert sample.rollout_log_probs.shape == (steps,)  # every step is an SDE step here
        assert torch.equal(sample.rollout_log_probs, ref.rollout_log_probs)
        trajectory = sample.dit_trajectory
        assert trajectory.latents.shape[0] == steps + 1 and trajectory.timesteps.shape == (steps,)
        assert torch.equal(trajectory.latents, ref.dit_trajectory.latents)
        assert torch.equal(trajectory.sigmas, ref.dit_trajectory.sigmas)
        # Its trainer's conditioning: torch.cat(encoder_hidden_states) and txt_seq_lens, both branches of CFG.
        env = reference[0].denoising_env  # in-process, the conditioning travels once per request
        pos, neg = sample.denoising_env.pos_cond_kwargs, sample.denoising_env.neg_cond_kwargs
        assert torch.equal(torch.cat(pos.encoder_hidden_states), env["prompt_embeds"][0])
        assert torch.equal(torch.cat(neg.encoder_hidden_states), env["negative_prompt_embeds"][0])
        assert pos.txt_seq_lens == [env["prompt_embeds"].shape[1]]
        assert sample.inference_time_s > 0
