#!/usr/bin/env bash
# Issue 6 on a 2-GPU machine (kind nvidia-h200-x2; carry `.whl`), in one call or two (STAGES):
# 1. rollout throughput of 1 vs 2 engine servers, one per GPU (benchmarks/http_engines.py), for an
#    NFT rollout (ODE, final image only) and a Flow-GRPO rollout (SDE steps, trajectories back);
# 2. the same DiffusionNFT recipe for the same number of rollouts on one GPU, then data-parallel on
#    two (torchrun, NCCL, FSDP2, one in-process engine per rank): reward curves and rollout seconds.
# Ray is not on that machine's image and its wheel is over the carry limit, so placement there is torchrun.
set -uo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
rollouts=${ROLLOUTS:-40}
# What BENCHMARKS.md measured (session 4); the recipe has since moved to adaptive category sampling.
train_flags=${TRAIN_FLAGS:-"--category-sampling uniform --micro-batch-size 1152"}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# 64 groups = one batch of 512 per engine with two engines; 256 groups = four per engine. With 32
# requests (512 images) in flight per engine, an engine idles while it sends a batch and the client
# refills it; 64 in flight keep a second batch queued behind the one denoising.
# STAGES picks the parts (one call may not hold both); ENGINE_RUNS the kind,groups,in-flight triples.
stages=${STAGES:-"engines train"}
engine_runs=${ENGINE_RUNS:-"nft,256,32 nft,256,64 grpo,256,64 nft,64,32"}
[[ " $stages " == *" engines "* ]] || engine_runs=""
for run in $engine_runs; do
  IFS=, read -r kind groups inflight <<<"$run"; set -- "$kind" "$groups" "$inflight"
  (cd benchmarks && timeout 150 python3 http_engines.py --engines 1 2 --device cuda --kind $1 --groups $2 \
     --n 16 --m 16 --concurrency $3 --out "$OUT/http_engines_$1_$2_c$3.json" 2>&1 | grep -E "engine\(s\)|Error") \
     | sed "s/^/$1 $2 groups, $3 in flight: /" | tee -a "$OUT/summary.txt"
done
run_two() {
  timeout 300 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m diffrl.cli.main train \
    --recipe shapes-nft-gpu --device cuda --num-rollout "$rollouts" --time-budget-minutes 4 $train_flags --output-dir /tmp/mg/two-gpus \
    >/tmp/mg-two.log 2>&1; echo "two GPUs exit $?"
}
run_one() {
  timeout 330 python3 -m diffrl.cli.main train --recipe shapes-nft-gpu --device cuda --num-rollout "$rollouts" \
    --time-budget-minutes 4.5 $train_flags --output-dir /tmp/mg/one-gpu >/tmp/mg-one.log 2>&1; echo "one GPU exit $?"
}
[[ " $stages " == *" train "* ]] || exit 0
mkdir -p /tmp/mg
run_two; run_one  # the untried NCCL path first, so a failure shows early in the log
cp /tmp/mg-one.log /tmp/mg/one-gpu/train.log; cp /tmp/mg-two.log /tmp/mg/two-gpus/train.log
python3 scripts/summarize_runs.py /tmp/mg/*/ | tee -a "$OUT/summary.txt"
python3 - <<'PY' | tee -a "$OUT/summary.txt"
import json, statistics as st
for run in ("one-gpu", "two-gpus"):
    rs = [json.loads(l) for l in open(f"/tmp/mg/{run}/metrics.jsonl") if "rollout/seconds" in l]
    print(run, "rollouts", len(rs), "median s per rollout of 512 images", round(st.median(r["rollout/seconds"] for r in rs), 3),
          "train s", round(st.median(r["train/seconds"] for r in rs), 3))
PY
for run in one-gpu two-gpus; do
  (cd /tmp/mg && tar czf "$OUT/$run.tgz" "$run"/metrics.jsonl "$run"/config.json "$run"/reward_curve.png "$run"/train.log)
done
tail -5 /tmp/mg-two.log
