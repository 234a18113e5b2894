"""Files written whole or not at all: a temporary name beside the target, renamed onto it when complete, so a
reader (or a resumed run) never sees half a file."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary name beside `path` (same suffix, so writers can tell the format), renamed onto it at
    the end; an interrupted write leaves only the temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: Path, text: str, *, durable: bool = False) -> None:
    """`text` into `path` atomically; `durable`: also on disk before this returns (the file and its folder
    fsynced), for what a resume reads after a crash."""
    path = Path(path)
    with atomic_path(path) as tmp:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    if durable:
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
