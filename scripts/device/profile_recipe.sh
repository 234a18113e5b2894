#!/usr/bin/env bash
# Where one training step of a published recipe spends its time, on the lent H200 with the family's real-size
# random weights (benchmarks/profile_training.py: one `rollout_and_update` after a warm-up step, under
# torch.profiler). Carry `.whl`. Scored by jpeg_compressibility (no reward model to build; the transformer's,
# the decode's and the loop's time are what is measured).
#   RECIPE   a name of diffrl/recipes.py (required)
#   GROUPS   prompt groups per rollout (default 1)
#   COMPILE  1: --compile (default 0)
#   FLAGS    more `diffrl train` flags, e.g. FLAGS=--no-gradient-checkpointing
#   TAG      names the JSON apart: $OUT/profile_${RECIPE}${TAG}.json (and the gzipped Chrome trace when under 15 MiB)
# The checkpoint is kept in runs/<family>-random (git-ignored), shared with bench_recipes.sh on a warm machine.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
recipe=${RECIPE:?RECIPE=<recipe name>}
family=$(python3 -c "from diffrl.recipes import recipe_overrides; print(recipe_overrides('$recipe', 'cuda')['diffusion_model_family'])")
compile=(); [[ ${COMPILE:-0} == 1 ]] && compile=(--compile)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
echo "== profile $recipe ${compile[*]} ${FLAGS:-} $(date +%T)"
# The report's summary lines, not its JSON (that is in $OUT).
python3 benchmarks/profile_training.py --checkpoint "$PWD/runs/$family-random" --recipe "$recipe" \
  --reward jpeg_compressibility --reward-workers 6 --rollout-batch-size "${GROUPS:-1}" --work-dir runs/profile-training \
  "${compile[@]}" ${FLAGS:-} --out "$OUT/profile_${recipe}${TAG:-}.json" --trace-dir "$OUT" --trace-max-mib 15 2>&1 \
  | tr '\r' '\n' | grep -v "Loading\|float32\|torchvision\|^ *$\|Writing model\|^train " | sed '/^{/,$d'
echo "== done $(date +%T)"
