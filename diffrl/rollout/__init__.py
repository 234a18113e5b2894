"""Rollouts: the seed layout, engine clients and the async manager (docs/architecture.md, "Rollout contract").

The names below load with their module on first use (lazy): the clients and the manager import torch and httpx,
while the train config imports `settings` and `layout` alone, and `diffrl train --help` should not pay for them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from diffrl.rollout.clients import EngineClient, EngineUnavailable, HttpEngineClient, InProcessEngineClient
    from diffrl.rollout.layout import check_batch_invariant, group_seed_base, microgroups
    from diffrl.rollout.manager import RolloutManager, Sample
    from diffrl.rollout.settings import RolloutSettings

# Each name, by the module of this package that defines it.
_MODULE_OF = {
    "EngineClient": "clients",
    "EngineUnavailable": "clients",
    "HttpEngineClient": "clients",
    "InProcessEngineClient": "clients",
    "RolloutManager": "manager",
    "RolloutSettings": "settings",
    "Sample": "manager",
    "check_batch_invariant": "layout",
    "group_seed_base": "layout",
    "microgroups": "layout",
}

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_MODULE_OF[name]}"), name)
    globals()[name] = value  # looked up once
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
