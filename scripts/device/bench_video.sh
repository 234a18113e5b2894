#!/usr/bin/env bash
# The video recipes end to end on the lent H200 at real size with random weights built in code
# (benchmarks/recipe_runs.py, family_rollout.REAL_SIZES): 3 rollouts with the recipe's reward model (a random
# PickScore, CLIP ViT-H-14), advantages, pairs and optimizer steps, then a rollout microgroup sweep on the same
# trainer. Carry `.whl`.
#
# JOBS: RECIPE:GROUPS[:FRAMES[:HEIGHTxWIDTH]] items run in order. GROUPS: prompt groups per rollout; FRAMES and
# the size: cuts below the recipe's ("-" or absent: the recipe's). Samples per prompt, steps, CFG, SDE settings,
# microgroup, LoRA and precision stay the recipe's; the JSON's `cuts` lists what does not.
# MICROGROUPS: rollout microgroup sizes timed after the main rollouts, SWEEP_ROLLOUTS (2) each; the main
# rollouts after the first stand for the recipe's size. ROLLOUTS: main rollouts (3; the first is the warm-up).
# BUDGET_S (500): no sweep rollout starts that would end later than this many seconds after the script began
# (by the longest so far), so that three calls and the machine's start fit 30 minutes of device time; a main
# rollout only for the call's own limit (575 s). The JSON is rewritten after every rollout.
# FLAGS: more recipe_runs.py flags (e.g. "--tiny --device cpu" for a dry run of this script).
# Out: $OUT/video_RECIPE.json and $OUT/log.txt. Checkpoints live in runs/FAMILY-random (git-ignored; a warm
# machine keeps them between calls); every other family's is deleted before a job builds or loads its own, as
# the disk (64 GiB) holds one: Wan2.2 30 GB (its second expert links the first's files), LTX-2.3 45 GB,
# Cosmos3 32 GB, plus the random PickScore (4 GB, kept).
#
# One family per call (timeout_s 600, carry [".whl"]), in this order. Estimates: FLOPs per forward from the
# models' shapes, MFU 35-50% as the image recipes measured; setup (wheels, building and writing the checkpoint,
# PickScore, loading) ~2-2.5 min. BUDGET_S drops the sweep rollouts that would not fit: each call ~8.5 min.
#   JOBS="wan22-grpo-pickscore:1" MICROGROUPS="4 16 2 1" bash scripts/device/bench_video.sh
#     Wan2.2 A14B (2 × 14.3 B), 1 frame of 480² as published, 1 group (of 8) × 16 samples, recipe microgroup 8;
#     ~28 TFLOP per forward, ~35 s per rollout: 3 rollouts ~2 min, sweep ~4 min (7-8 of its 8 rollouts).
#   JOBS="ltx23-grpo-pickscore:1" MICROGROUPS="8" bash scripts/device/bench_video.sh
#     LTX-2.3 (19 B + 2.1 B connectors), 57 frames of 512 × 768 as published, 1 group (of 8) × 8 samples,
#     recipe microgroup 1; ~90 TFLOP per forward (audio stream included), ~80-105 s per rollout: 3 rollouts
#     4-5 min, then microgroup 8 as far as it fits (0-2 rollouts). With a fourth call's time, the sweep at 25
#     frames (a cut; ~45 TFLOP, ~45 s per rollout): JOBS="ltx23-grpo-pickscore:1:25" MICROGROUPS="8 4 2"
#   JOBS="cosmos3-grpo:1" MICROGROUPS="4 16" bash scripts/device/bench_video.sh
#     Cosmos3 (15.2 B) at the recipe's size, miles-diffusion's text-to-image run: one frame of 480 × 832, 16 steps
#     with CFG 4, 1 group (of 48) × 16 samples, recipe microgroup 1, one sample per forward; one latent frame, a
#     third of the 9-frame cut's tokens, so rollouts of well under a minute: 3 rollouts and the sweep fit. A video cut instead:
#     JOBS="cosmos3-grpo:1:9" (9 frames, ~19 TFLOP per forward, 70-90 s per rollout).
#
# http:FAMILY:GROUPS[:FRAMES[:HEIGHTxWIDTH]] items run benchmarks/video_microgroups_http.py instead: the family's
# real-size random checkpoint behind one engine server (a subprocess, loopback HTTP), a rollout of GROUPS prompts ×
# 8 samples at each microgroup size of MICROGROUPS (default "1 8 2 4"), streaming on and off, scored by SCORER
# (default temporal_consistency, on the CPU; sleep:S: a stand-in costing S s per sample), 24 steps with 3 CPS steps
# at noise 0.8 and CFG 1 (LTX-2.3's recipe), the engine denoising each request alone (the recipe's deterministic
# mode). No rollout starts that would end past the call's limit (575 s); the JSON is rewritten after each.
# Out: $OUT/video_http_FAMILY.json (wall, first scored sample, scoring hidden under the engine, per M and mode).
#   JOBS="http:ltx2:1:57" MICROGROUPS="1 8" bash scripts/device/bench_video.sh
#     The published claim (M = 1 pipelines better for LTX-2.3): 512 × 768 × 57 frames (the recipe's), 1 prompt × 8
#     samples; a response of 8 is ~2.2 GB (compact). Setup ~2.5 min, ~60-100 s per rollout: M 1 and 8, streaming
#     on and off (4 rollouts). A second call: MICROGROUPS="2 4"; a third: SCORER=sleep:2 MICROGROUPS="1 8".
set -uo pipefail
started=$(date +%s)
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
# The video recipes run in deterministic mode, whose cuBLAS workspace must be set before CUDA starts.
export CUBLAS_WORKSPACE_CONFIG=:4096:8
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|torchvision\|^ *$\|Writing model\|^train " ; }
for job in ${JOBS:?JOBS=recipe:groups[:frames[:HxW]] ...}; do
  if [[ $job == http:* ]]; then
    IFS=: read -r _ family groups frames size <<<"$job"
  else
    IFS=: read -r recipe groups frames size <<<"$job"
    family=$(python3 -c "from diffrl.recipes import recipe_overrides; print(recipe_overrides('$recipe', 'cuda')['diffusion_model_family'])")
  fi
  for other in runs/*-random runs/*-random.partial; do
    [[ -e $other && $other != runs/$family-random ]] && rm -rf "$other"
  done
  mkdir -p runs && df -h runs | tail -1
  if [[ $job == http:* ]]; then
    args=(--family "$family" --checkpoint "runs/$family-random" --prompts "$groups" --stop-by "$((started + 575))"
          --scorer "${SCORER:-temporal_consistency}")
    [[ -n ${frames:-} && $frames != - ]] && args+=(--num-frames "$frames")
    [[ -n ${size:-} && $size != - ]] && args+=(--height "${size%x*}" --width "${size#*x}")
    # shellcheck disable=SC2206  # lists of words
    args+=(--microgroups ${MICROGROUPS:-1 8 2 4})
    # shellcheck disable=SC2206
    [[ -n ${FLAGS:-} ]] && args+=(${FLAGS})
    echo "== $job $(date +%T)" | tee -a "$OUT/log.txt"
    python3 benchmarks/video_microgroups_http.py --out "$OUT/video_http_${family}.json" "${args[@]}" 2>&1 | quiet \
      | tee -a "$OUT/log.txt"
    nvidia-smi --query-gpu=memory.used --format=csv,noheader
    continue
  fi
  args=(--rollout-batch-size "$groups" --num-rollout "${ROLLOUTS:-3}" --sweep-rollouts "${SWEEP_ROLLOUTS:-2}"
        --stop-by "$((started + 575))" --sweep-stop-by "$((started + ${BUDGET_S:-500}))")
  [[ -n ${frames:-} && $frames != - ]] && args+=(--num-frames "$frames")
  [[ -n ${size:-} && $size != - ]] && args+=(--height "${size%x*}" --width "${size#*x}")
  # shellcheck disable=SC2206  # lists of words
  [[ -n ${MICROGROUPS:-} ]] && args+=(--microgroups ${MICROGROUPS})
  # shellcheck disable=SC2206
  [[ -n ${FLAGS:-} ]] && args+=(${FLAGS})
  echo "== $job $(date +%T)" | tee -a "$OUT/log.txt"
  (cd benchmarks && python3 recipe_runs.py --recipe "$recipe" --checkpoint "$PWD/../runs/$family-random" \
    --work-dir "$PWD/../runs/recipe-bench" --out "$OUT/video_${recipe}.json" "${args[@]}") 2>&1 | quiet \
    | tee -a "$OUT/log.txt"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
echo "== done $(date +%T), $(( $(date +%s) - started )) s" | tee -a "$OUT/log.txt"
