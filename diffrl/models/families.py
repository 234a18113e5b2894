"""The model families by name: each family module registers its adapter class here when it is imported.

This table sits below every family module (and below `base` and `components`), so that a family registers itself,
and a checkpoint is checked against every family before it loads, without importing the registry, which imports
the family modules. The registry says how to import the built-in families (`set_builtin_importer`) as it is
imported; the package `diffrl.models` imports the registry, so that is done before any family module is.
"""

from __future__ import annotations

from collections.abc import Callable

_FAMILIES: dict[str, type] = {}
_import_builtins: Callable[[], None] = lambda: None


def register_family(cls: type) -> type:
    if cls.name in _FAMILIES:
        raise ValueError(f"model family {cls.name!r} is registered twice")
    _FAMILIES[cls.name] = cls
    return cls


def registered_families() -> dict[str, type]:
    """The families registered so far (`family_names` and `get_family` import the built-in ones first)."""
    return _FAMILIES


def set_builtin_importer(importer: Callable[[], None]) -> None:
    """How to import the built-in family modules (each registers itself); the registry sets it."""
    global _import_builtins
    _import_builtins = importer


def family_names() -> list[str]:
    _import_builtins()
    return sorted(_FAMILIES)


def get_family(name: str) -> type:
    _import_builtins()
    try:
        return _FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(_FAMILIES))}") from None
