"""LoRA adapters on a family's transformer: one construction for the trainer and the engines, so
the adapter an engine adds has the parameter names the trainer pushes into it."""

from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator


class LoraSpec(BaseModel):
    """What an engine needs to host the trainer's adapter (sent as JSON to `POST /lora_adapter`)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(ge=1)
    alpha: float = Field(gt=0)
    target_modules: list[str] = Field(min_length=1)

    @field_validator("target_modules")
    @classmethod
    def _sorted(cls, names: list[str]) -> list[str]:  # order-free, so two specs compare with ==
        return sorted(names)


def add_lora(transformer: torch.nn.Module, spec: LoraSpec) -> None:
    """Add the adapter "default" (A Gaussian, B zero: the model's output is unchanged until trained)."""
    from peft import LoraConfig

    transformer.add_adapter(LoraConfig(r=spec.rank, lora_alpha=spec.alpha, init_lora_weights="gaussian",
                                       target_modules=list(spec.target_modules)))
    # The adapter is trained: fp32 masters even on a bf16 base (peft creates it in the base's dtype and
    # casts its input to the adapter's dtype, so the two mix).
    for name, param in transformer.named_parameters():
        if "lora_" in name and param.dtype != torch.float32:
            param.data = param.data.float()


def current_lora(transformer: torch.nn.Module) -> LoraSpec | None:
    """The spec of the transformer's adapter "default", or None without one."""
    config = getattr(transformer, "peft_config", {}).get("default")
    if config is None:
        return None
    return LoraSpec(rank=config.r, alpha=config.lora_alpha, target_modules=list(config.target_modules))
