"""The RL methods diffrl trains with: one row per `--loss-type`, what its rollout and loss need.

This table is the one place that says which methods exist; `train/objectives/` implements each (its
registry has the same keys, a test keeps them equal), the configuration checks flags against it, and
the README's method table and `docs/algorithms.md` describe the same rows.

- `rollout`: `sde` (stochastic steps with log-probs: the policy-gradient methods) or `ode` (deterministic
  samples; only the final clean latent is kept: the forward-process methods, which train on re-noised
  samples at timesteps of their own choosing).
- `sampler`: who samples: `current` (on-policy weights) or `old` (an EMA of them, the method's "old policy").
- `reference`: whether the loss itself reads the frozen base model (every method can add a KL term to it).
- `rows`: what one train pair holds: `sample` (one sample at one timestep), `preference` (a chosen and a
  rejected sample of one prompt), `group` (all samples of one prompt at one shared timestep and noise).
- `folds_lora`: whether its forwards without gradients with the adapter on (the rollout, an old policy) only
  sample and give regression targets, so that they may run a LoRA adapter folded into the weights
  (`--fold-lora-without-grad`, `models/lora.py`), which rounds differently from the trained forward; false where
  the loss sets such a forward against a trained one in a ratio (a replayed log-prob, an old policy's likelihood).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Method:
    name: str  # the --loss-type value
    title: str
    paper: str
    rollout: Literal["sde", "ode"]
    sampler: Literal["current", "old"]
    reference: bool
    rows: Literal["sample", "preference", "group"]
    folds_lora: bool = False


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("flow_grpo", "Flow-GRPO (and DanceGRPO, MixGRPO / Flow-GRPO-Fast by rollout flags)", "arXiv 2505.05470",
           "sde", "current", False, "sample"),
    Method("grpo_guard", "GRPO-Guard / TempFlow-GRPO: the policy ratio normalized per timestep", "arXiv 2510.22319",
           "sde", "current", False, "sample"),
    Method("nft", "DiffusionNFT", "arXiv 2509.16117", "ode", "old", False, "sample", folds_lora=True),
    Method("awm", "Advantage Weighted Matching", "arXiv 2509.25050", "ode", "current", False, "sample"),
    Method("dpo", "online Diffusion-DPO", "arXiv 2311.12908", "ode", "current", True, "preference"),
    Method("dgpo", "Direct Group Preference Optimization", "arXiv 2510.08425", "ode", "current", True, "group"),
    Method("crd", "Centered Reward Distillation", "arXiv 2603.14128", "ode", "old", False, "group"),
    Method("sft", "reward-filtered fine-tuning (RAFT)", "arXiv 2304.06767", "ode", "current", False, "sample",
           folds_lora=True),
)}

LOSS_TYPES = tuple(METHODS)
SDE_LOSS_TYPES = tuple(name for name, m in METHODS.items() if m.rollout == "sde")


def folds_lora(loss_type: str, choice: str = "auto") -> bool:
    """Whether a LoRA run of `loss_type` folds its adapter in no-gradient forwards under --fold-lora-without-grad
    `choice` (auto: the method's `folds_lora`); the trainer and `diffrl evaluate` of its checkpoints read it here."""
    return choice == "on" or (choice == "auto" and loss_type in METHODS and METHODS[loss_type].folds_lora)
