#!/usr/bin/env bash
# The bf16 forward on the GPU (engine and trainer share it): a few rollouts of the shapes-nft-gpu
# recipe in fp32 + TF32 (the recipe) and in bf16, rollout and train seconds side by side.
set -uo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
for precision in no bf16; do
  timeout 100 python3 -m diffrl.cli.main train --recipe shapes-nft-gpu --device cuda --mixed-precision $precision --category-sampling uniform --micro-batch-size 256 \
    --num-rollout ${ROLLOUTS:-6} --eval-interval 100 --eval-images-per-category 8 --checkpoint-interval 100 \
    --output-dir /tmp/bf16/$precision >/tmp/bf16-$precision.log 2>&1; echo "$precision exit $?"
  cp /tmp/bf16/$precision/metrics.jsonl "$OUT/metrics-$precision.jsonl" 2>/dev/null
  python3 - "$precision" <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics as st, sys
rs = [json.loads(l) for l in open(f"/tmp/bf16/{sys.argv[1]}/metrics.jsonl") if "rollout/seconds" in l][1:]  # first: warm-up
print(sys.argv[1], "rollouts", len(rs), "rollout s", round(st.median(r["rollout/seconds"] for r in rs), 3),
      "train s", round(st.median(r["train/seconds"] for r in rs), 3), "peak GiB", round(max(r["memory/peak_gib"] for r in rs), 2),
      "reward", [round(r["rollout/reward/raw_mean"], 3) for r in rs])
PY
done
tail -3 /tmp/bf16-bf16.log
