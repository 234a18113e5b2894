"""Weight checksums in sglang-diffusion's two forms, so a trainer can check what an engine holds.

- `module_checksum`: one SHA-256 over a module's parameters, what sglang-diffusion's `/get_weights_checksum`
  answers (and what miles-diffusion's weight-sync check recomputes on the trainer's side): the parameters
  (`named_parameters()`: buffers left out, a shared parameter once) in order of their names, each as its name
  in UTF-8 followed by its raw bytes (the tensor's own dtype, row-major, on the host).
- `tensor_sha256`: one SHA-256 per tensor, what `/update_weights_from_tensor_checker` compares against: the
  dtype as torch prints it (`torch.bfloat16`), the shape as a Python tuple's repr (`(3072, 64)`), then the
  raw bytes.

Both hash bytes, never values: a weight cast to another dtype on the way has another checksum.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator

import torch


def _raw_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def named_checksum(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    hasher = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        hasher.update(name.encode("utf-8"))
        hasher.update(_raw_bytes(tensor))
    return hasher.hexdigest()


def module_checksum(module: torch.nn.Module) -> str:
    return named_checksum(module.named_parameters())


def tensor_sha256(tensor: torch.Tensor) -> str:
    hasher = hashlib.sha256()
    hasher.update(str(tensor.dtype).encode("utf-8"))
    hasher.update(repr(tuple(tensor.shape)).encode("utf-8"))
    hasher.update(_raw_bytes(tensor))
    return hasher.hexdigest()


def _module_tensors(module: torch.nn.Module, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The module's parameters, then its buffers, of the wanted names (each name once)."""
    seen: set[str] = set()
    for name, tensor in (*module.named_parameters(), *module.named_buffers()):
        if name in wanted and name not in seen:
            seen.add(name)
            yield name, tensor


def _some(names: list[str], shown: int = 5) -> str:
    text = ", ".join(name[:200] for name in names[:shown])
    return text + (f" and {len(names) - shown} more" if len(names) > shown else "")


def compare_tensor_checksums(module_name: str, module: torch.nn.Module, expected: dict[str, str]) -> tuple[bool, str]:
    """(True, a summary) when every expected tensor is in `module` with the expected `tensor_sha256`; else
    (False, the missing and the differing names)."""
    actual = {name: tensor_sha256(tensor) for name, tensor in _module_tensors(module, set(expected))}
    missing = sorted(name for name in expected if name not in actual)
    differing = sorted(name for name in expected if name in actual and actual[name] != expected[name])
    if not missing and not differing:
        return True, f"module {module_name!r}: all {len(expected)} tensors match"
    problems = []
    if missing:
        problems.append(f"{len(missing)} tensors not in the module ({_some(missing)})")
    if differing:
        problems.append(f"{len(differing)} tensors differ ({_some(differing)})")
    return False, f"module {module_name!r}: " + "; ".join(problems)
