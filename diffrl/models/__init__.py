"""Model families: one adapter per family behind a registry (see `registry.py`)."""

from diffrl.models.base import (
    FamilyAdapter,
    Latents,
    ModelLoadError,
    PromptEmbeds,
    register_family,
)
from diffrl.models.registry import family_names, get_family, resolve_family

__all__ = [
    "FamilyAdapter",
    "Latents",
    "ModelLoadError",
    "PromptEmbeds",
    "family_names",
    "get_family",
    "register_family",
    "resolve_family",
]
