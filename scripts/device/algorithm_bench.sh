#!/usr/bin/env bash
# The algorithm bench on one GPU: every method of scripts/device/sweeps/algorithms.txt (or METHODS="nft dpo …", by
# line name without its -s0) at each seed of SEEDS, all runs at once sharing the GPU, each with the same wall-clock
# budget of MINUTES of rollouts and training (held-out evaluations excluded), then the table and the plot
# (benchmarks/algorithm_bench.py). One call per seed fits a 10-minute device call:
#   SEEDS=0 MINUTES=6 bash scripts/device/algorithm_bench.sh; bash scripts/device/pack_out.sh     (carry [".whl"])
# PLAN="nft=1 sft=0 …" runs exactly those method=seed pairs instead of every method at every seed of SEEDS.
# SETTINGS="a.txt b.txt" reads method lines from those files (default: sweeps/algorithms.txt; sweeps/algorithms-tuning.txt
# holds the variants tried on the validation split).
# Every run evaluates 128 held-out images per category every 10 rollouts and at its end; no checkpoint comes back.
set -uo pipefail
sweep=/tmp/algorithms-sweep.txt
: >"$sweep"
for seed in ${SEEDS:-$(tr ' ' '\n' <<<"${PLAN:-0 1}" | sed -n 's/.*=//p;/=/!p' | sort -u)}; do
  while read -r name flags; do
    [[ -z "$name" || "$name" == \#* ]] && continue
    method=${name%-s0}
    [[ -n "${METHODS:-}" && " $METHODS " != *" $method "* ]] && continue
    [[ -n "${PLAN:-}" && " $PLAN " != *" $method=$seed "* ]] && continue
    echo "$method-s$seed $flags --seed $seed --rollout-seed $seed --eval-images-per-category 128 --eval-interval 10 \
--checkpoint-interval 100000 --micro-batch-size ${MICRO_BATCH:-128} --reward-workers ${REWARD_WORKERS:-2}" >>"$sweep"
  done < <(cat ${SETTINGS:-scripts/device/sweeps/algorithms.txt})
done
cat "$sweep"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
SWEEP=$sweep MINUTES=${MINUTES:-6} THREADS=${THREADS:-1} KEEP_CHECKPOINT=0 bash scripts/device/sweep_shapes.sh
PYTHONPATH=/tmp/site:$PWD python3 benchmarks/algorithm_bench.py "$OUT/bench" /tmp/sweep/*/ && cat "$OUT/bench/algorithms.md"
