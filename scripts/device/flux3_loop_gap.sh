#!/usr/bin/env bash
# What each condition the training loop adds costs FLUX 3 Klein's compiled engine at 1024² (alone it reaches ~69% MFU;
# BENCHMARKS.md, "The published recipes end to end"), one at a time, on the same real-size random weights: what a
# compiled recipe's rollout can reach at best. Carry `.whl`.
# JOBS (default all, in order; ~2 minutes each):
#   plain     bf16 weights, no autocast (the 69% row)
#   autocast  + bf16 autocast (the loop's --mixed-precision)
#   lora      + a LoRA r32 adapter with fp32 factors (the NFT recipe's rollout)
#   masters   fp32 weights under bf16 autocast (the GRPO full finetune's rollout)
# COMPILE=0 times them eager. The loop itself, compiled:
#   JOBS="flux3-klein-grpo-hps:1 flux3-klein-nft-pickscore:1" FLAGS='--flags {"compile":true}' TAG=-compile \
#     bash scripts/device/bench_recipes.sh
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
ckpt=$PWD/runs/flux3_image-random  # shared with bench_recipes.sh and profile_recipe.sh on a warm machine
compile=(--compile); [[ ${COMPILE:-1} == 0 ]] && compile=()
for job in ${JOBS:-plain autocast lora masters}; do
  case $job in
    plain) flags=() ;;
    autocast) flags=(--autocast) ;;
    lora) flags=(--autocast --lora-rank 32) ;;
    masters) flags=(--autocast --dtype float32) ;;
    *) echo "unknown job $job"; exit 2 ;;
  esac
  echo "== $job ${compile[*]} $(date +%T)"
  (cd benchmarks && python3 family_rollout.py --family flux3_image --checkpoint "$ckpt" --resolution 1024 \
    --guidance-scale 3.5 --n 8 --ms 8 --repeats 2 --no-pipeline "${compile[@]}" "${flags[@]}" \
    --out "$OUT/flux3_loop_gap_${job}.json") 2>&1 | tr '\r' '\n' | grep -v "Loading\|float32\|^ *$\|Writing model\|^ \|^[{}]"
done
echo "== done $(date +%T)"
