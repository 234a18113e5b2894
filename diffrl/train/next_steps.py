"""What a finished `diffrl train` prints last: the commands that take its run folder next."""

from __future__ import annotations

import shlex
from pathlib import Path


def next_commands(run: Path, *, prompt_data: Path | None = None, reward: str | None = None) -> str:
    """Evaluate, compare and serve lines naming `run` (a prompt-data run's evaluate and compare also take its
    prompt set and reward, which they do not read from the run)."""
    folder = shlex.quote(str(run))
    extra = ""
    if prompt_data is not None:
        extra = f" --prompt-data {shlex.quote(str(prompt_data))} --reward {shlex.quote(reward or '')}"
    lines = [(f"diffrl evaluate --checkpoint {folder}{extra}", "its held-out score, sampled as the run samples"),
             (f"diffrl compare --trained {folder}{extra}", "against its base model, with standard errors"),
             (f"diffrl serve --checkpoint {folder}", "the trained model over HTTP")]
    width = max(len(command) for command, _ in lines)
    return "\n".join(["next:", *(f"  {command:<{width}}  # {what}" for command, what in lines)])
