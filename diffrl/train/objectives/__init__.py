"""One objective per RL method (`--loss-type`; `algorithms/methods.py` is the table of them).

An objective says what a rollout asks the engines for (`request`), which train pairs the scored samples make
(`pairs`), and the loss of one micro-batch of them (`loss`); the loop (`train/trainer.py`) runs any of them
alike. Each lives in a module of its own and reads its own config section (plus the shared rollout and
algorithm settings); the loss math itself is in `algorithms/losses.py`.

- SDE rollouts with log-probs: `flow_grpo` (Flow-GRPO; DanceGRPO and MixGRPO are rollout flags),
  `grpo_guard` (GRPO-Guard / TempFlow-GRPO).
- ODE rollouts, trained on re-noised clean samples: `nft` (DiffusionNFT), `awm` (Advantage Weighted
  Matching), `dpo` (online Diffusion-DPO), `dgpo` (Direct Group Preference Optimization), `crd` (Centered
  Reward Distillation), `sft` (reward-filtered fine-tuning).
"""

from __future__ import annotations

from diffrl.train.objectives.awm import AdvantageWeightedMatching
from diffrl.train.objectives.base import Objective, conditioning_rows, rollout_conditioning
from diffrl.train.objectives.crd import CenteredRewardDistillation
from diffrl.train.objectives.dpo import DiffusionDpo, GroupPreference
from diffrl.train.objectives.flow_grpo import FlowGrpo, GrpoGuard
from diffrl.train.objectives.nft import DiffusionNft
from diffrl.train.objectives.sft import RewardFilteredSft

OBJECTIVES: dict[str, type[Objective]] = {
    "flow_grpo": FlowGrpo, "grpo_guard": GrpoGuard, "nft": DiffusionNft, "awm": AdvantageWeightedMatching,
    "dpo": DiffusionDpo, "dgpo": GroupPreference, "crd": CenteredRewardDistillation, "sft": RewardFilteredSft,
}


def build_objective(cfg, policy) -> Objective:
    return OBJECTIVES[cfg.algorithm.loss_type](cfg, policy)


__all__ = ["OBJECTIVES", "Objective", "build_objective", "conditioning_rows", "rollout_conditioning"]
