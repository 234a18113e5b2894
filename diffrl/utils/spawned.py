"""Set-up for the processes diffrl spawns (a `--colocate` engine, reward workers).

A spawned process's default multiprocessing context is spawn, where every lock is a *named* POSIX
semaphore in /dev/shm, unlinked only when the process exits cleanly. tqdm makes one for its write lock
at the first progress bar (model loading shows bars), so killing the trainer's process group
(`timeout -s KILL`, a scheduler's SIGKILL) left a `sem.mp-*` file behind per spawned process. Their
bars need only a thread lock: these processes print from their own threads, never from children.
"""

from __future__ import annotations

import os
import threading
import time


def no_named_semaphores() -> None:
    """Give tqdm a thread lock before any progress bar creates its multiprocessing one."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def exit_with_parent(parent_pid: int, poll_s: float = 0.5) -> None:
    """End this process when `parent_pid` is gone. A process-pool worker waits on a queue whose write end it
    holds itself, so a SIGKILLed trainer never closes it: its reward workers lived on as orphans (and kept
    the pool's semaphores in /dev/shm). A daemon thread polls the parent's pid (re-parenting changes it)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(0)  # the parent cannot take a result any more; nothing here needs cleaning up

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()
