"""A sample's size as the flags give it: `--resolution N` (the square N × N) or `--height H --width W`."""

from __future__ import annotations


def sample_size(resolution: int | None, height: int | None = None, width: int | None = None,
                flags: str = "--") -> tuple[int, int] | None:
    """(height, width) in pixels, or None for the family's default size. Both kinds at once, one side
    alone or a side below 1 is refused, naming the flags (`flags`: their prefix, e.g. "--eval-")."""
    r, h, w = f"{flags}resolution", f"{flags}height", f"{flags}width"
    if resolution is not None and (height is not None or width is not None):
        raise ValueError(f"{r} {resolution} is the square shorthand of {h}/{w}: give one kind, "
                         f"not both (got {h} {height}, {w} {width})")
    if (height is None) != (width is None):
        raise ValueError(f"{h} and {w} go together (got {h} {height}, {w} {width}); "
                         f"{r} N is the square N × N")
    if resolution is not None:
        if resolution < 1:
            raise ValueError(f"{r} must be > 0, got {resolution}")
        return resolution, resolution
    if height is None:
        return None
    if height < 1 or width < 1:
        raise ValueError(f"{h} and {w} must be > 0, got {height}, {width}")
    return height, width


def size_flags(resolution: int | None, height: int | None, width: int | None) -> str:
    """How the flags named a size (for messages about it)."""
    return f"--resolution {resolution}" if resolution is not None else f"--height {height} --width {width}"
