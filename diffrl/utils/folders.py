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


def check_fresh_output_dir(path: Path, overwrite: bool, flag: str = "--output-dir") -> None:
    """A FileExistsError naming --overwrite when `path` already holds files (an earlier result would be replaced
    silently); with `overwrite` the command replaces them."""
    path = Path(path)
    check_output_dir(path, flag, kind="folder")
    if not overwrite and path.is_dir() and any(path.iterdir()):
        raise FileExistsError(f"{flag} {path} already holds results; pass --overwrite to replace them, or another "
                              f"{flag}")


def stamped_output_dir(kind: str, source: Path | None) -> Path:
    """The default folder of an evaluation or comparison: runs/<kind>-<run or model name>-<date-time> (as a run's
    default is runs/<recipe>-<date-time>), so no earlier result is ever replaced."""
    import time

    source = Path(source) if source is not None else None
    name = "model" if source is None else source.name
    if source is not None and source.parent.name == "checkpoints":  # RUN/checkpoints/rollout-N: RUN-rollout-N
        name = f"{source.parent.parent.name}-{name}"
    return Path("runs") / f"{kind}-{name}-{time.strftime('%Y%m%d-%H%M%S')}"
