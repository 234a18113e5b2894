#!/usr/bin/env bash
# The image families at their real size (random weights built in code by benchmarks/family_rollout.py:
# FLUX 3 Klein's class defaults 5.5 B, Krea-2 12.8 B, Qwen-Image 20.4 B) on the lent H200, eager and
# compiled: the transformer (GFLOP, MFU), the decode, the engine and diffusers' pipeline on the same weights.
# Carry `.whl`. FAMILIES (default "flux3_image krea2"; qwen_image needs ~41 GB of disk in bf16), COMPILE
# ("0 1"), RESOLUTION (1024), GUIDANCE (family default: unset). One checkpoint on disk at a time.
# Written 2026-12-01 after the SD3.5-M runs (bench_sd35m.sh); not run yet.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for family in ${FAMILIES:-flux3_image krea2}; do
  ckpt=$PWD/runs/$family-random
  for compiled in ${COMPILE:-0 1}; do
    flag=(); tag=eager
    if [[ $compiled == 1 ]]; then flag=(--compile); tag=compiled; fi
    guidance=(); [[ -n ${GUIDANCE:-} ]] && guidance=(--guidance-scale "$GUIDANCE")
    echo "== $family ($tag) $(date +%T)"
    (cd benchmarks && python3 family_rollout.py --family "$family" --checkpoint "$ckpt" --resolution "${RESOLUTION:-1024}" \
      --n 8 --ms 1 8 --repeats 2 "${guidance[@]}" "${flag[@]}" --out "$OUT/family_rollout_${family}_$tag.json") 2>&1 \
      | tr '\r' '\n' | grep -v "Loading\|float32\|torchvision\|^ \|^[{}]\|^ *$"
  done
  rm -rf "$ckpt"
done
echo "== done $(date +%T)"
