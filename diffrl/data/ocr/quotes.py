"""The text a prompt quotes: what the OCR reward reads back and what a glyph-grid model lays out."""

from __future__ import annotations

import re

_DOUBLE_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”')
# An apostrophe (kid's, Don't) sits between letters: a single quote opens or closes only beside a non-letter.
_SINGLE_QUOTED = re.compile(r"(?<!\w)'(.+?)'(?!\w)|‘(.+?)’(?!\w)")


def first_quoted(prompt: str) -> str | None:
    """The first double-quoted span of `prompt`, else its first single-quoted one, else None: double quotes first,
    so an apostrophe before them ("a kid's drawing labeled "Mom's house"") cannot open a span."""
    match = _DOUBLE_QUOTED.search(prompt) or _SINGLE_QUOTED.search(prompt)
    return None if match is None else next(group for group in match.groups() if group is not None)
