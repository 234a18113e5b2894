"""The engine: one request per microgroup, the prompt encoded once, the outputs denoised as one batch.

`Engine.generate(request)` validates the request (a `RequestError` naming the field, the engine
untouched), encodes the prompt (and the negative prompt when CFG is on) once, repeats the
conditioning to `num_outputs_per_prompt`, gives output i its own generator seeded `seed + i`
(initial noise and every SDE draw), and runs the shared denoising loop. A video family also gets the
request's `num_frames` (default: the family's) and returns `[C, F, H, W]` outputs. It is usable in-process
as is; `diffrl.serving.server` puts the same object behind HTTP.

Requests that wait while the model is busy are denoised together when their sampling settings
agree (`_Plan.batch_key`): one forward per step for several microgroups, up to
`max_batch_outputs` outputs. Each output keeps its own generator, so what a sample looks like does
not depend on what it was batched with (exactly on CPU; on GPU up to batch-size-dependent kernels).
A small model is launch-bound on a GPU, so this is where its rollout speed comes from.

Limits (`EngineConfig`): prompt length, guidance scale, noise level, outputs × steps per request,
per-request time, waiting requests, LoRA rank. A request is abandoned when it is cancelled (`cancel`
event, e.g. its client went away) or passes its deadline: a waiting one leaves the queue; a running
one is answered (`RequestCancelled`) before the next denoising step and its outputs' rows leave the
batch, while the batch's other requests go on to the same outputs they would have had; a batch with
no request left stops. Waiting requests hold no thread: a small pool (`worker_threads`) drives the
batches.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import hashlib
import resource
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Literal

import torch

from diffrl.data.condition_images import MAX_IMAGE_PIXELS
from diffrl.engine.checksums import compare_tensor_checksums, module_checksum
from diffrl.engine.condition_images import request_images
from diffrl.engine.denoise import DenoiseStopped, denoise
from diffrl.engine.protocol import (
    IMAGE_CONDITIONING_FIELDS,
    DitTrajectory,
    RolloutOutput,
    RolloutRequest,
    cfg_scale,
)
from diffrl.errors import RequestError
from diffrl.models.base import FamilyAdapter, PromptEmbeds
from diffrl.models.lora import LoraSpec, add_lora, check_lora, current_lora
from diffrl.sampling import make_generators
from diffrl.utils.offload import ModuleOffload, release_cached, family_modules


@dataclass
class EngineConfig:
    max_outputs_per_request: int = 64
    """Upper bound on num_outputs_per_prompt (memory guard)."""
    max_batch_outputs: int = 64
    """Waiting requests with the same sampling settings are denoised together up to this many outputs
    (1: never merge). A request larger than this still runs, alone."""
    batch_wait_s: float = 0.005
    """Before a batch that is not full starts, the engine waits until no request that could join it has
    arrived for this long. A rollout's microgroups reach the engine within milliseconds of each other;
    without the wait the first one takes the idle model alone and the rest queue behind its whole
    denoising loop (two batches per rollout instead of one). 0: start at once."""
    max_prompt_chars: int = 16384
    """Longest `prompt` / `negative_prompt` (characters); tokenizers truncate far below this anyway."""
    max_guidance_scale: float = 100.0
    max_noise_level: float = 10.0
    """Upper bounds of `guidance_scale` (and `guidance_scale_2`, `true_cfg_scale`) and `rollout_noise_level`."""
    max_output_steps: int | None = None
    """Upper bound of num_outputs_per_prompt × num_inference_steps (None: no bound, for trusted in-process
    callers; `diffrl serve` sets one)."""
    max_num_frames: int | None = None
    """Upper bound of a video request's `num_frames` (None: no bound, for trusted in-process callers;
    `diffrl serve` sets one): a family with no positional limit (Cosmos3) would otherwise denoise and return
    any length, 100,001 frames and a gigabyte-sized response alike."""
    max_pixels: int | None = None
    max_request_pixels: int | None = None
    """Upper bounds of width × height (one output, one frame) and of num_outputs_per_prompt × num_frames × width ×
    height (None: no bound, for trusted in-process callers; `diffrl serve` sets them): width and height have no
    bound of their own, and families whose size rule is a multiple of 16 accept 65536 × 65536."""
    image_roots: tuple[str, ...] | None = ()
    """Directories a request's `image_path` may name files under (default: none, images come as bytes or data: URLs,
    as the trainer and evaluation send them; None: any file, for trusted in-process callers only)."""
    request_timeout_s: float | None = None
    """A request not finished this long after it arrived is abandoned (None: never; `diffrl serve` sets one)."""
    max_pending_requests: int = 1024
    """Requests accepted and not finished; more are refused (`EngineBusy`, HTTP 429)."""
    worker_threads: int = 4
    """Threads that drive denoising batches (one runs the model at a time; waiting requests hold none)."""
    max_lora_rank: int = 256
    """Largest LoRA rank `add_lora_adapter` hosts."""
    prompt_cache_bytes: int = 256 << 20
    """Encoded prompts kept for later requests of the same weights (least recently used out first; 0: none).
    A group's microgroups, and every group of a prompt within a rollout, share its encoding."""
    forward_graph: Literal["inference", "training"] = "inference"
    """Which compiled graph the denoising forward runs: inference (no gradients), or training: gradients on for the
    parameters that require them, outputs detached at once. An in-process engine whose trainer replays its steps
    (Flow-GRPO's ratio) samples in the trainer's graph so that the replay gives the rollout's log-probs: the
    compiler fuses the two graphs differently (BENCHMARKS.md, "Where a compiled replay parts from the rollout").
    Costs the checkpointed blocks' inputs while a step runs; eager gives the same numbers either way."""
    training_graph_rows: int | None = None
    """With forward_graph training: outputs per velocity forward at most (the trainer's micro-batch), so that without
    gradient checkpointing a step holds one micro-batch's activations, and each forward has the replay's shape.
    None: the whole batch in one forward."""


INT64_MAX = 2**63 - 1  # weight versions travel as int64 (msgpack, JSON clients)


class RequestCancelled(Exception):
    """A request abandoned before it finished: its client went away, or it passed its deadline."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class EngineBusy(Exception):
    """More requests wait than `max_pending_requests`: come back later (HTTP 429)."""


class EngineAsleep(RequestError):
    """The engine sleeps (`Engine.sleep`): no generation and no weight change until it is woken (HTTP 503)."""


class EngineConflict(RequestError):
    """What was asked cannot happen in the engine's present state (put to sleep with requests in flight: HTTP 409)."""


@dataclass(frozen=True)
class _Plan:
    """A validated request, with every default resolved."""

    height: int
    width: int
    guidance_scale: float
    sde_type: str
    sde_steps: tuple[int, ...]
    return_steps: tuple[int, ...]
    batch_key: tuple  # requests with equal keys can share one denoising batch
    num_frames: int | None = None  # video families only (None for images)
    guidance_scale_2: float | None = None  # the second expert's CFG scale (families with one), resolved
    generator_device: torch.device = torch.device("cpu")  # where the outputs' generators draw


@dataclass
class _Ticket:
    """A request waiting for (or in) a denoising batch."""

    req: RolloutRequest
    plan: _Plan
    images: tuple[torch.Tensor, ...] = ()  # the decoded condition images (`uint8 [3, H, W]`)
    result: Future = field(default_factory=Future)
    cancel: threading.Event = field(default_factory=threading.Event)
    deadline: float | None = None  # time.monotonic() after which the request is abandoned

    def abandoned(self) -> RequestCancelled | None:
        if self.cancel.is_set():
            return RequestCancelled("the client went away")
        if self.deadline is not None and time.monotonic() > self.deadline:
            return RequestCancelled("the request ran past the server's time limit (request_timeout_s)")
        return None

    def settle(self, value) -> None:
        """Hand the caller its outputs or error (once; a caller that gave up cancelled the future)."""
        try:
            if isinstance(value, BaseException):
                self.result.set_exception(value)
            else:
                self.result.set_result(value)
        except InvalidStateError:
            pass


class Engine:
    def __init__(self, family: FamilyAdapter, config: EngineConfig | None = None):
        self.family = family
        self.config = config or EngineConfig()
        if self.config.forward_graph not in ("inference", "training"):
            raise ValueError(f"forward_graph {self.config.forward_graph!r}: expected inference or training")
        if self.config.training_graph_rows is not None and self.config.training_graph_rows < 1:
            raise ValueError(f"training_graph_rows must be >= 1 or None, got {self.config.training_graph_rows}")
        self.weight_version = 0
        self._model_lock = threading.Lock()  # one denoise at a time on this model
        self._count_lock = threading.Lock()  # guards _in_flight and _waiting
        self._arrived = threading.Condition(self._count_lock)  # notified when a request starts waiting
        self._in_flight = 0
        self._waiting: list[_Ticket] = []
        self.denoise_batches = 0  # batches run so far (fewer than requests when requests share batches)
        self.prompt_encodes = 0  # text-encoder calls so far (fewer than prompts when encodings are shared)
        self.image_encodes = 0  # condition-image encodings so far (one per request's images, or fewer when shared)
        self._prompts = _PromptCache(self.config.prompt_cache_bytes)  # used under _model_lock
        # Bounded: waiting requests sit in `_waiting`, not in threads (each thread can grow its own malloc arena).
        self._threads = ThreadPoolExecutor(max_workers=max(1, self.config.worker_threads), thread_name_prefix="engine")
        self._asleep = 0  # the level it sleeps at (`sleep`); 0: awake
        self._offload: ModuleOffload | None = None  # the family's weights while asleep at level 2
        self._finite_schedules: dict[tuple, bool] = {}  # (steps, height, width, frames) → the schedule is finite

    @property
    def asleep(self) -> int:
        """The level the engine sleeps at (1: caches released; 2: weights in host memory too); 0: awake."""
        return self._asleep

    @property
    def in_flight(self) -> int:
        """Requests accepted and not finished (waiting or running): the routing load figure."""
        return self._in_flight

    # ------------------------------------------------------------------ validation
    def _finite_schedule(self, n: int, height: int, width: int, num_frames: int | None) -> bool:
        """Whether the family's schedule of `n` steps at this size is finite, checked once per setting: the check
        reads the schedule back from the device, which waits for the batch denoising there."""
        key = (n, height, width, num_frames)
        finite = self._finite_schedules.get(key)
        if finite is None:
            finite = bool(torch.isfinite(self.family.sigmas(n, height, width, **_frames(num_frames))).all())
            if len(self._finite_schedules) >= 1024:  # a server's clients may send any number of settings
                self._finite_schedules.clear()
            self._finite_schedules[key] = finite
        return finite

    def plan(self, req: RolloutRequest) -> _Plan:
        """Resolve defaults and refuse what this engine cannot serve, naming the field."""
        family, cfg = self.family, self.config
        limit = cfg.max_outputs_per_request
        if not 1 <= req.num_outputs_per_prompt <= limit:
            raise RequestError("num_outputs_per_prompt", f"must be between 1 and {limit}, got {req.num_outputs_per_prompt}")
        for name in ("prompt", "negative_prompt"):
            if len(getattr(req, name)) > cfg.max_prompt_chars:
                raise RequestError(name, f"{len(getattr(req, name))} characters, above the limit of {cfg.max_prompt_chars}")
        for name in ("guidance_scale", "guidance_scale_2", "true_cfg_scale"):
            value = getattr(req, name)
            if value is not None and not 0 <= value <= cfg.max_guidance_scale:
                raise RequestError(name, f"must be between 0 and {cfg.max_guidance_scale}, got {value}")
        if not 0 <= req.rollout_noise_level <= cfg.max_noise_level:
            raise RequestError("rollout_noise_level", f"must be between 0 and {cfg.max_noise_level}, "
                                                      f"got {req.rollout_noise_level}")
        work = req.num_outputs_per_prompt * req.num_inference_steps
        if cfg.max_output_steps is not None and work > cfg.max_output_steps:
            raise RequestError("num_inference_steps", f"num_outputs_per_prompt × num_inference_steps = {work} is above "
                                                      f"this engine's limit of {cfg.max_output_steps}")
        for name in IMAGE_CONDITIONING_FIELDS:
            if getattr(req, name) is None:
                continue
            if not family.accepts_image_conditioning:
                kind = "text-to-video" if family.generates_video else "text-to-image"
                raise RequestError(name, f"the {family.name} family is {kind} only; image conditioning is refused")
            if name != "image_path":
                raise RequestError(name, "send the condition images as image_path (paths, data: URLs or bytes)")
            if len(req.image_path) > family.max_condition_images:
                raise RequestError(name, f"{len(req.image_path)} condition images; this {family.name} checkpoint takes "
                                         f"at most {family.max_condition_images}")
        num_frames = None
        if family.generates_video:
            num_frames = family.default_num_frames if req.num_frames is None else req.num_frames
            if cfg.max_num_frames is not None and num_frames > cfg.max_num_frames:
                raise RequestError("num_frames", f"num_frames={num_frames} is above this engine's limit of "
                                                 f"{cfg.max_num_frames}")
        elif req.num_frames not in (None, 1):
            raise RequestError("num_frames", f"the {family.name} family generates images, not video (got {req.num_frames})")
        if req.fps is not None and family.frame_rate is not None and req.fps != family.frame_rate:
            raise RequestError("fps", f"the {family.name} family samples at its checkpoint's {family.frame_rate:g} fps "
                                      f"(positions and prompt depend on it); got {req.fps}")
        if req.guidance_scale_2 is not None and not family.uses_guidance_scale_2:
            raise RequestError("guidance_scale_2", f"the {family.name} family (this checkpoint) has no second expert; "
                                                   "use guidance_scale")
        if (req.true_cfg_scale is not None and req.true_cfg_scale > 1 and not family.has_true_cfg
                and req.guidance_scale is not None and req.guidance_scale < 1):
            raise RequestError("guidance_scale", f"true_cfg_scale {req.true_cfg_scale:g} switches CFG on at the "
                                                 f"{family.name} family's guidance_scale, which is {req.guidance_scale:g}; "
                                                 "a scale below 1 blends toward the unconditional prediction (use >= 1)")
        generator_device = _generator_device(req.generator_device, family.device)
        default_h, default_w = family.default_size()
        height = default_h if req.height is None else req.height  # 0 is refused by the size check, not "default"
        width = default_w if req.width is None else req.width
        # Before the family's size check: the bound holds whatever the family accepts.
        if cfg.max_pixels is not None and height * width > cfg.max_pixels:
            raise RequestError("width", f"width × height = {width * height} pixels is above this engine's limit of "
                                        f"{cfg.max_pixels}")
        pixels = req.num_outputs_per_prompt * (num_frames or 1) * height * width
        if cfg.max_request_pixels is not None and pixels > cfg.max_request_pixels:
            raise RequestError("num_outputs_per_prompt", f"num_outputs_per_prompt × num_frames × width × height = "
                                                         f"{pixels} pixels is above this engine's limit of "
                                                         f"{cfg.max_request_pixels}")
        family.check_size(height, width, **_frames(num_frames))
        n = req.num_inference_steps
        # A scheduler may have no schedule at some step counts (one step with a terminal stretch divides by 0).
        if not self._finite_schedule(n, height, width, num_frames):
            raise RequestError("num_inference_steps", f"the {family.name} family's scheduler has no finite schedule "
                                                      f"of {n} steps at this size")
        sde_type = req.rollout_sde_type if req.rollout else "ode"
        sde_steps = tuple(range(n)) if req.rollout_sde_step_indices is None else tuple(req.rollout_sde_step_indices)
        # Checked whether or not `rollout` is set: a bad index is a bad request either way.
        _check_indices("rollout_sde_step_indices", sde_steps, n - 1)
        if len(set(sde_steps)) != len(sde_steps):
            raise RequestError("rollout_sde_step_indices", f"repeated step index in {_short(sde_steps)}")
        if not req.rollout:
            sde_steps = ()
        if req.rollout_return_step_indices is None:
            return_steps = tuple(sorted({j for i in sde_steps for j in (i, i + 1)}))
        else:
            return_steps = tuple(sorted(set(req.rollout_return_step_indices)))
        _check_indices("rollout_return_step_indices", return_steps, n)
        guidance = cfg_scale(req, family.default_guidance_scale, family.has_true_cfg)
        guidance_2 = None
        if family.uses_guidance_scale_2:  # as diffusers' WanPipeline: unset means guidance_scale
            guidance_2 = guidance if req.guidance_scale_2 is None else req.guidance_scale_2
            if guidance <= 1.0 < guidance_2:
                raise RequestError("guidance_scale_2", f"{guidance_2} needs CFG, which runs only when "
                                                       f"guidance_scale > 1 (got {guidance})")
        sde_steps = tuple(sorted(sde_steps))
        key = (height, width, num_frames, guidance, guidance_2, sde_type, sde_steps, return_steps,
               req.num_inference_steps, req.rollout, req.rollout_noise_level, req.rollout_log_prob_no_const,
               req.rollout_return_dit_trajectory, req.rollout_return_denoising_env,
               req.rollout_return_denoising_env and req.rollout_return_negative_env, str(generator_device),
               self._returns_uncond_velocity(req, guidance))
        return _Plan(height, width, guidance, sde_type, sde_steps, return_steps, key, num_frames=num_frames,
                     guidance_scale_2=guidance_2, generator_device=generator_device)

    def _returns_uncond_velocity(self, req: RolloutRequest, guidance: float) -> bool:
        """Whether this request's outputs carry CFG's unconditional velocities: asked for, on SDE steps, with CFG
        on and the half run apart (otherwise there is no such half to return, and none comes back)."""
        return (req.rollout_return_uncond_velocity and req.rollout and guidance > 1.0
                and self.family.reuses_uncond_velocity)

    # ------------------------------------------------------------------ generation
    def generate(self, req: RolloutRequest, cancel: threading.Event | None = None) -> list[RolloutOutput]:
        ticket = self._ticket(req, cancel)
        ticket.images = self._decode_images(req)
        self._enqueue(ticket)
        try:
            self._drive(ticket)
            return ticket.result.result()
        finally:
            self._leave(ticket)

    async def agenerate(self, req: RolloutRequest, cancel: threading.Event | None = None) -> list[RolloutOutput]:
        """`generate` for an event loop: the request waits in the queue (no thread) while a pool thread
        drives a batch that includes it. Cancelling the awaiting task (or setting `cancel`) abandons it.
        Condition images are decoded in a worker thread: a large source does not hold up the loop's other work."""
        ticket = self._ticket(req, cancel)
        if req.image_path:
            ticket.images = await asyncio.to_thread(self._decode_images, req)
        self._enqueue(ticket)
        try:
            asyncio.get_running_loop().run_in_executor(self._threads, self._drive, ticket)
            return await asyncio.wrap_future(ticket.result)
        finally:
            self._leave(ticket)

    def _ticket(self, req: RolloutRequest, cancel: threading.Event | None) -> _Ticket:
        ticket = _Ticket(req, self.plan(req))  # refuse before counting: a bad request never occupies the engine
        if cancel is not None:
            ticket.cancel = cancel
        if self.config.request_timeout_s is not None:
            ticket.deadline = time.monotonic() + self.config.request_timeout_s
        return ticket

    def _decode_images(self, req: RolloutRequest) -> tuple[torch.Tensor, ...]:
        return request_images(req.image_path, self.config.image_roots, self.config.max_pixels or MAX_IMAGE_PIXELS)

    def _enqueue(self, ticket: _Ticket) -> None:
        with self._count_lock:
            if self._asleep:
                raise EngineAsleep("request", "the engine is asleep: wake it first (POST /resume_memory_occupation)")
            if self._in_flight >= self.config.max_pending_requests:
                raise EngineBusy(f"{self._in_flight} requests in flight, the limit is {self.config.max_pending_requests}")
            self._in_flight += 1
            self._waiting.append(ticket)
            self._arrived.notify_all()

    def _leave(self, ticket: _Ticket) -> None:
        """The caller is done with `ticket` (answered, failed or gone): it leaves the queue and the count."""
        with self._count_lock:
            self._in_flight -= 1
            if ticket in self._waiting:  # abandoned before any batch took it
                self._waiting.remove(ticket)
        # Answered or not (a cancelled await cancels the future too): a batch that still holds it drops
        # its rows before the next step.
        ticket.cancel.set()
        ticket.settle(RequestCancelled("the caller stopped waiting"))

    def _drive(self, ticket: _Ticket) -> None:
        # Whoever holds the model runs a batch that may include this ticket; otherwise we take
        # the model and run our ticket with whatever compatible requests wait behind it.
        while not ticket.result.done():
            with self._model_lock:
                if ticket.result.done():
                    break
                if (gone := ticket.abandoned()) is not None:
                    with self._count_lock:
                        if ticket in self._waiting:
                            self._waiting.remove(ticket)
                    ticket.settle(gone)
                    break
                self._gather(ticket)
                self._run_batch(self._take_batch(ticket))

    def _gather(self, first: _Ticket) -> None:
        """Hold the model (not yet running) while requests that can share `first`'s batch keep arriving:
        until the batch is full or none has come for `batch_wait_s`. Bounded: each round needs a new one."""
        if self.config.batch_wait_s <= 0:
            return
        with self._arrived:
            seen = -1
            while True:
                outputs = sum(t.req.num_outputs_per_prompt for t in self._waiting if t.plan.batch_key == first.plan.batch_key)
                if outputs >= self.config.max_batch_outputs or outputs == seen:
                    return
                seen = outputs
                self._arrived.wait(self.config.batch_wait_s)

    def _take_batch(self, first: _Ticket) -> list[_Ticket]:
        """`first` and the waiting requests that can share its batch, in arrival order."""
        with self._count_lock:
            batch, total = [first], first.req.num_outputs_per_prompt
            for t in self._waiting:
                n = t.req.num_outputs_per_prompt
                if t.abandoned() is not None:
                    continue  # its own driver settles it
                if t is not first and t.plan.batch_key == first.plan.batch_key and total + n <= self.config.max_batch_outputs:
                    batch.append(t)
                    total += n
            self._waiting = [t for t in self._waiting if t not in batch]
        return batch

    def _run_batch(self, batch: list[_Ticket]) -> None:
        # If even an interrupt stops the batch, its other callers must hear of it, not wait forever.
        outputs: list = [RuntimeError("the engine was interrupted")] * len(batch)
        try:
            outputs = self._generate(batch)
        except DenoiseStopped:  # every request of the batch was abandoned (each was answered as it left)
            outputs = [t.abandoned() or RequestCancelled("abandoned") for t in batch]
        except Exception as err:  # noqa: BLE001 - handed to every caller of the batch below
            outputs = [err] * len(batch)
        finally:
            for t, out in zip(batch, outputs, strict=True):
                t.settle(out)

    def add_lora_adapter(self, spec: LoraSpec) -> bool:
        """Host the trainer's LoRA adapter (unmerged), so later weight updates can carry only its
        tensors. True when added; False when the same adapter is already there; a different one is
        refused, since its weights could not be told apart."""
        with self._model_lock:
            self._require_awake("lora")
            existing = current_lora(self.family.transformer)
            if existing is not None:
                if existing != spec:
                    raise RequestError("lora", f"this engine already has a different LoRA adapter: {existing.model_dump()}")
                return False
            check_lora(self.family.transformer, spec, self.config.max_lora_rank)  # before anything is installed
            add_lora(self.family.transformer, spec)  # removes what it built if it fails part-way
            return True

    def update_weights(self, tensors: dict[str, torch.Tensor], version: int | None = None) -> int:
        """Load named transformer tensors (a trainer's update), between batches. All or nothing: every
        name, shape and dtype is checked, and every tensor cast to its parameter's dtype and checked finite
        there, before anything is written. A tensor must have its parameter's dtype, or be a float tensor
        for a float parameter (cast; a value that overflows the parameter's dtype is refused): an integer
        or bool tensor is never cast into a float weight. `version`: 0 ≤ version < 2**63."""
        if version is not None and not 0 <= version <= INT64_MAX:
            raise RequestError("x-weight-version", f"must be an integer between 0 and {INT64_MAX}, got {version}")
        with self._model_lock, torch.no_grad():
            self._require_awake("weights")
            state = self.family.transformer.state_dict()
            if version is None and self.weight_version >= INT64_MAX:
                raise RequestError("x-weight-version", "the weight version would pass 2**63 - 1; send one explicitly")
            cast = {}
            for name, t in tensors.items():
                if name not in state:
                    raise RequestError("weights", f"unknown tensor {name[:200]!r} for this {self.family.name} transformer")
                target = state[name]
                if tuple(t.shape) != tuple(target.shape):
                    raise RequestError("weights", f"{name}: shape {tuple(t.shape)}, the model has {tuple(target.shape)}")
                if t.dtype != target.dtype and not (t.is_floating_point() and target.is_floating_point()):
                    raise RequestError("weights", f"{name}: dtype {t.dtype} cannot stand for the model's {target.dtype}")
                value = t.to(device=target.device, dtype=target.dtype)
                if value.is_floating_point() and not torch.isfinite(value).all():
                    raise RequestError("weights", f"{name}: non-finite values in the model's dtype {target.dtype}")
                cast[name] = value
            for name, value in cast.items():
                state[name].copy_(value)
            self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    def _require_awake(self, field: str) -> None:
        if self._asleep:
            raise EngineAsleep(field, "the engine is asleep: wake it first (POST /resume_memory_occupation)")

    # ------------------------------------------------------------------ sleep and wake
    def sleep(self, level: int = 2) -> int:
        """Release device memory while the engine is idle (a trainer trains on the same device): level 1 frees
        the encoded prompts and the allocator's cache, level 2 also moves every module's weights to host memory
        (pinned when they come from a GPU). Asleep, the engine refuses requests and weight changes. Refused
        while requests are in flight. A deeper level than the present one goes deeper; a shallower one changes
        nothing. Returns the bytes moved to the host."""
        if level not in (1, 2):
            raise RequestError("level", f"must be 1 (caches) or 2 (caches and weights), got {level!r}")
        with self._count_lock:
            if self._in_flight:
                raise EngineConflict("request", f"{self._in_flight} requests are in flight; the engine sleeps "
                                                "only when idle")
            self._asleep = max(self._asleep, level)  # requests are refused from here on
        moved = 0
        device = self.family.device  # read before the weights move: at level 2 they end on the host
        with self._model_lock:
            if level == 2 and self._offload is None:
                offload = ModuleOffload(family_modules(self.family), device)
                moved = offload.offload()
                self._offload = offload
            self._prompts.clear()  # encoded prompts are device memory too
        gc.collect()  # the last batch's tensors, before the allocator's cache is emptied
        release_cached(device)
        return moved

    def wake(self) -> int:
        """Bring the weights back to the device, bit for bit, and accept requests again (awake: nothing to do).
        Returns the bytes moved back."""
        with self._model_lock:
            offload, self._offload = self._offload, None
            moved = offload.restore() if offload is not None else 0
            with self._count_lock:
                self._asleep = 0
        return moved

    # ------------------------------------------------------------------ checksums
    def pipeline_modules(self) -> dict[str, torch.nn.Module]:
        """The family's modules under the names of the pipeline's components (model_index.json, as sglang-diffusion
        names them): `transformer` (Wan2.2: `transformer` and `transformer_2`, the experts), and `vae` and
        `text_encoder` where the family holds one under that name."""
        family, found = self.family, {}
        if family.lora_components:  # a transformer that wraps several of the pipeline's components
            for name in family.lora_components:
                module = getattr(family.transformer, name, None)
                if isinstance(module, torch.nn.Module):
                    found[name] = module
        else:
            found["transformer"] = family.transformer
        for name in ("vae", "text_encoder"):
            module = getattr(family, name, None)
            if isinstance(module, torch.nn.Module):
                found[name] = module
        return found

    def weights_checksums(self, module_names: list[str] | None = None) -> dict[str, str]:
        """SHA-256 of each named module's parameters as sglang-diffusion computes it (`checksums.module_checksum`);
        None: every module of `pipeline_modules`; a name it does not hold: "not_found". Taken between batches and
        weight updates, so a checksum never mixes two versions."""
        with self._model_lock, torch.no_grad():
            modules = self.pipeline_modules()
            names = list(modules) if module_names is None else module_names
            return {name: module_checksum(modules[name]) if name in modules else "not_found" for name in names}

    def check_tensor_checksums(self, module_name: str, expected: dict[str, str]) -> tuple[bool, str]:
        """Compare a module's tensors (parameters, then buffers) with expected per-tensor SHA-256 values
        (`checksums.tensor_sha256`): (True, what was verified) or (False, which tensors are missing or differ)."""
        with self._model_lock, torch.no_grad():
            module = self.pipeline_modules().get(module_name)
            if module is None:
                return False, f"this engine holds no module {module_name[:100]!r}"
            return compare_tensor_checksums(module_name, module, expected)

    def _encode(self, prompts: list[str], images: list[tuple[torch.Tensor, ...]] | None = None,
                encoded_images: dict[str, object] | None = None, size: dict | None = None,
                encoders: Callable[[], None] = lambda: None) -> list[PromptEmbeds]:
        """Each prompt's conditioning, with its request's condition images folded in; a prompt (or prompt and
        images) seen in this batch, or earlier under the same weights, is not encoded again (encoding is
        deterministic, and nothing mutates an encoding once made). `encoded_images`: the batch's condition images
        by digest, each encoded once (a request's prompt and negative prompt share them). `size`: the output's
        height, width and num_frames, for a family whose condition images are encoded at the output's size
        (`condition_images_need_size`; part of the cache key then). `encoders()` comes before a text encoder runs
        (`FamilyAdapter.text_encoders_when_needed`: an offloaded one visits the device only on a cache miss)."""
        size_key = f"@{sorted(size.items())}" if size else ""
        encode_images = (lambda pictures: self.family.encode_condition_images(pictures, **size)) if size else \
            self.family.encode_condition_images
        out, fresh = [], {}
        images = images if images is not None else [()] * len(prompts)
        encoded_images = encoded_images if encoded_images is not None else {}
        for prompt, pictures in zip(prompts, images, strict=True):
            digest = _images_digest(pictures) + size_key if pictures else None
            key = prompt if digest is None else (prompt, digest)
            encoded = fresh.get(key)
            if encoded is None:
                encoded = self._prompts.get(key, self.weight_version)
            if encoded is None and digest is not None and self.family.prompt_sees_images:
                if digest not in encoded_images:  # the prompt's encoding reads the images (Qwen-Image-Edit)
                    encoders()  # a family may hold its image encoder with its text encoders (HunyuanVideo 1.5)
                    encoded_images[digest] = encode_images(pictures)
                    self.image_encodes += 1
                encoders()
                encoded = fresh[key] = self.family.encode_prompts_with_images([prompt], encoded_images[digest])
                self.prompt_encodes += 1
                self._prompts.put(key, encoded)
            if encoded is None:
                encoded = self._prompts.get(prompt, self.weight_version) if digest is not None else None
                if encoded is None:
                    encoders()
                    encoded = self.family.encode_prompts([prompt])
                    self.prompt_encodes += 1
                    self._prompts.put(prompt, encoded)
                if digest is not None:
                    if digest not in encoded_images:
                        encoders()
                        encoded_images[digest] = encode_images(pictures)
                        self.image_encodes += 1
                    encoded = self.family.condition_on_images(encoded, encoded_images[digest])
                    self._prompts.put(key, encoded)
                fresh[key] = encoded
            out.append(encoded)
        return out

    def clear_prompt_cache(self) -> None:
        """Free the encoded prompts kept for later requests (a colocated engine going to sleep)."""
        with self._model_lock:
            self._prompts.clear()

    @torch.no_grad()
    def _generate(self, batch: list[_Ticket]) -> list[list[RolloutOutput] | Exception]:
        """Denoise the requests of `batch` (same batch key) as one batch; outputs (or the error) per request."""
        family = self.family
        device = family.device
        plan = batch[0].plan
        req0 = batch[0].req
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        self.denoise_batches += 1
        sizes = [t.req.num_outputs_per_prompt for t in batch]
        # Each distinct prompt of the batch is encoded once, then repeated to its requests' outputs: the
        # microgroups of one group (M = 1: one request per sample) share a prompt and a negative prompt, and a
        # real text encoder (T5-XXL, Qwen2.5-VL) costs a forward of billions of parameters per prompt.
        with family.text_encoders_when_needed() as encoders:
            images, encoded_images = [t.images for t in batch], {}
            size = (dict(height=plan.height, width=plan.width, num_frames=plan.num_frames)
                    if family.condition_images_need_size else None)
            conds = self._encode([t.req.prompt for t in batch], images, encoded_images, size, encoders)
            negative_env = req0.rollout_return_denoising_env and req0.rollout_return_negative_env  # the batch's key
            unconds = (self._encode([t.req.negative_prompt for t in batch], images, encoded_images, size, encoders)
                       if plan.guidance_scale > 1.0 or negative_env else None)
        if len(batch) > 1 and not (_same_ids(conds) and _same_ids(unconds or [])):
            outputs = []  # text lengths differ: no shared batch, one request at a time
            for t in batch:
                try:
                    outputs += self._generate([t])
                except DenoiseStopped:
                    outputs.append(t.abandoned() or RequestCancelled("abandoned"))
            return outputs
        cond = _concat([c.repeat(n) for c, n in zip(conds, sizes)])
        uncond = (_concat([u.repeat(n) for u, n in zip(unconds, sizes)])
                  if unconds is not None and plan.guidance_scale > 1.0 else None)  # encoded for the env alone: no CFG
        seeds = [t.req.seed + i for t in batch for i in range(t.req.num_outputs_per_prompt)]
        generators = make_generators(seeds, device=plan.generator_device)
        latents = family.prepare_latents(generators, plan.height, plan.width, **_frames(plan.num_frames),
                                         **({"cond": cond} if family.latents_need_conditioning else {}))
        sigmas = family.sigmas(req0.num_inference_steps, plan.height, plan.width, **_frames(plan.num_frames))
        live = list(range(len(batch)))  # positions in `batch` of the requests still denoised, in row order
        dropped: dict[int, RequestCancelled] = {}

        def keep_rows() -> list[int] | None:
            """Between two steps: answer each newly abandoned request now and drop its rows from the batch."""
            nonlocal live
            gone = {k: err for k in live if (err := batch[k].abandoned()) is not None}
            if not gone:
                return None
            rows, start = [], 0
            for k in live:
                if k not in gone:
                    rows += range(start, start + sizes[k])
                start += sizes[k]
            for k, err in gone.items():
                batch[k].settle(err)
            dropped.update(gone)
            live = [k for k in live if k not in gone]
            return rows

        uncond_steps = plan.sde_steps if self._returns_uncond_velocity(req0, plan.guidance_scale) else ()
        result = denoise(
            family, latents, sigmas, cond, uncond, plan.guidance_scale, generators=generators,
            sde_type=plan.sde_type, noise_level=req0.rollout_noise_level, sde_step_indices=plan.sde_steps,
            return_step_indices=plan.return_steps if req0.rollout_return_dit_trajectory else (),
            log_prob_no_const=req0.rollout_log_prob_no_const, guidance_scale_2=plan.guidance_scale_2,
            keep_rows=keep_rows, training_graph=self.config.forward_graph == "training",
            training_graph_rows=self.config.training_graph_rows, uncond_step_indices=uncond_steps,
        )
        # Both queued before either is read back: the decode starts without waiting for the host.
        finite = torch.isfinite(result.latents).flatten(1).all(1)
        decode_cond = {}
        if family.latents_need_conditioning:  # the conditioning of the rows the loop kept
            kept = torch.as_tensor(result.rows, device=cond.embeds.device)
            decode_cond["cond"] = cond.rows(kept)
        images = family.decode(result.latents, plan.height, plan.width, **_frames(plan.num_frames), **decode_cond).cpu()
        finite = finite.cpu()
        elapsed = time.perf_counter() - start
        peak_mb = _peak_memory_mb(device)
        steps = torch.tensor(plan.return_steps, dtype=torch.int64)
        sigmas_cpu = sigmas.cpu()
        timesteps = family.model_timesteps(sigmas_cpu[steps])
        kept = {s: result.trajectory[s].cpu() for s in plan.return_steps} if req0.rollout_return_dit_trajectory else {}
        log_probs = result.log_probs.cpu()
        uncond_velocities = (torch.stack([result.uncond_velocities[s] for s in uncond_steps], dim=1).cpu()
                             if uncond_steps else None)  # [B, K, *latent_shape]
        outputs, row = [], 0  # `result` holds the rows of the `live` requests only
        for k, t in enumerate(batch):
            req, n = t.req, t.req.num_outputs_per_prompt
            if k in dropped:  # answered already
                outputs.append(dropped[k])
                continue
            if not finite[row:row + n].all():  # this request fails; the others of the batch stand
                outputs.append(FloatingPointError(f"non-finite latents for prompt {req.prompt!r} seed {req.seed}"))
                row += n
                continue
            env = (_denoising_env(conds[k], unconds[k] if unconds else None, latents.ids, sigmas, plan)
                   if req.rollout_return_denoising_env else None)
            mine = []
            for i in range(n):
                trajectory = None
                if req.rollout_return_dit_trajectory:
                    trajectory = DitTrajectory(
                        latents=torch.stack([kept[s][row + i] for s in plan.return_steps])
                        if plan.return_steps else torch.empty(0),
                        timesteps=timesteps,
                        sigmas=sigmas_cpu,
                        latent_step_indices=steps,
                    )
                mine.append(RolloutOutput(
                    seed=req.seed + i, generated_output=images[row + i],
                    rollout_log_probs=log_probs[row + i] if req.rollout else None,
                    dit_trajectory=trajectory, denoising_env=env if i == 0 else None,
                    weight_version=self.weight_version, inference_time_s=elapsed, peak_memory_mb=peak_mb,
                    uncond_velocities=None if uncond_velocities is None else uncond_velocities[row + i],
                ))
            outputs.append(mine)
            row += n
        return outputs


def _frames(num_frames: int | None) -> dict:
    """The `num_frames` keyword of a video family's calls; nothing for an image family."""
    return {} if num_frames is None else {"num_frames": num_frames}


def _generator_device(requested: str | None, device: torch.device) -> torch.device:
    """sglang's `generator_device`: "cpu", or the engine's device ("cuda", "cuda:N", "device", None). A
    CPU engine asked for "cuda" draws on the CPU, as it would for None."""
    if requested is None or requested == "device":
        return device
    if requested == "cpu":
        return torch.device("cpu")
    if requested == "cuda" or requested.startswith("cuda:"):
        return device
    raise RequestError("generator_device", f"expected 'cpu', 'cuda' or 'device', got {requested!r}")


class _PromptCache:
    """Encoded prompts of one weight version, least recently used first, within `max_bytes`. Only the
    transformer's weights ever change (weight sync, LoRA adapters), but any change of version empties it."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str | tuple, PromptEmbeds] = OrderedDict()  # prompt, or (prompt, images' digest)
        self._bytes = 0
        self._version: int | None = None

    def get(self, prompt: str | tuple, version: int) -> PromptEmbeds | None:
        if version != self._version:
            self.clear()
            self._version = version
        if (hit := self._entries.get(prompt)) is not None:
            self._entries.move_to_end(prompt)
        return hit

    def put(self, prompt: str | tuple, encoded: PromptEmbeds) -> None:
        size = _nbytes(encoded)
        if size > self.max_bytes:
            return
        self._entries[prompt] = encoded
        self._bytes += size
        while self._bytes > self.max_bytes:
            self._bytes -= _nbytes(self._entries.popitem(last=False)[1])

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0


def _images_digest(images: tuple[torch.Tensor, ...]) -> str:
    """sha256 over condition images' shapes and pixels: the prompt cache's key for them."""
    digest = hashlib.sha256()
    for image in images:
        digest.update(str(tuple(image.shape)).encode() + image.contiguous().numpy().tobytes())
    return digest.hexdigest()


def _nbytes(encoded: PromptEmbeds) -> int:
    values = (getattr(encoded, f.name) for f in dataclasses.fields(encoded))
    return sum(v.numel() * v.element_size() for v in values if isinstance(v, torch.Tensor))


def _same_ids(parts: list[PromptEmbeds]) -> bool:
    # The same tensor needs no comparison (a batch of one request; a prompt cache hit): comparing reads the device.
    return all(p.ids is parts[0].ids or torch.equal(p.ids, parts[0].ids) for p in parts)


def _concat(parts: list[PromptEmbeds]) -> PromptEmbeds:
    return replace(parts[0], embeds=torch.cat([p.embeds for p in parts]))


def _check_indices(field: str, indices, limit: int) -> None:
    bad = [i for i in indices if not 0 <= i <= limit]
    if bad:
        raise RequestError(field, f"{_short(bad)} out of range 0..{limit}")


def _short(values) -> str:
    """A list for a one-line message: the first few values (a request may send thousands)."""
    values = list(values)
    return str(values) if len(values) <= 8 else f"[{', '.join(str(v)[:24] for v in values[:8])}, … {len(values)} in all]"


def _denoising_env(cond, uncond, image_ids, sigmas, plan: _Plan) -> dict[str, torch.Tensor]:
    """What a trainer needs to replay any step of this request (once per request, unexpanded). Copies, also on
    a CPU engine: the encodings are the prompt cache's, which a caller changing its env must not reach."""
    def own(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to("cpu", copy=True)

    env = {"prompt_embeds": own(cond.embeds), "text_ids": own(cond.ids), "image_ids": own(image_ids),
           "sigmas": own(sigmas), "guidance_scale": torch.tensor(plan.guidance_scale)}
    if plan.guidance_scale_2 is not None:
        env["guidance_scale_2"] = torch.tensor(plan.guidance_scale_2)
    if uncond is not None:
        env["negative_prompt_embeds"] = own(uncond.embeds)
        env["negative_text_ids"] = own(uncond.ids)  # its own text window (FLUX 3 pads each prompt separately)
    return env


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # process peak RSS (KiB on Linux)
