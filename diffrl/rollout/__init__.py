"""Rollouts: the seed layout, engine clients and the async manager (docs/architecture.md, "Rollout contract")."""

from diffrl.rollout.clients import EngineClient, EngineUnavailable, HttpEngineClient, InProcessEngineClient
from diffrl.rollout.layout import check_batch_invariant, group_seed_base, microgroups
from diffrl.rollout.manager import RolloutManager, Sample
from diffrl.rollout.settings import RolloutSettings

__all__ = [
    "EngineClient",
    "EngineUnavailable",
    "HttpEngineClient",
    "InProcessEngineClient",
    "RolloutManager",
    "RolloutSettings",
    "Sample",
    "check_batch_invariant",
    "group_seed_base",
    "microgroups",
]
