"""The tracked tree stays small enough to travel to the GPU machine: the device tool carries the tracked files
plus the wheels in `.whl/` (~11 MB, scripts/device/fetch_wheels.sh) and refuses more than 64 MiB in all. Run data
that would pass it belongs in a compressed archive (JOURNAL.md: results/shapes/sweeps-*.tar.xz)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEVICE_CARRY_LIMIT = 64 * 2**20
WHEELS_BUDGET = 12 * 2**20  # what .whl/ takes, with a little room


def test_the_tracked_tree_and_the_wheels_fit_one_device_call():
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    paths = [ROOT / name for name in listed.stdout.decode().split("\0") if name]
    tracked = sum(path.stat().st_size for path in paths if path.is_file())
    assert tracked + WHEELS_BUDGET <= DEVICE_CARRY_LIMIT, (
        f"tracked files take {tracked / 2**20:.1f} MiB; with the wheels ({WHEELS_BUDGET / 2**20:.0f} MiB) a device "
        f"call would carry more than {DEVICE_CARRY_LIMIT / 2**20:.0f} MiB")
