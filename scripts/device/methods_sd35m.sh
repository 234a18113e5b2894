#!/usr/bin/env bash
# The RL methods side by side on SD3.5-Medium at its real size (random weights), at the sd35-grpo-pickscore
# recipe's shape: one bench_recipes.sh job per method, on the same checkpoint, 2 prompt groups × 16, 2 rollouts
# (the second's figures count; the first pays CUDA warm-up). Carry `.whl`. METHODS picks and orders them
# (default: all); a method's flags below are what differs from the recipe (Flow-GRPO, SDE, KL to the base).
# Results: $OUT/recipe_sd35-grpo-pickscore-<method>.json and log.txt.
set -uo pipefail
declare -A flags=(
  [grpo]='{}'
  [guard]='{"loss_type":"grpo_guard"}'
  [dance]='{"diffusion_sde_type":"dance","kl_type":"v-based"}'
  [mix]='{"diffusion_sde_step_strategy":"sliding","diffusion_num_sde_steps":2}'
  [nft]='{"loss_type":"nft","kl_type":"v-based"}'
  [awm]='{"loss_type":"awm","kl_type":"v-based"}'
  [dpo]='{"loss_type":"dpo","kl_type":"v-based"}'
  [dgpo]='{"loss_type":"dgpo","kl_type":"v-based"}'
  [crd]='{"loss_type":"crd","kl_type":"v-based"}'
  [sft]='{"loss_type":"sft","kl_type":"v-based"}'
)
for m in ${METHODS:-grpo guard dance mix nft awm dpo dgpo crd sft}; do
  [[ -n ${flags[$m]:-} ]] || { echo "unknown method $m (known: ${!flags[*]})"; exit 2; }
  FLAGS="--flags ${flags[$m]}" TAG=-$m KEEP=1 ROLLOUTS=${ROLLOUTS:-2} JOBS="sd35-grpo-pickscore:${GROUPS_PER_ROLLOUT:-2}" \
    bash scripts/device/bench_recipes.sh
done
