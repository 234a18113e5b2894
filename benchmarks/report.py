"""Shared ending of the benchmark scripts: print the results as JSON and save them when asked."""

from __future__ import annotations

import json


def emit(results: dict, out: str | None) -> None:
    print(json.dumps(results, indent=2))
    if out:
        with open(out, "w") as f:
            json.dump(results, f, indent=2)
