#!/usr/bin/env bash
# The published recipes end to end on the lent H200 with real-size random weights (benchmarks/recipe_runs.py):
# rollouts with the recipe's reward model, advantages, pairs, optimizer steps. Carry `.whl`.
# JOBS: RECIPE:GROUPS items run in order (GROUPS: prompt groups per rollout, cut to fit the call's time;
# everything else is the recipe's), ROLLOUTS (default 3). FLAGS: more recipe_runs.py flags for every job, e.g.
# FLAGS='--flags {"gradient_checkpointing":false}' (no spaces in the JSON; a lever measured against the
# recipe's own row) with TAG=-nogc naming its JSON apart. Checkpoints stay in runs/ (git-ignored) between calls
# on a warm machine; a family's checkpoint is removed when a job of another family needs the disk (KEEP=1 keeps).
# An OCR recipe (sd35-grpo-ocr) scores with RapidOCR: carry [".whl", ".whl-ocr"], with results/ moved out of the
# checkout for that call (both wheel sets and results/ together pass the 64 MiB a call may carry).
# Image-conditioned recipes run as they are: recipe_runs.py builds the variant their family needs (Wan2.2 I2V,
# FLUX.1 Kontext, Qwen-Image-Edit Plus, FLUX.2 [dev]) in its own runs/<family>-<variant>-random and writes a
# prompts.jsonl of generated condition images, e.g.
#   JOBS="wan22-i2v-grpo-pickscore:2 flux1-kontext-grpo-pickscore:4 qwen-image-edit-grpo-pickscore:2 \
#         flux3-klein-edit-nft-pickscore:2 ltx23-i2v-grpo-pickscore:1" ROLLOUTS=2
# flux2-dev-edit-grpo-pickscore:2 alone, with WEIGHTLESS=1 (its 66 GB checkpoint would not fit the disk), on an H200.
# DEPTH=N: real widths with N blocks of each kind (checkpoints runs/<name>-depthN-random): the real model's compiled
# graphs in minutes, for a first-pass exactness check of every recipe (ROLLOUTS=1), not for its cost.
# WEIGHTLESS=1: the transformer's random weights are drawn when the run loads it, not stored (runs/<name>-weightless-
# random): a real-size model whose checkpoint would not fit the disk (FLUX.2 [dev], 66 GB), for its cost only.
# JOB_TIMEOUT=S stops a job after S seconds (the JSON keeps its finished rollouts) so the next one still runs.
# WORK (default runs/recipe-bench): the jobs' work folder (prompt files, reward checkpoints); lanes of jobs run side by
# side on one GPU (DEPTH checks, whose timings do not count) each need their own, and KEEP=1.
# A call brings back at most 8 files: end one that runs more jobs than that with `bash scripts/device/pack_out.sh`.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
df -h . | tail -1
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|torchvision\|^ *$\|Writing model\|^train " ; }
weightless=False; [[ -n ${WEIGHTLESS:-} ]] && weightless=True
for job in ${JOBS:?JOBS=recipe:groups ...}; do
  recipe=${job%%:*}; groups=${job##*:}
  # <family>-random, or <family>-<variant>-random for an image-conditioned variant (never a text-only one's)
  name=$(cd benchmarks && python3 -c "from recipe_runs import checkpoint_name; print(checkpoint_name('$recipe', ${DEPTH:-None}, $weightless))")
  [[ -n $name ]] || { echo "== $recipe: no checkpoint name (unknown recipe?)" | tee -a "$OUT/log.txt"; continue; }
  ckpt=$PWD/runs/$name
  if [[ -z ${KEEP:-} ]]; then  # a stopped build's .partial folder too
    for other in runs/*-random runs/*-random.partial; do [[ -d $other && $other != runs/$name ]] && rm -rf "$other"; done
  fi
  echo "== $recipe ($groups groups) $(date +%T)"
  (cd benchmarks && timeout "${JOB_TIMEOUT:-0}" python3 recipe_runs.py --recipe "$recipe" --checkpoint "$ckpt" --rollout-batch-size "$groups" \
    --num-rollout "${ROLLOUTS:-3}" ${DEPTH:+--depth $DEPTH} ${WEIGHTLESS:+--weightless} ${FLAGS:-} --work-dir "$PWD/../${WORK:-runs/recipe-bench}" --out "$OUT/recipe_${recipe}${TAG:-}.json") 2>&1 | quiet \
    | grep -v '^    \|^[{}]' | tee -a "$OUT/log.txt"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
done
echo "== done $(date +%T)"
