"""Set-up for the processes diffrl spawns (a `--colocate` engine, reward workers).

A spawned process's default multiprocessing context is spawn, where every lock is a *named* POSIX
semaphore in /dev/shm, unlinked only when the process exits cleanly. tqdm makes one for its write lock
at the first progress bar (model loading shows bars), so killing the trainer's process group
(`timeout -s KILL`, a scheduler's SIGKILL) left a `sem.mp-*` file behind per spawned process. Their
bars need only a thread lock: these processes print from their own threads, never from children.
"""

from __future__ import annotations

import threading


def no_named_semaphores() -> None:
    """Give tqdm a thread lock before any progress bar creates its multiprocessing one."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
