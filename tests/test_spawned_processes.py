"""The processes diffrl spawns (a `--colocate` engine, reward workers) hold no named POSIX semaphore: a
SIGKILL of the whole process group (`timeout -s KILL diffrl train …`) runs no cleanup, so any such
semaphore stays in /dev/shm for good. tqdm made one in each at its first progress bar."""

import os
from pathlib import Path

from diffrl.serving.colocated import ColocatedEngineClient, EngineProcessSpec
from diffrl.rewards.workers import ProcessRewardPool


def _semaphores(pid: int) -> list[str]:
    """The POSIX semaphores a process has mapped (glibc maps each from /dev/shm/sem.*)."""
    return [line.split()[-1] for line in Path(f"/proc/{pid}/maps").read_text().splitlines() if "/dev/shm/sem." in line]


def _semaphores_a_bar_adds() -> list[str]:
    import os

    from tqdm import tqdm

    before = _semaphores(os.getpid())  # the pool's own queues and barrier, made by the parent
    for _ in tqdm(range(2), disable=False):
        pass
    return sorted(set(_semaphores(os.getpid())) - set(before))


def test_a_colocated_engine_process_holds_no_named_semaphore():
    from diffrl.models.demo import SHIPPED_DEMO_MODEL

    client = ColocatedEngineClient(EngineProcessSpec(model_path=str(SHIPPED_DEMO_MODEL), family="demo"))
    try:
        client.health()  # loaded (its progress bars drawn) and serving
        assert _semaphores(client.process.pid) == []
    finally:
        client.close()


def test_a_progress_bar_in_a_reward_worker_makes_no_named_semaphore():
    pool = ProcessRewardPool("shapes", 1)
    try:
        assert pool._pool.submit(_semaphores_a_bar_adds).result() == []
    finally:
        pool.close()


_PARENT = """
import os, sys, time
from diffrl.rewards.workers import ProcessRewardPool
pool = ProcessRewardPool("shapes", 2)
pool.sleep()  # a message to every worker: both are started
print(*pool._pool._processes, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_reward_workers_end_when_the_trainer_is_killed():
    """A SIGKILLed trainer runs no shutdown: its workers must notice on their own (they wait on a queue
    they hold both ends of, so they never saw it close and lived on as orphans)."""
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(workers) == 2 and all(_alive(pid) for pid in workers)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if _alive(pid)]
    for pid in left:  # do not leave them to the next test either
        os.kill(pid, signal.SIGKILL)
    assert left == []


_POOL_HOLDER = """
import time
from diffrl.rewards.workers import ProcessRewardPool
pool = ProcessRewardPool("shapes", 2)
print("ready", flush=True)
time.sleep(600)
"""


def _pool_semaphores(pid: int) -> set[str]:
    return {path.name for path in Path("/dev/shm").glob(f"sem.mp-diffrl-*-{pid}-*")}


def test_a_killed_runs_semaphores_are_swept_by_the_next_pool_and_a_live_runs_are_kept():
    """kill -9 of a run's whole group (its resource tracker included) runs no cleanup: the pool's queue and
    barrier semaphores stayed in /dev/shm for good. They carry the run's pid; the next pool unlinks those of
    dead pids only."""
    import signal
    import subprocess
    import sys

    runs = [subprocess.Popen([sys.executable, "-c", _POOL_HOLDER], stdout=subprocess.PIPE, text=True,
                             start_new_session=True) for _ in range(2)]
    try:
        assert [run.stdout.readline().strip() for run in runs] == ["ready", "ready"]
        killed, live = runs
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        orphans, kept = _pool_semaphores(killed.pid), _pool_semaphores(live.pid)
        assert orphans and kept  # the killed run's names outlived it
        ProcessRewardPool("shapes", 1).close()
        assert _pool_semaphores(killed.pid) == set() and _pool_semaphores(live.pid) == kept
    finally:
        for run in runs:
            if run.poll() is None:
                os.killpg(run.pid, signal.SIGKILL)
                run.wait()
        ProcessRewardPool("shapes", 1).close()  # the live one's names, now orphans too
