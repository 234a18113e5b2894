"""Loading a script of benchmarks/ as a module, for the tests that check it on tiny models."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str, monkeypatch=None) -> ModuleType:
    """benchmarks/<name>.py as a module named `name`. With pytest's `monkeypatch`, benchmarks/ is on sys.path
    for the script's own imports (family_rollout, report) and the module is in sys.modules while it runs (its
    dataclasses look their module up); both are undone after the test."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if monkeypatch is not None:
        monkeypatch.syspath_prepend(str(BENCHMARKS))
        monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
