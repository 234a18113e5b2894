"""sglang-diffusion's post-training wire format: the default answer of `POST /rollout/generate`.

What sglang-diffusion's rollout endpoint returns (docs/wire-format.md has the field table):
a JSON list with one record per output, each with `request_id`, `prompt`, `seed` (the request's, on
every record: output i was sampled with `seed + i`), `generated_output` (image `[C, 1, H, W]`,
video `[C, F, H, W]`), `rollout_log_probs` `[T]` (one per denoising step, 0 on ODE steps),
`rollout_debug_tensors`, `dit_trajectory` {`latents` `[K + 1, …]`: the latents entering the returned
steps (all T when `rollout_return_step_indices` is null) and the final latent; `timesteps` `[K]`;
`sigmas` `[T + 1]`}, `denoising_env` {`image_kwargs`, `pos_cond_kwargs`, `neg_cond_kwargs`, `guidance`}
on every record, `inference_time_s` and `peak_memory_mb`. A tensor is `{"__tensor__": true, "data":
base64 of a safetensors file holding one tensor "t", "shape": [...], "dtype": "torch.float32"}`.

The engine's `RolloutOutput` is the compact, in-process shape (log-probs per SDE step, the latents of
the returned steps, conditioning once per request in diffrl's keys). `encode_response` turns it into
this format on the server and `decode_response` turns this format back into it on the client, so the
trainer reads one shape whatever the wire. `response_body` is the same bytes written while they are sent
and `ResponseStreamDecoder` reads them record by record as they arrive (`streaming.py`). The family adapter maps conditioning to and from sglang's
cond kwargs (`FamilyAdapter.cond_kwargs_to_wire` / `cond_kwargs_from_wire`). Nothing here unpickles:
tensors are safetensors, checked against a dtype whitelist, their declared shape and finiteness.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from diffrl.engine.protocol import DitTrajectory, RolloutOutput, RolloutRequest, cfg_scale
from diffrl.serving.streaming import Base64, Body, JsonListSplitter, TensorFile, json_parts
from diffrl.serving.wire import WireFormatError
from diffrl.models.base import FamilyAdapter, PromptEmbeds

JSON_MEDIA_TYPE = "application/json"
_KEY = "t"
ALLOWED_DTYPES = {torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                  torch.int16, torch.int8, torch.uint8, torch.bool}
# sglang's flow-matching schedulers report timesteps as σ·1000; a response without `sigmas` (sglang before
# its sigmas snapshot) gets its schedule back from them.
SGLANG_TIMESTEP_SCALE = 1000.0


# ---------------------------------------------------------------------------- tensors
def tensor_to_json(tensor: torch.Tensor) -> dict:
    tensor = tensor.detach().contiguous().cpu()
    data = base64.b64encode(save_safetensors({_KEY: tensor})).decode("ascii")
    return {"__tensor__": True, "data": data, "shape": list(tensor.shape), "dtype": str(tensor.dtype)}


def tensor_from_json(obj: Any, field: str) -> torch.Tensor:
    """One wire tensor, checked: base64 safetensors with the single tensor "t", a whitelisted dtype, the
    declared shape and dtype (when declared), finite values."""
    if not isinstance(obj, dict) or obj.get("__tensor__") is not True or not isinstance(obj.get("data"), str):
        raise WireFormatError(f"{field}: expected a tensor {{'__tensor__': true, 'data': <base64>}}")
    try:
        tensors = load_safetensors(base64.b64decode(obj["data"], validate=True))
    except (binascii.Error, ValueError) as err:
        raise WireFormatError(f"{field}: data is not base64 of a safetensors file: {err}") from None
    except Exception as err:  # safetensors raises several types for malformed bytes
        raise WireFormatError(f"{field}: data is not a valid safetensors file: {err}") from None
    if list(tensors) != [_KEY]:
        raise WireFormatError(f"{field}: expected one tensor named {_KEY!r}, got {sorted(tensors)}")
    tensor = tensors[_KEY]
    if tensor.dtype not in ALLOWED_DTYPES:
        raise WireFormatError(f"{field}: dtype {tensor.dtype} is not accepted")
    if "shape" in obj and list(tensor.shape) != obj["shape"]:
        raise WireFormatError(f"{field}: holds shape {list(tensor.shape)}, declared {obj['shape']}")
    if "dtype" in obj and obj["dtype"] not in (str(tensor.dtype), str(tensor.dtype).removeprefix("torch.")):
        raise WireFormatError(f"{field}: holds {tensor.dtype}, declared {obj['dtype']}")
    # A NaN or infinity anywhere makes the sum non-finite: one fast reduction instead of a mask (a sum of
    # finite values overflowing fp32 would be refused too, far beyond any latent or image).
    if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(
            (tensor if tensor.dtype in (torch.float32, torch.float64) else tensor.float()).sum()):
        raise WireFormatError(f"{field}: non-finite values")
    return tensor


def _to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tensor_to_json(value)
    if isinstance(value, dict):
        return {k: _to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_to_json(v) for v in value]
    return value


def _from_json(value: Any, field: str) -> Any:
    if isinstance(value, dict):
        if "__tensor__" in value:
            return tensor_from_json(value, field)
        return {k: _from_json(v, f"{field}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v, f"{field}[{i}]") for i, v in enumerate(value)]
    return value


# ---------------------------------------------------------------------------- steps
def sde_steps(req: RolloutRequest) -> list[int]:
    """The steps that inject noise (and have log-probs), ascending: as `Engine.plan` resolves them."""
    if not req.rollout:
        return []
    n = req.num_inference_steps
    return sorted(set(range(n) if req.rollout_sde_step_indices is None else req.rollout_sde_step_indices))


def compact_return_steps(req: RolloutRequest) -> list[int]:
    """The steps whose latents the in-process `RolloutOutput` carries (as `Engine.plan` resolves them)."""
    if req.rollout_return_step_indices is not None:
        return sorted(set(req.rollout_return_step_indices))
    return sorted({j for i in sde_steps(req) for j in (i, i + 1)})


def trajectory_steps(req: RolloutRequest) -> list[int]:
    """The steps of sglang's `dit_trajectory.latents` rows, in order: the requested steps below T (all
    of them when `rollout_return_step_indices` is null), then T, the final latent, always appended."""
    n = req.num_inference_steps
    requested = range(n) if req.rollout_return_step_indices is None else req.rollout_return_step_indices
    return [*sorted({i for i in requested if 0 <= i < n}), n]


def engine_request(req: RolloutRequest) -> RolloutRequest:
    """The request the engine runs to answer in this format: sglang's trajectory rows as returned steps."""
    if not req.rollout_return_dit_trajectory:
        return req
    return req.model_copy(update={"rollout_return_step_indices": trajectory_steps(req)})


# ---------------------------------------------------------------------------- server side
def encode_response(outputs: Sequence[RolloutOutput], req: RolloutRequest, family: FamilyAdapter,
                    request_id: str) -> bytes:
    """The engine's outputs for `engine_request(req)` as sglang's JSON list, in one piece."""
    return bytes(response_body(outputs, req, family, request_id))


def response_body(outputs: Sequence[RolloutOutput], req: RolloutRequest, family: FamilyAdapter,
                  request_id: str) -> Body:
    """`encode_response`'s bytes as a `streaming.Body`, written record by record as it is sent: each output's
    tensors are base64-encoded from their own memory then. The conditioning (the same for every output of a
    request) and the timesteps are encoded once, here, and repeated on every record."""
    n = req.num_inference_steps
    sde = torch.tensor(sde_steps(req), dtype=torch.int64)
    first = outputs[0]
    env = None
    if first.denoising_env is not None:
        env = _encoded(_to_json(_env_to_wire(first.denoising_env, family)))
    timesteps = sigmas = None
    if first.dit_trajectory is not None:
        timesteps = _encoded(tensor_to_json(first.dit_trajectory.timesteps[:-1]))  # the final latent has no step
        sigmas = _encoded(tensor_to_json(first.dit_trajectory.sigmas))
    records = []
    for out in outputs:
        image = out.generated_output if family.generates_video else out.generated_output.unsqueeze(1)
        log_probs = None
        if out.rollout_log_probs is not None:
            full = torch.zeros(n, dtype=torch.float32)
            full[sde] = out.rollout_log_probs.float()
            log_probs = _lazy_tensor(full)
        trajectory = None
        if out.dit_trajectory is not None:
            trajectory = {"latents": _lazy_tensor(out.dit_trajectory.latents), "timesteps": timesteps,
                          "sigmas": sigmas}
        records.append({
            "request_id": request_id, "prompt": req.prompt, "seed": req.seed,
            "generated_output": _lazy_tensor(image), "rollout_log_probs": log_probs,
            "rollout_debug_tensors": None, "denoising_env": env, "dit_trajectory": trajectory,
            "inference_time_s": out.inference_time_s, "peak_memory_mb": out.peak_memory_mb,
        })
    return Body(json_parts(records))


def _lazy_tensor(tensor: torch.Tensor) -> dict:
    """`tensor_to_json(tensor)` with its data base64-encoded only when the body is written."""
    return {"__tensor__": True, "data": Base64(TensorFile(tensor, _KEY)), "shape": list(tensor.shape),
            "dtype": str(tensor.dtype)}


def _encoded(value: Any) -> bytes:
    """JSON text of `value`, encoded once (`json_parts` repeats it as it is)."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def _env_to_wire(env: dict[str, torch.Tensor], family: FamilyAdapter) -> dict:
    pos = family.cond_kwargs_to_wire(PromptEmbeds(env["prompt_embeds"], env["text_ids"]), env["image_ids"])
    neg = None
    if env.get("negative_prompt_embeds") is not None:
        neg_ids = env.get("negative_text_ids", env["text_ids"])
        neg = family.cond_kwargs_to_wire(PromptEmbeds(env["negative_prompt_embeds"], neg_ids), env["image_ids"])
    # image_kwargs carry image conditioning (none for text-to-image); guidance is a guidance-distilled
    # model's embedded scale, which no diffrl family has: both null, as sglang sends them for such models.
    return {"image_kwargs": None, "pos_cond_kwargs": pos, "neg_cond_kwargs": neg, "guidance": None}


# ---------------------------------------------------------------------------- client side
def decode_response(payload: bytes, req: RolloutRequest,
                    family: type[FamilyAdapter] = FamilyAdapter) -> list[RolloutOutput]:
    """An sglang-format response to `req` as the engine's in-process outputs: log-probs of the SDE steps,
    the latents of the steps an in-process engine would return, the conditioning (diffrl's keys) on the
    first output only, output i's seed `seed + i`. `family` maps the cond kwargs (default: FLUX-style); a loaded
    family (not only a class) also says whether an unset `guidance_scale_2` means guidance_scale (a second expert)."""
    try:
        records = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as err:
        raise WireFormatError(f"response is not valid JSON: {err}") from None
    if not isinstance(records, list) or not records or not all(isinstance(r, dict) for r in records):
        raise WireFormatError("response body must be a non-empty list with one record per output")
    reader = _RecordReader(req, family)
    return [reader.output(i, record) for i, record in enumerate(records)]


class ResponseStreamDecoder:
    """`decode_response` as the bytes arrive: `feed(data)` returns the outputs whose records `data` completed
    (record i is decoded as soon as its closing brace is in); `finish()` checks the list was whole."""

    def __init__(self, req: RolloutRequest, family: type[FamilyAdapter] = FamilyAdapter):
        self._splitter = JsonListSplitter()
        self._reader = _RecordReader(req, family)
        self.count = 0

    def feed(self, data: bytes | memoryview) -> list[RolloutOutput]:
        outputs = []
        for text in self._splitter.feed(data):
            try:
                record = json.loads(text)
            except (ValueError, UnicodeDecodeError) as err:
                raise WireFormatError(f"output {self.count}: not valid JSON: {err}") from None
            if not isinstance(record, dict):
                raise WireFormatError("response body must be a non-empty list with one record per output")
            outputs.append(self._reader.output(self.count, record))
            self.count += 1
        return outputs

    def finish(self) -> None:
        self._splitter.finish()
        if self.count == 0:
            raise WireFormatError("response body must be a non-empty list with one record per output")


class _RecordReader:
    """One sglang record as the engine's in-process output (what `decode_response` does to each)."""

    def __init__(self, req: RolloutRequest, family: type[FamilyAdapter]):
        self.req, self.family = req, family
        self.n = req.num_inference_steps
        self.sde = sde_steps(req)
        self.rows = trajectory_steps(req)
        self.wanted = compact_return_steps(req)
        self.video = family.generates_video if family is not FamilyAdapter else (req.num_frames or 1) > 1

    def output(self, i: int, record: dict) -> RolloutOutput:
        req, n, where = self.req, self.n, f"output {i}"
        image = tensor_from_json(record.get("generated_output"), f"{where}.generated_output")
        if image.dim() == 4 and image.shape[1] == 1 and not self.video:
            image = image[:, 0]  # sglang's image [C, 1, H, W] → diffrl's [C, H, W]
        log_probs = None
        if record.get("rollout_log_probs") is not None:
            full = tensor_from_json(record["rollout_log_probs"], f"{where}.rollout_log_probs")
            if tuple(full.shape) != (n,):
                raise WireFormatError(f"{where}.rollout_log_probs: expected one per step [{n}], got {list(full.shape)}")
            log_probs = full[self.sde].float()
        trajectory = None
        if record.get("dit_trajectory"):
            trajectory = _decode_trajectory(record["dit_trajectory"], self.rows, self.wanted, n,
                                            f"{where}.dit_trajectory")
        env = None
        if i == 0 and record.get("denoising_env"):  # the same for every output: kept once, as in-process
            env = _decode_env(record["denoising_env"], self.family, trajectory, req, f"{where}.denoising_env")
        return RolloutOutput(
            seed=req.seed + i,  # sglang reports the request's seed on every record; output i drew seed + i
            generated_output=image, rollout_log_probs=log_probs, dit_trajectory=trajectory, denoising_env=env,
            weight_version=int(record.get("weight_version", -1)),
            inference_time_s=float(record.get("inference_time_s") or 0.0),
            peak_memory_mb=float(record.get("peak_memory_mb") or 0.0),
        )


def _decode_trajectory(obj: Any, rows: list[int], wanted: list[int], n: int, field: str) -> DitTrajectory:
    if not isinstance(obj, dict):
        raise WireFormatError(f"{field}: expected an object")
    latents = tensor_from_json(obj.get("latents"), f"{field}.latents")
    if latents.shape[0] != len(rows):
        raise WireFormatError(f"{field}.latents: {latents.shape[0]} rows, expected {len(rows)} (steps {rows})")
    timesteps = tensor_from_json(obj.get("timesteps"), f"{field}.timesteps").float().reshape(-1)
    if timesteps.shape[0] != len(rows) - 1:
        raise WireFormatError(f"{field}.timesteps: {timesteps.shape[0]} values, expected {len(rows) - 1}")
    if obj.get("sigmas") is not None:
        sigmas = tensor_from_json(obj["sigmas"], f"{field}.sigmas").float()
        if tuple(sigmas.shape) != (n + 1,):
            raise WireFormatError(f"{field}.sigmas: expected [{n + 1}], got {list(sigmas.shape)}")
    elif rows == list(range(n + 1)):
        sigmas = torch.cat([timesteps / SGLANG_TIMESTEP_SCALE, timesteps.new_zeros(1)])
    else:
        raise WireFormatError(f"{field}: no sigmas, and the timesteps of steps {rows[:-1]} do not give the schedule; "
                              "ask for every step (rollout_return_step_indices null)")
    position = {step: k for k, step in enumerate(rows)}
    missing = [s for s in wanted if s not in position]
    if missing:
        raise WireFormatError(f"{field}: steps {missing} are not in the returned trajectory {rows}")
    index = torch.tensor([position[s] for s in wanted], dtype=torch.int64)
    all_timesteps = torch.cat([timesteps, timesteps.new_zeros(1)])  # the final latent's σ is 0
    return DitTrajectory(latents=latents[index], timesteps=all_timesteps[index], sigmas=sigmas,
                         latent_step_indices=torch.tensor(wanted, dtype=torch.int64))


def _decode_env(obj: Any, family: type[FamilyAdapter], trajectory: DitTrajectory | None, req: RolloutRequest,
                field: str) -> dict[str, torch.Tensor] | None:
    if not isinstance(obj, dict):
        raise WireFormatError(f"{field}: expected an object")
    pos = _from_json(obj.get("pos_cond_kwargs"), f"{field}.pos_cond_kwargs")
    if not pos:
        return None
    env: dict[str, torch.Tensor] = {}
    try:
        cond, image_ids = family.cond_kwargs_from_wire(pos)
        env.update(prompt_embeds=cond.embeds, text_ids=cond.ids)
        if image_ids is not None:
            env["image_ids"] = image_ids
        neg = _from_json(obj.get("neg_cond_kwargs"), f"{field}.neg_cond_kwargs")
        if neg:
            uncond, _ = family.cond_kwargs_from_wire(neg)
            env.update(negative_prompt_embeds=uncond.embeds, negative_text_ids=uncond.ids)
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise WireFormatError(f"{field}: cond kwargs the {family.__name__} mapping cannot read: {err}") from None
    if trajectory is not None:
        env["sigmas"] = trajectory.sigmas
    scale = cfg_scale(req, None, family.has_true_cfg)  # None: the request left it to the server's default
    if scale is not None:
        env["guidance_scale"] = torch.tensor(scale)
    # The second expert's CFG scale (Wan2.2), which sglang's denoising_env has no field for: the request's, or,
    # left unset, the engine's default (guidance_scale) when `family` has a second expert. Whether it does is
    # per checkpoint: a family instance knows, a class does not (the scale is then kept only when requested).
    scale_2 = req.guidance_scale_2
    if scale_2 is None and family.uses_guidance_scale_2:
        scale_2 = scale
    if scale_2 is not None:
        env["guidance_scale_2"] = torch.tensor(scale_2)
    return env
