"""A folder's manifest (the size and sha256 of every file) and its atomic publication.

A folder with `manifest.json` is complete: `write_manifest` fsyncs every file and writes the manifest last, and
`verify_checkpoint` checks every listed file against it. `publish` renames a complete staging folder into place,
swapping out an existing one atomically. Run checkpoints are written this way (`diffrl.train.checkpointer`), and
the model loader checks a run checkpoint's manifest before it reads the weights (`diffrl.models.checkpoint`).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "diffrl-checkpoint/1"


def _files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and f.relative_to(folder).as_posix() != MANIFEST)


def _hash_file(path: Path, fsync: bool = False) -> tuple[int, str]:
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return size, digest.hexdigest()


def _hash_all(paths: list[Path], fsync: bool = False) -> list[tuple[int, str]]:
    # hashlib releases the GIL on large buffers: a sharded or multi-file checkpoint hashes in parallel.
    with ThreadPoolExecutor(max_workers=min(8, max(1, len(paths)))) as pool:
        return list(pool.map(lambda p: _hash_file(p, fsync), paths))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(folder: Path) -> None:
    """fsync every file under `folder` and record its size and sha256 in `folder/manifest.json`
    (written last, itself fsynced): a folder with a manifest is complete."""
    files = _files(folder)
    entries = {f.relative_to(folder).as_posix(): {"size": size, "sha256": digest}
               for f, (size, digest) in zip(files, _hash_all(files, fsync=True), strict=True)}
    for d in sorted({f.parent for f in files} | {folder}, key=lambda d: len(d.parts), reverse=True):
        _fsync_dir(d)
    with (folder / MANIFEST).open("w") as f:
        f.write(json.dumps({"format": MANIFEST_FORMAT, "files": entries}, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(folder)


def verify_checkpoint(folder: Path) -> str | None:
    """None when `folder` has a manifest and every file it lists has the recorded size and sha256;
    otherwise what is wrong, in a few words."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        return f"no {MANIFEST} (an interrupted write)"
    try:
        files = json.loads(manifest.read_text())["files"]
        entries = [(name, int(e["size"]), str(e["sha256"])) for name, e in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"unreadable {MANIFEST} ({type(err).__name__})"
    if not entries:
        return f"{MANIFEST} lists no files"
    for name, size, _ in entries:
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, the manifest says {size}"
    for (name, _, digest), (_, actual) in zip(entries, _hash_all([folder / n for n, _, _ in entries]), strict=True):
        if actual != digest:
            return f"{name} does not match its sha256 in {MANIFEST} (damaged)"
    return None


def publish(staging: Path, final: Path) -> None:
    """Rename the complete `staging` folder to `final`; an existing `final` is swapped out in one
    atomic step (renameat2 RENAME_EXCHANGE on Linux) and then removed."""
    parent = final.parent
    if not final.exists():
        os.rename(staging, final)
    elif _exchange(staging, final):
        shutil.rmtree(staging)  # now the old folder
    else:  # no atomic exchange here: a crash between the renames leaves the older checkpoints to resume from
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
        os.rename(staging, final)
        shutil.rmtree(old)
    _fsync_dir(parent)


def _exchange(a: Path, b: Path) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0
