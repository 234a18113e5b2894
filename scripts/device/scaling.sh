#!/usr/bin/env bash
# Data-parallel scaling of FLUX 3 Klein NFT, and the published recipes at their published layout, on one node of
# N GPUs (kind nvidia-h200-x8; carry `.whl`). Everything goes through benchmarks/scaling.py (its docstring says
# what is timed); results land in $OUT. One 600 s call:
#
#   bash scripts/device/scaling.sh; bash scripts/device/pack_out.sh
#
# MODE=scaling (default): `--recipe flux3-klein-nft-pickscore` on random real-size weights (FLUX 3 Klein class
#   5.5 B, a random PickScore ViT-H-14, as benchmarks/recipe_runs.py builds them) at GPUS (default "1 2 4 8", those
#   present), largest world first, NGROUPS prompt groups per rollout for every world (default 8: the recipe's, one
#   per rank at 8), ROLLOUTS per world (default 2; the first untimed), the rollout alone (TRAIN=1: with the update),
#   eager (TRAIN_FLAGS, default --no-compile: the plan's priors are eager's; the recipe compiles on a GPU otherwise).
#   The whole is planned to end BUDGET seconds after the script starts (default 540): rollouts, then groups are cut
#   to fit and a world that would not fit is skipped; every cut is printed and kept in the JSON. Writes
#   scaling.json (per world: seconds per rollout, samples/s, speed-up, parallel efficiency, and whether every
#   sample has the seed, image bits and reward of the smallest world) and scaling.md (the table).
# MODE=layouts: each recipe of LAYOUTS (default "flux3-klein-grpo-hps flux3-klein-nft-pickscore") once at its
#   published layout (benchmarks/scaling.py PUBLISHED_LAYOUTS: FLUX 3 GRPO + HPSv2.1 full finetune and NFT +
#   PickScore LoRA on 8 colocated ranks; Qwen-Image GRPO + PickScore and Wan2.2 on 4 ranks plus a PickScore GPU),
#   training included, one group per rank (NGROUPS: that many; the recipe's own, e.g. 16 for FLUX 3 GRPO, is its
#   published batch shape), ROLLOUTS (default 1), TRAIN_FLAGS (more `diffrl train` flags, e.g. "--compile
#   --no-gradient-checkpointing"): layout_<recipe>.json. Qwen-Image's random checkpoint (41 GB) takes a call of its
#   own: LAYOUTS=qwen-image-grpo-pickscore.
# MODE=demo: the shipped demo model's DiffusionNFT recipe (shapes-nft-gpu) trained data-parallel at GPUS (default
#   "8 2"), ROLLOUTS (default 30) rollouts each of the recipe's 32 groups: whether the first rollout's samples are the
#   same at both sizes and whether the reward curves agree rollout by rollout within their standard errors
#   (demo_scaling.json / demo_scaling.md).
# MODE=print: the launch command of every published layout on real checkpoints (nothing runs; no GPU needed).
set -uo pipefail
start=$(date +%s)
mode=${MODE:-scaling}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [[ $mode == print ]]; then
  ${PYTHON:-python3} benchmarks/scaling.py --print-layouts --checkpoint MODEL_DIR
  exit 0
fi
bash scripts/device/install_wheels.sh || exit 1
# NVLink multicast stays off (the lent machines set these; kept set for every process this starts).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader | tee "$OUT/gpus.txt"
df -h . | tail -1
quiet() { tr '\r' '\n' | grep -v "Loading\|torchvision\|^ *$\|Writing model\|^train " ; }
# Random checkpoints: runs/<family>-random and the reward models' under runs/recipe-bench/, as bench_recipes.sh
# keeps them (runs/ is git-ignored: they stay on a warm machine between calls).
checkpoint_for() {  # RECIPE -> its family's random checkpoint
  local family
  family=$(python3 -c "from diffrl.recipes import recipe_overrides; print(recipe_overrides('$1', 'cuda')['diffusion_model_family'])")
  echo "$PWD/runs/$family-random"
}
case $mode in
  scaling)
    recipe=${RECIPE:-flux3-klein-nft-pickscore}
    left=$(( ${BUDGET:-540} - ($(date +%s) - start) ))
    echo "== scaling $recipe, ${left} s left $(date +%T)"
    python3 benchmarks/scaling.py --recipe "$recipe" --checkpoint "$(checkpoint_for "$recipe")" \
      --gpus ${GPUS:-1 2 4 8} --groups "${NGROUPS:-8}" --rollouts "${ROLLOUTS:-2}" ${TRAIN:+--train} \
      --budget-s "$left" --work-dir runs/recipe-bench --out "$OUT/scaling.json" --md "$OUT/scaling.md" \
      -- ${TRAIN_FLAGS:---no-compile} 2>&1 | quiet | tee "$OUT/log.txt"
    ;;
  layouts)
    for recipe in ${LAYOUTS:-flux3-klein-grpo-hps flux3-klein-nft-pickscore}; do
      left=$(( ${BUDGET:-540} - ($(date +%s) - start) ))
      echo "== layout $recipe, ${left} s left $(date +%T)" | tee -a "$OUT/log.txt"
      (( left > 120 )) || { echo "skipped: under 120 s left" | tee -a "$OUT/log.txt"; continue; }
      # No outer timeout: scaling.py keeps the budget and kills a late world's whole session (ranks included).
      python3 benchmarks/scaling.py --layout "$recipe" --checkpoint "$(checkpoint_for "$recipe")" \
        --rollouts "${ROLLOUTS:-1}" --budget-s "$left" --work-dir runs/recipe-bench ${NGROUPS:+--groups "$NGROUPS"} \
        --out "$OUT/layout_$recipe.json" ${TRAIN_FLAGS:+-- $TRAIN_FLAGS} 2>&1 | quiet | tee -a "$OUT/log.txt"
      nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' '; echo
    done
    ;;
  demo)
    left=$(( ${BUDGET:-540} - ($(date +%s) - start) ))
    echo "== demo model, shapes-nft-gpu at ${GPUS:-8 2} GPUs, ${left} s left $(date +%T)"
    python3 benchmarks/scaling.py --checkpoint diffrl/assets/demo-shapes --gpus ${GPUS:-8 2} --train \
      --rollouts "${ROLLOUTS:-30}" --prior-s-per-sample 0.01 --prior-startup-s 40 --budget-s "$left" \
      --work-dir runs/demo-scaling --out "$OUT/demo_scaling.json" --md "$OUT/demo_scaling.md" \
      -- --recipe shapes-nft-gpu 2>&1 | quiet | tee "$OUT/log.txt"
    ;;
  *) echo "MODE=$mode: scaling, layouts, demo or print" >&2; exit 2 ;;
esac
echo "== done $(date +%T), $(( $(date +%s) - start )) s"
