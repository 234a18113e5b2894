"""The rollout's reward, built from the task section of the config: in this process, or in worker processes."""

from __future__ import annotations

from collections.abc import Callable

from diffrl.rewards import default_device, get_reward
from diffrl.rewards.frames import on_frames
from diffrl.rewards.workers import ProcessRewardPool


def build_reward(task, device: str | None, deterministic: bool = False) -> tuple[Callable, ProcessRewardPool | None]:
    """`task`'s reward (`--reward`, `--reward-workers`, `--reward-frames`) as the rollout manager calls it, and the
    worker pool when it scores in workers (its owner closes it). `device`: where model rewards load (None: CUDA
    when present); a device this machine lacks is refused here, not first in a worker."""
    if device is not None:
        default_device(device)
    pool = None
    if task.reward_workers:
        pool = ProcessRewardPool(task.reward, task.reward_workers, device=device, deterministic=deterministic,
                                 frames=task.reward_frames)
        scorer = pool
    else:
        scorer = get_reward(task.reward, device=device)
    return on_frames(scorer, task.reward_frames), pool
