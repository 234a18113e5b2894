#!/usr/bin/env bash
# SD3.5-Medium at its real size (random weights built in code, no download) on the lent H200, at the
# published Flow-GRPO SD3.5 settings (512², 10 steps, CFG 4.5, LoRA r32): the published code's own loop (BENCHMARKS.md "SD3.5-Medium at Flow-GRPO's settings"), side by side.
# Carry `.whl`. JOBS is a list of STAGE:COMPILE, run in order (default: all five):
#   rollout:0 / rollout:1  benchmarks/family_rollout.py: the transformer alone, our engine, diffusers'
#                          StableDiffusion3Pipeline on the same weights, eager / regionally compiled
#   train:0 / train:1      `diffrl bench-train` (Flow-GRPO, SDE on 9 of 10 steps, 4 prompts × 16 samples per
#                          rollout, jpeg_compressibility in 6 worker processes), eager / --compile: the training
#                          loop's cost table (steady state = the rollouts after the first), with an MFU estimate
#   baseline:0             benchmarks/flow_grpo_baseline.py: the published Flow-GRPO code's rollout and train
#                          step on diffusers' pipeline, same weights and batch shape (eager, as published);
#                          e.g. JOBS="baseline:0 train:1" puts the peer and diffrl in one call
#   profile:0 / profile:1  benchmarks/profile_training.py (not in the default list): one `diffrl train --recipe
#                          sd3-grpo` step after a warm-up under torch.profiler, eager / --compile: GPU busy vs
#                          wall, kernels by category, host syncs, launches, host and GPU time per phase;
#                          profile_sd35m_{eager,compiled}.json, and the gzipped Chrome trace when under 15 MiB
# ROLLOUTS (train, default 3), BASELINE_ITERATIONS (baseline, measured after one warm-up, default 2),
# PROFILE_GROUPS (profile: prompt groups of 16 per rollout; default 2, to stay near 3 minutes; the recipe's: 4);
# TRAIN_FLAGS / ROLLOUT_FLAGS / BASELINE_FLAGS / PROFILE_FLAGS: more flags for one or another
# (e.g. TRAIN_FLAGS=--no-compile-eager-numerics, ROLLOUT_FLAGS=--eager-numerics). Results land in $OUT (JSON / metrics JSONL per job);
# TAG (e.g. -cudnn) is appended to every result's name, so two variants can run in one call.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
ckpt=$PWD/runs/sd35m-random  # runs/ is git-ignored: kept on a warm machine between calls
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|^train \|torchvision\|^ *$" ; }
make_ckpt() {
  [[ -d $ckpt ]] || (cd benchmarks && python3 -c "
import sys, torch; from pathlib import Path; from family_rollout import make_checkpoint
make_checkpoint('sd3', Path(sys.argv[1]), torch.device('cuda'))" "$ckpt")
}
for job in ${JOBS:-rollout:0 rollout:1 train:0 train:1 baseline:0}; do
  stage=${job%%:*}; compiled=${job##*:}
  flag=(); tag=eager
  if [[ $compiled == 1 ]]; then flag=(--compile); tag=compiled; fi
  tag+=${TAG:-}
  echo "== $stage ($tag) $(date +%T)"
  case $stage in
    rollout)
      (cd benchmarks && python3 family_rollout.py --family sd3 --checkpoint "$ckpt" --resolution 512 \
        --guidance-scale 4.5 --n 16 --ms 1 8 16 --repeats 2 "${flag[@]}" ${ROLLOUT_FLAGS:-} \
        --out "$OUT/family_rollout_sd35m_512_$tag.json") 2>&1 | quiet | grep -v '^ \|^[{}]' ;;
    train)
      make_ckpt
      run=runs/sd35m-grpo-$tag; rm -rf "$run"
      # --recipe sd3-grpo (diffrl/recipes.py) holds the settings measured on 2026-12-01. bench-train prints the
      # table (diffrl/cli/bench_train.py) and writes it with the per-rollout figures as JSON.
      python3 -m diffrl.cli.main bench-train --recipe sd3-grpo --model-path "$ckpt" --diffusion-model-family sd3 \
        --num-rollout "${ROLLOUTS:-3}" --reward jpeg_compressibility --reward-workers 6 --output-dir "$run" \
        --out "$OUT/train_sd35m_grpo_$tag.json" "${flag[@]}" ${TRAIN_FLAGS:-} 2>&1 | quiet | tail -22
      cp "$run/metrics.jsonl" "$OUT/train_sd35m_grpo_$tag.jsonl" 2>/dev/null ;;
    baseline)
      make_ckpt
      # The per-GPU shape of flow_grpo's SD3.5 configs (config/grpo.py, *_sd3_4gpu: 16 prompts × 16 images
      # over 4 GPUs): 64 samples per GPU (4 prompts × 16), 8 images per pipeline call, micro-batches of 8,
      # gradients accumulated into two optimizer steps per rollout. Eager, as the published code runs.
      (cd benchmarks && python3 flow_grpo_baseline.py --checkpoint "$ckpt" --resolution 512 --prompts 4 \
        --samples-per-prompt 16 --rollout-batch 8 --train-batch 8 --optimizer-steps 2 \
        --iterations "${BASELINE_ITERATIONS:-2}" ${BASELINE_FLAGS:-} \
        --out "$OUT/flow_grpo_baseline_sd35m.json") 2>&1 | quiet ;;
    profile)
      make_ckpt
      # The report's summary lines, not its JSON (that is in $OUT).
      python3 benchmarks/profile_training.py --checkpoint "$ckpt" --recipe sd3-grpo --reward jpeg_compressibility \
        --reward-workers 6 --rollout-batch-size "${PROFILE_GROUPS:-2}" --work-dir runs/profile-training "${flag[@]}" \
        ${PROFILE_FLAGS:-} --out "$OUT/profile_sd35m_$tag.json" --trace-dir "$OUT" --trace-max-mib 15 2>&1 \
        | quiet | sed '/^{/,$d' ;;
  esac
done
echo "== done $(date +%T)"
