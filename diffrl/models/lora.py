"""LoRA adapters on a family's transformer: one construction for the trainer and the engines, so
the adapter an engine adds has the parameter names the trainer pushes into it."""

from __future__ import annotations

import json
import math
import re

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from diffrl.errors import RequestError

# Layer types peft can wrap with a LoRA adapter (a target must name at least one of them).
_LORA_LAYERS = (torch.nn.Linear, torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)


class LoraSpec(BaseModel):
    """What an engine needs to host the trainer's adapter (sent as JSON to `POST /lora_adapter`).
    The schema bounds what any engine could take; `check_lora` checks it against one transformer."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    rank: int = Field(ge=1, le=65536)
    alpha: float = Field(gt=0, le=1e6)
    target_modules: list[str] = Field(min_length=1, max_length=256)
    components: list[str] = Field(default_factory=list, max_length=16)
    """The transformer's top-level parts that get the adapter (Wan2.2's experts: `transformer`, `transformer_2`);
    empty: all of it."""

    @field_validator("rank", "alpha", mode="before")
    @classmethod
    def _numbers(cls, value):
        """A JSON boolean or string is refused where a number belongs: pydantic's lax mode would read `true` as rank 1
        and "2" as 2, hiding a client's bug (the rollout request refuses them the same way)."""
        if isinstance(value, (bool, str)):
            kind = "a boolean" if isinstance(value, bool) else "a string"
            raise ValueError(f"must be a number, not {kind} ({json.dumps(value)[:40]})")
        return value

    @field_validator("target_modules", "components")
    @classmethod
    def _sorted(cls, names: list[str]) -> list[str]:  # order-free, so two specs compare with ==
        for name in names:
            if not 1 <= len(name) <= 256:
                raise ValueError("each name must have 1 to 256 characters")
        return sorted(set(names))


def check_lora(transformer: torch.nn.Module, spec: LoraSpec, max_rank: int) -> None:
    """Refuse (naming the field) a spec this transformer cannot host, before anything is installed:
    a rank above `max_rank` or above every targeted layer's size, a non-finite alpha, a target module
    that matches no adaptable layer (peft matches a name exactly or as a dotted suffix)."""
    if spec.rank > max_rank:
        raise RequestError("rank", f"{spec.rank} is above this engine's limit of {max_rank} (--max-lora-rank)")
    if not math.isfinite(spec.alpha) or spec.alpha <= 0:
        raise RequestError("alpha", f"must be finite and > 0, got {spec.alpha}")
    layers = [(name, m) for name, m in transformer.named_modules() if isinstance(m, _LORA_LAYERS)]
    for target in spec.target_modules:
        if not any(name == target or name.endswith("." + target) for name, _ in layers):
            raise RequestError("target_modules", f"{target!r} matches no linear, conv or embedding layer of "
                                                 f"this transformer")
    parts = adaptable_parts(transformer)
    if unknown := [c for c in spec.components if c not in parts]:
        raise RequestError("components", f"{unknown[0]!r} is no part of this transformer (its parts: "
                                         f"{', '.join(parts) or 'none: it is one module'})")


def adaptable_parts(transformer: torch.nn.Module) -> list[str]:
    """The names of the transformer's direct children that hold adaptable layers, when it is a container of
    several models (Wan2.2's `WanExperts`: `transformer`, `transformer_2`); [] for a single model."""
    names = [name for name, child in transformer.named_children()
             if hasattr(child, "config") and any(isinstance(m, _LORA_LAYERS) for m in child.modules())]
    return names if len(names) > 1 else []


def _excluded_parts(transformer: torch.nn.Module, components: list[str]) -> str | None:
    """peft's `exclude_modules` (a regex, full match) for every part not in `components`; None: nothing excluded.
    The targets stay the plain suffixes, so an expert's saved adapter loads into that expert alone as well."""
    others = [p for p in adaptable_parts(transformer) if components and p not in components]
    return rf"(?:{'|'.join(map(re.escape, others))})\..*" if others else None


def add_lora(transformer: torch.nn.Module, spec: LoraSpec) -> None:
    """Add the adapter "default" (A Gaussian, B zero: the model's output is unchanged until trained).
    All or nothing: if peft fails part-way, the half-built adapter is removed again."""
    from peft import LoraConfig

    try:
        transformer.add_adapter(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, init_lora_weights="gaussian",
                                           target_modules=list(spec.target_modules),
                                           exclude_modules=_excluded_parts(transformer, spec.components)))
    except Exception:
        remove_lora(transformer)
        raise
    # The adapter is trained: fp32 masters even on a bf16 base (peft creates it in the base's dtype and
    # casts its input to the adapter's dtype, so the two mix).
    for name, param in transformer.named_parameters():
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()
    keep_autocast_inputs(transformer)


def keep_autocast_inputs(transformer: torch.nn.Module) -> None:
    """Under autocast, let the adapters' matmuls take their input in the autocast dtype.

    peft casts a LoRA layer's input to the adapter's dtype (fp32 here) before `lora_A`, and autocast casts it
    straight back to bf16 for the matmul: on a bf16 forward that is two full copies of every adapted layer's
    input (an [tokens, width] tensor written in fp32, then read and written again in bf16) and two kernels,
    per layer and forward, for the same bf16 numbers (bf16 → fp32 → bf16 is exact) and the same gradients.
    Layers with dropout before `lora_A` keep peft's cast (dropout on bf16 draws and scales differently)."""
    from peft.tuners.lora import LoraLayer

    for module in transformer.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, _KeepAutocastInput) and all(
                isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values()):
            module.__class__ = _keep_autocast_input_class(type(module))


class _KeepAutocastInput:
    def _cast_input_dtype(self, x, dtype: torch.dtype):
        if (isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type in ("cuda", "cpu")
                and torch.is_autocast_enabled(x.device.type)
                and x.dtype == torch.get_autocast_dtype(x.device.type)):
            return x
        return super()._cast_input_dtype(x, dtype)


_CLASSES: dict[type, type] = {}


def _keep_autocast_input_class(cls: type) -> type:
    """One subclass per peft layer class (a subclass rather than a patched method: deep copies of the model,
    an old policy or a reference, keep it)."""
    if cls not in _CLASSES:
        _CLASSES[cls] = type(cls.__name__, (_KeepAutocastInput, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]


def remove_lora(transformer: torch.nn.Module) -> None:
    """Take the adapter "default" off again (and its config), whatever state peft left it in."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(transformer.named_modules()):
        if isinstance(module, LoraLayer | BaseTunerLayer) and hasattr(module, "get_base_layer"):
            parent_name, _, child = name.rpartition(".")
            parent = transformer.get_submodule(parent_name) if parent_name else transformer
            setattr(parent, child, module.get_base_layer())
    config = getattr(transformer, "peft_config", None)
    if isinstance(config, dict):
        config.pop("default", None)
        if not config:
            del transformer.peft_config
    if hasattr(transformer, "_hf_peft_config_loaded"):
        transformer._hf_peft_config_loaded = False


def current_lora(transformer: torch.nn.Module) -> LoraSpec | None:
    """The spec of the transformer's adapter "default", or None without one."""
    config = getattr(transformer, "peft_config", {}).get("default")
    if config is None:
        return None
    excluded = getattr(config, "exclude_modules", None)  # what `add_lora` wrote for `components`, or None
    components = ([] if not excluded else
                  [p for p in adaptable_parts(transformer) if not re.fullmatch(excluded, f"{p}.x")])
    return LoraSpec(rank=config.r, alpha=config.lora_alpha, target_modules=list(config.target_modules),
                    components=components)
