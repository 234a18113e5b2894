#!/usr/bin/env bash
# Issue 6 on a 2-GPU machine (kind nvidia-h200-x2; carry `.whl`): the same DiffusionNFT recipe on one
# GPU, then data-parallel on two (torchrun, NCCL, FSDP2, one in-process engine per GPU), each with
# the same time budget. Compare reward curves and rollout throughput (rollout/images_per_s is per
# rank; two ranks roll out the same 512 images per rollout in parallel, so compare rollout/seconds).
# Ray is not on that machine's image and its wheel is over the carry limit, so placement there is torchrun.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
minutes=${MINUTES:-4}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout $(( minutes * 60 + 90 )) python3 -m diffrl.cli.main train --recipe shapes-nft-gpu --device cuda \
  --time-budget-minutes "$minutes" --output-dir /tmp/mg/one-gpu >/tmp/mg-one.log 2>&1; echo "one GPU exit $?"
timeout $(( minutes * 60 + 120 )) python3 -m torch.distributed.run --nproc-per-node 2 -m diffrl.cli.main train \
  --recipe shapes-nft-gpu --device cuda --time-budget-minutes "$minutes" --output-dir /tmp/mg/two-gpus \
  >/tmp/mg-two.log 2>&1; echo "two GPUs exit $?"
cp /tmp/mg-one.log /tmp/mg/one-gpu/train.log; cp /tmp/mg-two.log /tmp/mg/two-gpus/train.log
python3 scripts/summarize_runs.py /tmp/mg/*/ | tee "$OUT/summary.txt"
python3 - <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics as st
for run in ("one-gpu", "two-gpus"):
    rs = [json.loads(l) for l in open(f"/tmp/mg/{run}/metrics.jsonl") if "rollout/seconds" in l]
    print(run, "median rollout s per 512 images", round(st.median(r["rollout/seconds"] for r in rs), 3),
          "train s", round(st.median(r["train/seconds"] for r in rs), 3))
PY
for run in one-gpu two-gpus; do
  (cd /tmp/mg && tar czf "$OUT/$run.tgz" "$run"/metrics.jsonl "$run"/config.json "$run"/reward_curve.png "$run"/train.log)
done
tail -5 /tmp/mg-two.log
