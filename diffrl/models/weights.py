"""Reading safetensors weights into a module, with one-line errors naming the file (and, for NaN or
inf values, the tensor)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from diffrl.errors import ModelLoadError, WeightsMismatch

# aminmax reads a tensor once with no temporary the tensor's size; other float types (fp8) are upcast.
_MINMAX_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def read_weights(path: Path, *, check_finite: bool = True) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ModelLoadError(f"missing file: {path}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelLoadError(f"corrupt file: {path} ({err})") from None
    if check_finite:
        require_finite(state.items(), lambda name: path)
    return state


def load_weights(module: torch.nn.Module, path: Path) -> None:
    """Every tensor of `module` from `path`, strictly (a missing or extra name is an error); NaN or inf
    weights are refused (checked on the module's device, after the copy)."""
    try:
        module.load_state_dict(read_weights(path, check_finite=False), strict=True)
    except RuntimeError as err:
        first_line = str(err).strip().splitlines()[0]
        raise WeightsMismatch(f"weights do not fit the config: {path} ({first_line})") from None
    require_finite(module_tensors(module), lambda name: path)


def module_tensors(module: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def require_finite(tensors: Iterable[tuple[str, torch.Tensor]], file_of: Callable[[str], Path]) -> None:
    """Refuse NaN or inf weights with a one-line `ModelLoadError` naming the file and the tensor.

    One reduction per tensor on the tensor's own device (its min and max: NaN propagates, ±inf shows),
    and one host sync per device, so a scan of a 20 B model on a GPU costs a few memory passes' time."""
    names: dict[torch.device, list[str]] = {}
    extremes: dict[torch.device, list[torch.Tensor]] = {}
    for name, t in tensors:
        if not t.is_floating_point() or t.numel() == 0 or t.is_meta:
            continue
        flat = t.detach().reshape(-1)
        if flat.dtype not in _MINMAX_DTYPES:
            flat = flat.float()
        lo, hi = torch.aminmax(flat)
        names.setdefault(t.device, []).append(name)
        extremes.setdefault(t.device, []).append(torch.stack((lo, hi)).float())
    for device, values in extremes.items():
        finite = torch.isfinite(torch.stack(values)).all(dim=1)
        if bool(finite.all()):
            continue
        name = names[device][int((~finite).nonzero()[0, 0])]
        raise ModelLoadError(f"non-finite weights: {file_of(name)} holds NaN or inf in tensor {name!r}")


def require_finite_modules(root: Path, modules: dict[str, torch.nn.Module | None]) -> None:
    """`require_finite` over the components a family loaded with `from_pretrained`, keyed by their
    folder under `root`; the message names the shard file holding the tensor when an index says so."""
    for folder, module in modules.items():
        if module is not None:
            require_finite(module_tensors(module), _file_finder(Path(root) / folder))


def _file_finder(folder: Path) -> Callable[[str], Path]:
    def file_of(name: str) -> Path:
        for index in sorted(folder.glob("*.safetensors.index.json")):
            try:
                weight_map = json.loads(index.read_text()).get("weight_map", {})
            except (OSError, ValueError):
                continue
            if name in weight_map:
                return folder / weight_map[name]
        files = sorted(folder.glob("*.safetensors"))
        return files[0] if len(files) == 1 else folder
    return file_of
