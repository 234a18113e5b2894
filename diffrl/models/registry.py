"""The family registry: one adapter class per model family, and how a run picks one.

Resolution order (docs/architecture.md, "Model families"): an explicit `--diffusion-model-family`, then the
environment variable `DIFFRL_MODEL_FAMILY`, then the checkpoint directory's name matched against each family's
`name_patterns` (several matching: the one that loads its transformer class), then the checkpoint's transformer class (`transformer/config.json`'s `_class_name`, else
`model_index.json`'s entry for `transformer`) when exactly one family loads it (of those that share the class, the
one whose other folders and classes the checkpoint has: FLUX 3 beside the demo model). Family modules register
themselves with `register_family` (`families.py`, below them, so that they need not import this module, which
imports them).
"""

from __future__ import annotations

import os
from pathlib import Path

from diffrl.models.base import FamilyAdapter
from diffrl.models.components import checkpoint_class, checkpoint_families, checkpoint_root
from diffrl.models.families import family_names, get_family, registered_families, set_builtin_importer

__all__ = ["FAMILY_ENV_VAR", "family_names", "get_family", "resolve_family"]

FAMILY_ENV_VAR = "DIFFRL_MODEL_FAMILY"
_FAMILIES = registered_families()


def resolve_family(explicit: str | None = None, model_path: str | Path | None = None) -> type[FamilyAdapter]:
    """Pick the family for a run: flag, then environment, then the checkpoint's directory name, then its
    transformer class."""
    if explicit:
        return get_family(explicit)
    from_env = os.environ.get(FAMILY_ENV_VAR)
    if from_env:
        return get_family(from_env)
    if model_path is not None:
        _import_builtin_families()
        dir_name = Path(model_path).resolve().name.lower()
        matches = [cls for cls in _FAMILIES.values() if any(p in dir_name for p in cls.name_patterns)]
        if len(matches) == 1:
            return matches[0]
        if len(matches) > 1:  # e.g. "qwen-image-2.1" is Qwen-Image's name too: the transformer class decides
            found = checkpoint_class(Path(model_path), "transformer")
            owners = set(checkpoint_families(Path(model_path), "transformer", found)) if found else set()
            by_class = [cls for cls in matches if cls.name in owners]
            if len(by_class) == 1:
                return by_class[0]
            names = ", ".join(sorted(cls.name for cls in matches))
            raise ValueError(f"checkpoint name {dir_name!r} matches several families ({names}); "
                             "pass --diffusion-model-family")
        found = checkpoint_class(Path(model_path), "transformer")
        owners = checkpoint_families(Path(model_path), "transformer", found) if found else []
        if len(owners) == 1:
            return get_family(owners[0])
        if owners:  # a shared class says nothing about which family: never guess
            raise ValueError(f"{Path(model_path) / 'transformer'} holds {found}, which several families load "
                             f"({', '.join(owners)}); pass --diffusion-model-family")
    if model_path is not None and not Path(model_path).is_dir():  # a typo says so, not that its family is unknown
        checkpoint_root(model_path)
    raise ValueError(f"cannot tell the model family of {str(model_path)!r}; pass --diffusion-model-family "
                     f"or set {FAMILY_ENV_VAR} (known: {', '.join(family_names())})")


def _import_builtin_families() -> None:
    # Importing a family module registers it. Deferred to the first lookup: the family modules import diffusers and
    # transformers (about 5 s on a CPU), which `import diffrl.models` should not pay for.
    import diffrl.models.chroma  # noqa: F401
    import diffrl.models.hidream  # noqa: F401
    import diffrl.models.cogview4  # noqa: F401
    import diffrl.models.cosmos3  # noqa: F401
    import diffrl.models.demo  # noqa: F401
    import diffrl.models.flux1  # noqa: F401
    import diffrl.models.flux2  # noqa: F401
    import diffrl.models.flux3_image  # noqa: F401
    import diffrl.models.hunyuan_video15  # noqa: F401
    import diffrl.models.krea2  # noqa: F401
    import diffrl.models.ltx2  # noqa: F401
    import diffrl.models.lumina2  # noqa: F401
    import diffrl.models.qwen_image  # noqa: F401
    import diffrl.models.qwen_image21  # noqa: F401
    import diffrl.models.sana  # noqa: F401
    import diffrl.models.sd3  # noqa: F401
    import diffrl.models.wan2_2  # noqa: F401
    import diffrl.models.z_image  # noqa: F401


set_builtin_importer(_import_builtin_families)
