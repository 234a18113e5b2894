"""Model families: one adapter per family behind a registry (see `registry.py`)."""

from diffrl.models.base import (
    FamilyAdapter,
    Latents,
    ModelLoadError,
    PromptEmbeds,
    register_family,
)
from diffrl.models.registry import family_names, get_family, resolve_family
from diffrl.utils.third_party_logs import quiet_empty_fp32_cast_warning

quiet_empty_fp32_cast_warning()  # every family casts diffusers models with `.to(dtype)` somewhere

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
