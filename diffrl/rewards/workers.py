"""Scoring in other processes: a local worker pool (`--reward-workers N`) or Ray reward actors.

Rewards such as the shapes verifier are CPU-bound Python; scored inline, a rollout's microgroups
wait for each other in the trainer's process. A pool scores them in parallel, as they land.

What crosses the process boundary is our own formats: images as safetensors bytes, prompts and
metadata as JSON, rewards as plain floats (the pool's envelope around them is internal, as Ray's is).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import torch

from diffrl.engine.wire import decode_weights, encode_weights


def encode_batch(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None) -> tuple[bytes, str, str]:
    return encode_weights({"images": images.detach().cpu().contiguous()}), json.dumps(list(prompts)), \
        json.dumps(metadata or [])


def decode_batch(images: bytes, prompts_json: str, metadata_json: str) -> tuple[torch.Tensor, list[str], list[dict]]:
    return decode_weights(images)["images"], json.loads(prompts_json), json.loads(metadata_json)


_SCORERS: dict[tuple[str, str | None], Callable] = {}  # per worker process: each reward is built once


def _one_thread_per_worker() -> None:
    """The pool is the parallelism: a worker whose torch ops spread over every core (torch's default,
    or the parent's OMP_NUM_THREADS) oversubscribes the machine. Measured on 2 cores, 32 batches of 16
    shapes images: a 2-worker pool took 0.40-0.56 s with torch's default threads, 0.17-0.27 s with one."""
    torch.set_num_threads(1)


def _score_in_worker(reward: str, device: str | None, images: bytes, prompts_json: str,
                     metadata_json: str) -> list[float]:
    from diffrl.rewards import get_reward

    if (reward, device) not in _SCORERS:
        _SCORERS[reward, device] = get_reward(reward, device=device)
    rewards = _SCORERS[reward, device](*decode_batch(images, prompts_json, metadata_json))
    if inspect.isawaitable(rewards):
        rewards = asyncio.run(rewards)
    return [float(r) for r in rewards]


class ProcessRewardPool:
    """The rollout manager's reward function, scored in `workers` spawned processes; model rewards load on
    `device` in each worker (None: CUDA when available, else the CPU; see `get_reward`)."""

    def __init__(self, reward: str, workers: int, device: str | None = None):
        if workers < 1:
            raise ValueError(f"--reward-workers must be >= 1 for a pool, got {workers}")
        self.reward = reward
        self.device = None if device is None else str(device)
        # spawn, not fork: the parent runs threads (the engine) and may hold a CUDA context.
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_one_thread_per_worker)

    async def __call__(self, images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> list[float]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _score_in_worker, self.reward, self.device,
                                          *encode_batch(images, prompts, metadata))

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)
