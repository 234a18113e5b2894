"""LoRA adapters on a family's transformer: one construction for the trainer and the engines, so
the adapter an engine adds has the parameter names the trainer pushes into it."""

from __future__ import annotations

import contextlib
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
    fold_without_grad: bool = False
    """Forwards without gradients (sampling, an old policy's target) run each adapted linear layer as one matmul with
    the adapter folded into a copy of its weight (W + s·B·A, rounded once to the forward's dtype), instead of the
    base matmul plus the adapter's two thin ones and their adds, which read and write activation-sized tensors
    (`_LoraLayer._folded_forward`). The result differs from the unfolded one by that rounding (none while B = 0): for
    methods whose no-gradient forwards are targets, not the other side of a ratio with a trained forward."""

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
    set_lora_folding(transformer, spec.fold_without_grad)


def keep_autocast_inputs(transformer: torch.nn.Module) -> None:
    """Under autocast, let the adapters' matmuls take their input in the autocast dtype.

    peft casts a LoRA layer's input to the adapter's dtype (fp32 here) before `lora_A`, and autocast casts it
    straight back to bf16 for the matmul: on a bf16 forward that is two full copies of every adapted layer's
    input (an [tokens, width] tensor written in fp32, then read and written again in bf16) and two kernels,
    per layer and forward, for the same bf16 numbers (bf16 → fp32 → bf16 is exact) and the same gradients.
    Layers with dropout before `lora_A` keep peft's cast (dropout on bf16 draws and scales differently)."""
    from peft.tuners.lora import LoraLayer

    for module in transformer.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, _LoraLayer) and all(
                isinstance(d, torch.nn.Identity) for d in module.lora_dropout.values()):
            module.__class__ = _keep_autocast_input_class(type(module))


def set_lora_folding(transformer: torch.nn.Module, enabled: bool) -> int:
    """Whether the adapter's linear layers fold it into their weight in forwards without gradients
    (`LoraSpec.fold_without_grad`); returns how many layers can (linear layers without dropout)."""
    layers = [m for m in transformer.modules() if isinstance(m, _LoraLayer) and m.foldable()]
    for layer in layers:
        layer.fold_without_grad = enabled
    return len(layers)


@contextlib.contextmanager
def lora_unfolded(transformer: torch.nn.Module):
    """The adapter unfolded inside the block: FLOP counts count the model's work (the adapter's matmuls on the
    activations), which MFU is stated against, the same with or without the fold."""
    folded = lora_folding(transformer)
    set_lora_folding(transformer, False)
    try:
        yield
    finally:
        set_lora_folding(transformer, folded)


def lora_folding(transformer: torch.nn.Module) -> bool:
    """Whether the transformer's adapter folds in forwards without gradients (`set_lora_folding`)."""
    return any(getattr(m, "fold_without_grad", False) for m in transformer.modules() if isinstance(m, _LoraLayer))


class _LoraLayer:
    """peft's LoRA layer, changed in two ways: the input under autocast is not cast to fp32 and back
    (`keep_autocast_inputs`), and a linear layer may fold its adapter in forwards without gradients."""

    fold_without_grad = False

    def foldable(self) -> bool:
        from peft.tuners.lora import Linear

        return isinstance(self, Linear) and type(self.get_base_layer()) is torch.nn.Linear  # not an FP8 linear

    def forward(self, x, *args, **kwargs):
        if (self.fold_without_grad and not torch.is_grad_enabled() and not args and not kwargs
                and not self.disable_adapters and not self.merged):
            adapters = [a for a in self.active_adapters if a in self.lora_A]
            if len(adapters) == 1 and adapters[0] not in getattr(self, "lora_variant", {}):  # not DoRA and the like
                return self._folded_forward(x, adapters[0])
        return super().forward(x, *args, **kwargs)

    def _folded_forward(self, x: torch.Tensor, adapter: str) -> torch.Tensor:
        """y = x·(W + s·B·A)ᵀ + bias as one matmul. The product B·A is [out, in] (a weight's size, written once per
        forward) where the unfolded path writes and reads [tokens, out] and [tokens, rank] tensors of every
        row; both terms add in fp32 and round once to the matmul's dtype."""
        base = self.get_base_layer()
        lora_a, lora_b = self.lora_A[adapter].weight, self.lora_B[adapter].weight
        if torch.is_autocast_enabled(x.device.type):
            dtype = torch.get_autocast_dtype(x.device.type)
        else:
            dtype = x.dtype
        with torch.autocast(x.device.type, enabled=False):
            weight = (base.weight.float() + (lora_b.float() @ lora_a.float()) * self.scaling[adapter]).to(dtype)
            bias = None if base.bias is None else base.bias.to(dtype)
            return torch.nn.functional.linear(x.to(dtype), weight, bias)

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
        _CLASSES[cls] = type(cls.__name__, (_LoraLayer, cls), {"__module__": cls.__module__})
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
                    components=components, fold_without_grad=lora_folding(transformer))
