#!/usr/bin/env bash
# The colocated engine on the lent H200 (carry `.whl`). Two jobs, JOBS="sync train" by default:
#   sync   benchmarks/weight_sync.py on SD3.5-Medium at its real size (random weights built in code, as
#          bench_sd35m.sh builds them): seconds per sync and peak extra GPU memory, CUDA IPC buckets
#          (--update-weight-buffer-size 128 and 512 MiB) against the HTTP push, for a LoRA r32 adapter
#          and for the full fp32 weights; what sleep levels 1 and 2 free, and whether the engine samples
#          the same after waking; what optimizer offload frees. The benchmark exits 1 when a sleep gave the
#          device less free memory than it should (level 2: less than the weights it moved to the host; either
#          level: less than the cache the engine could release); this script then says so and exits 1.
#   train  `diffrl train --recipe shapes-grpo-gpu` for ROLLOUTS (default 3) rollouts, embedded and
#          --colocate --engine-sleep-level 2 --offload-optimizer: rewards, log-prob gap, seconds and the
#          trainer's peak memory side by side.
# Results land in $OUT: weight_sync_sd35m.json, train_{embedded,colocated}.jsonl, summary.txt.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
ckpt=$PWD/runs/sd35m-random  # runs/ is git-ignored: kept on a warm machine between calls
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|^train \|torchvision\|Writing\|^ *$" ; }
for job in ${JOBS:-sync train}; do
  echo "== $job $(date +%T)"
  case $job in
    sync)
      [[ -d $ckpt ]] || (cd benchmarks && python3 -c "
import sys, torch; from pathlib import Path; from family_rollout import make_checkpoint
make_checkpoint('sd3', Path(sys.argv[1]), torch.device('cuda'))" "$ckpt")
      (cd benchmarks && python3 weight_sync.py --checkpoint "$ckpt" --family sd3 --lora-rank 32 \
        --buffer-mib 128 512 --repeats "${REPEATS:-3}" --resolution 512 --n 4 --steps 4 \
        --out "$OUT/weight_sync_sd35m.json") 2>&1 | quiet | grep -v '^ \|^[{}]' | tee -a "$OUT/summary.txt"
      status=${PIPESTATUS[0]}
      if (( status != 0 )); then
        echo "FAILED: benchmarks/weight_sync.py exited $status (see the FAIL lines above)" | tee -a "$OUT/summary.txt"
        failed=1
      fi ;;
    train)
      for mode in embedded colocated; do
        flags=(); [[ $mode == colocated ]] && flags=(--colocate --engine-sleep-level 2 --offload-optimizer)
        run=runs/colocate-$mode; rm -rf "$run"
        python3 -m diffrl.cli.main train --recipe shapes-grpo-gpu --num-rollout "${ROLLOUTS:-3}" \
          --eval-images-per-category 0 --checkpoint-interval 1000 --output-dir "$run" "${flags[@]}" 2>&1 | quiet | tail -5
        cp "$run/metrics.jsonl" "$OUT/train_$mode.jsonl" 2>/dev/null
      done
      python3 - "$OUT/train_embedded.jsonl" "$OUT/train_colocated.jsonl" <<'PY' | tee -a "$OUT/summary.txt"
import json, sys
keys = ("rollout/reward/raw_mean", "train/log_prob_mean_abs_diff", "train/loss", "rollout/seconds", "train/seconds",
        "memory/peak_gib")
runs = [[json.loads(line) for line in open(path)] for path in sys.argv[1:]]
for a, b in zip(*runs):
    if "rollout/reward/raw_mean" in a:
        print(a["rollout"], {k: (round(a[k], 5), round(b[k], 5)) for k in keys if k in a and k in b})
same = all(a.get("rollout/reward/raw_mean") == b.get("rollout/reward/raw_mean") for a, b in zip(*runs))
print("(embedded, colocated) per rollout; same rewards in every rollout:", same)
PY
      ;;
  esac
done
echo "== done $(date +%T)"
exit "${failed:-0}"
