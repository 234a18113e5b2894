"""Scoring in other processes: a local worker pool (`--reward-workers N`) or Ray reward actors.

Rewards such as the shapes verifier are CPU-bound Python; scored inline, a rollout's microgroups
wait for each other in the trainer's process. A pool scores them in parallel, as they land.

What crosses the process boundary is our own formats: images (and condition images) as safetensors bytes,
prompts and metadata as JSON, rewards as plain floats (the pool's envelope around them is internal, as Ray's is).
Each call's rewards come back to that call, in order, whichever worker scored it and whenever.

With `--reward-colocate` every worker moves its model rewards off the device and back (`sleep` / `wake`):
the pool sends one message per worker, and a barrier keeps a worker that has taken one from taking
another, so each worker gets exactly one.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
import os
from collections.abc import Awaitable, Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.serving.wire import decode_weights, encode_weights
from diffrl.rewards import TermScores, colocate, default_device, get_reward
from diffrl.rewards.frames import on_frames, pick_frames, reads_whole_videos
from diffrl.rewards.groups import is_group_reward
from diffrl.utils import determinism
from diffrl.utils.spawned import exit_with_parent, no_named_semaphores, pid_tagged_semaphores


def encode_batch(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> tuple[bytes, str, str]:
    """Images, and each sample's condition images (metadata `condition_images`), as safetensors; the rest as JSON."""
    tensors, plain = {"images": images.detach().cpu().contiguous()}, []
    for i, meta in enumerate(metadata or ()):
        sources = meta.get(CONDITION_IMAGES_KEY) or ()
        tensors.update({f"{CONDITION_IMAGES_KEY}/{i}/{j}": s.detach().cpu().contiguous() for j, s in enumerate(sources)})
        plain.append({k: (len(sources) if k == CONDITION_IMAGES_KEY else v) for k, v in meta.items()})
    return encode_weights(tensors), json.dumps(list(prompts)), json.dumps(plain)


def decode_batch(images: bytes, prompts_json: str, metadata_json: str) -> tuple[torch.Tensor, list[str], list[dict]]:
    tensors, metadata = decode_weights(images), json.loads(metadata_json)
    for i, meta in enumerate(metadata):
        if CONDITION_IMAGES_KEY in meta:
            meta[CONDITION_IMAGES_KEY] = [tensors[f"{CONDITION_IMAGES_KEY}/{i}/{j}"]
                                          for j in range(meta[CONDITION_IMAGES_KEY])]
    return tensors["images"], json.loads(prompts_json), metadata


_SCORERS: dict[tuple[str, str | None, int | None], Callable] = {}  # per worker process: each reward is built once
_BARRIER = None  # per worker process: the pool's, for messages every worker must take once
BROADCAST_TIMEOUT_S = 600.0


def _start_worker(barrier, device: str | None, deterministic: bool, parent_pid: int | None = None) -> None:
    """One thread per worker: the pool is the parallelism, and a worker whose torch ops spread over every
    core (torch's default, or the parent's OMP_NUM_THREADS) oversubscribes the machine. Measured on 2 cores,
    32 batches of 16 shapes images: a 2-worker pool took 0.40-0.56 s with torch's default threads, 0.17-0.27 s
    with one. One thread also fixes how CPU reductions split, whichever worker scores a batch."""
    global _BARRIER
    _BARRIER = barrier
    no_named_semaphores()  # a model reward's loading bars: a SIGKILL leaves nothing in /dev/shm
    if parent_pid is not None:  # a killed trainer leaves no worker behind
        exit_with_parent(parent_pid)
    torch.set_num_threads(1)
    if deterministic:
        determinism.enable(default_device(device))


def _in_every_worker(op: str) -> int:
    """`sleep` or `wake` this worker's model rewards, then hold it until every worker has taken its message."""
    moved = colocate.sleep() if op == "sleep" else colocate.wake()
    _BARRIER.wait(BROADCAST_TIMEOUT_S)
    return moved


def worker_scorer(reward: str, device: str | None, frames: int | None) -> Callable:
    """This worker's reward (a pool process's, a Ray reward actor's), shown the frames in-process scoring shows
    it (`on_frames`, part by part)."""
    if (reward, device, frames) not in _SCORERS:
        _SCORERS[reward, device, frames] = on_frames(get_reward(reward, device=device), frames)
    return _SCORERS[reward, device, frames]


def _reads_whole_videos_in_worker(reward: str, device: str | None, frames: int | None) -> bool:
    return reads_whole_videos(worker_scorer(reward, device, frames))


def _score_in_worker(reward: str, device: str | None, frames: int | None, images: bytes, prompts_json: str,
                     metadata_json: str) -> list[float]:
    rewards = worker_scorer(reward, device, frames)(*decode_batch(images, prompts_json, metadata_json))
    if inspect.isawaitable(rewards):
        rewards = asyncio.run(rewards)
    total = [float(r) for r in rewards]
    terms = getattr(rewards, "terms", None)  # a multi: reward's terms travel back with the sum
    return TermScores(total, terms) if terms else total


class FramesInWorkers:
    """--reward-frames for a reward scored by workers (`ProcessRewardPool`, Ray's `RayRewardPool`): the workers
    apply it (`worker_scorer`), where the reward's parts are known, so a temporal one keeps every frame there,
    as in-process scoring keeps it."""

    whole_video = True  # `on_frames` hands the pool every frame: the workers pick them

    def __init__(self, frames: int | None):
        self.frames = frames
        self._whole_videos: bool | None = None  # whether the reward reads every frame, once a worker has said

    async def _frames_to_send(self, images: torch.Tensor, ask_a_worker: Callable[[], Awaitable[bool]]) -> torch.Tensor:
        """`images`, or only the K frames when no part of the reward reads whole videos; `ask_a_worker()` gives
        a worker's `reads_whole_videos` (asked there once: a model reward loads there, never here)."""
        if self.frames is not None and images.dim() == 5 and images.shape[2] > self.frames:
            if self._whole_videos is None:
                self._whole_videos = await ask_a_worker()
            if not self._whole_videos:  # fewer bytes to send; the workers' own pick then keeps them all
                images = pick_frames(images, self.frames)
        return images


class ProcessRewardPool(FramesInWorkers):
    """The rollout manager's reward function, scored in `workers` spawned processes; model rewards load on
    `device` in each worker (None: CUDA when available, else the CPU; see `get_reward`). `frames`
    (--reward-frames) is applied in the workers (`FramesInWorkers`)."""

    def __init__(self, reward: str, workers: int, device: str | None = None, deterministic: bool = False,
                 frames: int | None = None):
        if workers < 1:
            raise ValueError(f"--reward-workers must be >= 1 for a pool, got {workers}")
        super().__init__(frames)
        self.reward, self.workers = reward, workers
        self.scores_groups = is_group_reward(reward)  # the rollout scores a prompt's whole group at once
        self.device = None if device is None else str(device)
        # spawn, not fork: the parent runs threads (the engine) and may hold a CUDA context.
        context = multiprocessing.get_context("spawn")
        pid_tagged_semaphores()  # its queues' and barrier's: a kill -9 of the run's group leaves them behind
        self._pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                         initargs=(context.Barrier(workers), self.device, deterministic, os.getpid()))

    async def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> list[float]:
        loop = asyncio.get_running_loop()
        images = await self._frames_to_send(images, lambda: loop.run_in_executor(
            self._pool, _reads_whole_videos_in_worker, self.reward, self.device, self.frames))
        return await loop.run_in_executor(self._pool, _score_in_worker, self.reward, self.device, self.frames,
                                          *encode_batch(images, prompts, metadata))

    def sleep(self) -> int:
        """Every worker's model rewards to host memory (`--reward-colocate`); returns the bytes moved."""
        return self._everywhere("sleep")

    def wake(self) -> int:
        return self._everywhere("wake")

    def _everywhere(self, op: str) -> int:
        # A worker not started yet is started by its message (the executor spawns one per waiting call).
        futures = [self._pool.submit(_in_every_worker, op) for _ in range(self.workers)]
        return sum(f.result() for f in futures)

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
