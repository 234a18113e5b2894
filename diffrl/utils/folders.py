"""Output folders named by a flag: refused in one line naming the flag when a file stands in the way."""

from __future__ import annotations

from pathlib import Path


def check_output_dir(path: Path, flag: str = "--output-dir", kind: str = "run folder") -> None:
    """A FileExistsError naming `flag` when `path`, or the nearest of its parents that exists, is a file (making the
    folder would fail with a NotADirectoryError or FileExistsError traceback, possibly after minutes of work)."""
    path = Path(path)
    for existing in (path, *path.parents):
        if existing.exists():
            break
    else:
        return
    if existing.is_dir():
        return
    where = f"{path} is a file" if existing == path else f"{path}: {existing} is a file"
    raise FileExistsError(f"{flag} {where}, not a {kind}; choose another {flag}")
