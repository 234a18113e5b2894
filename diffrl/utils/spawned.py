"""Set-up for the processes diffrl spawns (a `--colocate` engine, reward workers).

A spawned process's default multiprocessing context is spawn, where every lock is a *named* POSIX
semaphore in /dev/shm, unlinked only when the process exits cleanly. tqdm makes one for its write lock
at the first progress bar (model loading shows bars), so killing the trainer's process group
(`timeout -s KILL`, a scheduler's SIGKILL) left a `sem.mp-*` file behind per spawned process. Their
bars need only a thread lock: these processes print from their own threads, never from children.

The trainer's own spawn-context locks (a reward pool's queues and barrier) must be named: its workers open
them by name. Those carry the trainer's pid, and the next pool sweeps the names of pids that are gone.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import threading
import time
from pathlib import Path

SEMAPHORE_DIR = Path("/dev/shm")  # where glibc keeps named POSIX semaphores, as sem.<name>


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def pid_tagged_semaphores() -> None:
    """Name this process's multiprocessing semaphores after its pid, and unlink those of dead processes.

    A SIGKILL of the whole process group ends the resource tracker that would unlink them, so every pool's
    names stayed in /dev/shm for good. A live process's names are never touched; nor are other pid
    namespaces' (their pids mean nothing here), which the tag names too. A worker of a dead trainer that has
    not exited yet keeps its open handles: unlinking removes only the name."""
    if not SEMAPHORE_DIR.is_dir():  # not Linux: no names to list
        return
    try:
        namespace = os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        namespace = "0"
    tag = f"mp-diffrl-{namespace}-"
    for path in SEMAPHORE_DIR.glob(f"sem.{tag}*"):
        pid = path.name[len(f"sem.{tag}"):].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            with contextlib.suppress(FileNotFoundError):  # another run swept it first
                path.unlink()
    # multiprocessing names each semaphore `<semprefix>-<random>` (CPython's SemLock._make_name).
    multiprocessing.current_process()._config["semprefix"] = f"/{tag}{os.getpid()}"
