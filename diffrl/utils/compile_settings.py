"""The compiler settings that compiled blocks need, in every thread that runs them.

torch keeps a change to its dynamo and inductor settings per thread (`torch.utils._config_module`: one ContextVar
per entry), while engines run forwards in worker threads: a setting made where the blocks are compiled would be
missing where the engine compiles its own graphs. On a CPU run the engine's graphs then lost eager's bf16
roundings (`emulate_precision_casts`) that the trainer's kept, and the trainer's replay of a rollout drifted:
first-pass |Δlogp| 5.8e-5 with 14% of pairs clipped, against 0 eager. So settings are recorded here once per
process and entered around every transformer call (`FamilyAdapter.forward_precision`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_SETTINGS: dict[str, dict] = {"dynamo": {}, "inductor": {}}


def require_compile_settings(*, dynamo: dict | None = None, inductor: dict | None = None) -> None:
    """Record dynamo / inductor settings for every thread of this process that runs compiled blocks."""
    _SETTINGS["dynamo"].update(dynamo or {})
    _SETTINGS["inductor"].update(inductor or {})


def compile_setting(section: str, name: str):
    """A setting as compiled blocks see it (`section`: dynamo or inductor): the recorded value, else this thread's."""
    return _SETTINGS[section].get(name, getattr(_config(section), name))


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """The recorded settings in this thread, for the block's duration (nothing to do when none is recorded)."""
    if not (_SETTINGS["dynamo"] or _SETTINGS["inductor"]):
        yield
        return
    with _config("dynamo").patch(**_SETTINGS["dynamo"]), _config("inductor").patch(**_SETTINGS["inductor"]):
        yield


def _config(section: str):
    if section == "dynamo":
        return torch._dynamo.config
    import torch._inductor.config as inductor_config  # noqa: PLC0415  (compiling imports the rest when it runs)

    return inductor_config
