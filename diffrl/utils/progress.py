"""Progress bars that suit where they are written: tqdm's redrawn bar on a terminal; on anything else (a log
file, a pipe) one plain line per update at most every `PLAIN_INTERVAL_S` seconds, since a redrawn bar's
carriage returns make a redirected log one long line."""

from __future__ import annotations

import sys

from tqdm import tqdm as _tqdm

PLAIN_INTERVAL_S = 30.0


class _Lines:
    """A file for tqdm that turns each redraw into a line of its own."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip("\n")
        if text.strip():
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


def tqdm(*args, **kwargs):
    """`tqdm.tqdm`, written line by line at most every PLAIN_INTERVAL_S seconds when stderr is not a terminal."""
    stream = kwargs.pop("file", None) or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        kwargs.setdefault("mininterval", PLAIN_INTERVAL_S)
        kwargs["dynamic_ncols"] = False
        kwargs.setdefault("ncols", 100)
        stream = _Lines(stream)
    return _tqdm(*args, file=stream, **kwargs)
