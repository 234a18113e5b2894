"""Transformer weights read from a checkpoint directory on the engine's disk (`POST /update_weights_from_disk`).

The layout is a diffusers checkpoint's, as sglang-diffusion reads it: `<model_path>/<module>/*.safetensors` for
each module to update (`transformer`; Wan2.2's experts `transformer` and `transformer_2`). Only directories
under the server's allowed roots (`diffrl serve --weights-roots`) are read: the path is resolved (symlinks, `..`)
before it is compared with the roots, and so is every file read, so a link cannot lead outside them. Only
safetensors files are read (never a pickle: `.bin` and `.pt` files are ignored, as sglang ignores them).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from diffrl.errors import RequestError


def allowed_directory(model_path: str, roots: Sequence[Path]) -> Path:
    """`model_path` resolved, when it is an existing directory under one of `roots`; else a RequestError
    naming `model_path` (whether a path outside the roots exists is not said)."""
    if not roots:
        raise RequestError("model_path", "this server loads no weights from disk: start diffrl serve with "
                                         "--weights-roots DIR to allow the directories under DIR")
    if "\x00" in model_path or not Path(model_path).is_absolute():
        raise RequestError("model_path", f"must be an absolute path to a local directory, got {model_path[:200]!r} "
                                         "(hub ids are not fetched)")
    path = Path(model_path).resolve()
    if not _under(path, roots):
        raise RequestError("model_path", f"{model_path[:200]!r} is not under a directory this server loads weights "
                                         "from (--weights-roots)")
    if not path.is_dir():
        raise RequestError("model_path", f"{model_path[:200]!r} is not a directory")
    return path


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in (Path(r).resolve() for r in roots))


def read_module_weights(directory: Path, prefixes: dict[str, str], roots: Sequence[Path]) -> dict[str, torch.Tensor]:
    """The tensors of `directory/<module>/*.safetensors` for each module of `prefixes`, each name prefixed with its
    module's prefix (the engine's transformer state names them so). Every module needs its folder with at least
    one safetensors file; a name twice is refused."""
    tensors: dict[str, torch.Tensor] = {}
    missing = [m for m in prefixes if not (directory / m).is_dir() or not sorted((directory / m).glob("*.safetensors"))]
    if missing:
        raise RequestError("model_path", f"no safetensors weights for {', '.join(missing)} in {str(directory)[:200]!r} "
                                         f"(expected {missing[0]}/*.safetensors)")
    for module, prefix in prefixes.items():
        for file in sorted((directory / module).glob("*.safetensors")):
            real = file.resolve()
            if not _under(real, roots) or not real.is_file():
                raise RequestError("model_path", f"{module}/{file.name} leads outside the directories this server "
                                                 "loads weights from (--weights-roots)")
            try:
                with safe_open(str(real), framework="pt", device="cpu") as handle:
                    for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                        name = prefix + key
                        if name in tensors:
                            raise RequestError("model_path", f"{module}/{file.name}: tensor {key[:200]!r} is also in "
                                                             "another file")
                        tensors[name] = handle.get_tensor(key)
            except (SafetensorError, OSError) as err:
                raise RequestError("model_path", f"{module}/{file.name}: not a readable safetensors file "
                                                 f"({str(err)[:200]})") from None
    return tensors
