#!/usr/bin/env bash
# Colocation under memory pressure on one GPU (carry `.whl`): a full finetune of SD3.5-Medium at its real size
# (random weights built in code, as bench_recipes.sh builds them) with Flow-GRPO's sampling settings
# (`--recipe sd3-grpo`, 512², 10 steps, CFG 4.5, 9 trained steps per sample), micro-batches of MB (default 40)
# pairs, gradient checkpointing, a bf16 forward, the CPU reward jpeg_compressibility, 2 prompt groups × 16.
# MODES (default "colocated embedded"): colocated = --colocate --engine-sleep-level 2 --offload-optimizer (the
# engine in its own process), embedded = the engine in the trainer's process. nvidia-smi samples every process's
# device memory every 200 ms, so the trainer's and the engine's peaks are measured apart (a process's peak
# includes what its allocator keeps cached); summary.txt says whether the trainer's peak plus the awake engine's
# passes the card, and the device's own peak. Results in $OUT: pressure_<mode>.json (benchmarks/recipe_runs.py),
# metrics_<mode>.jsonl (the run's records: memory/engine_released_gib per rollout), apps_<mode>.csv and device_<mode>.csv (the samples), summary.txt.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
ckpt=$PWD/runs/sd3-random  # the name bench_recipes.sh uses: a warm machine keeps it between calls
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|torchvision\|^ *$\|Writing model\|^train " ; }
[[ -d $ckpt ]] || (cd benchmarks && python3 -c "
import sys, torch; from pathlib import Path; from family_rollout import make_checkpoint
make_checkpoint('sd3', Path(sys.argv[1]), torch.device('cuda'))" "$ckpt")
for mode in ${MODES:-colocated embedded}; do
  flags='"use_lora":false,"gradient_checkpointing":true,"mixed_precision":"bf16","micro_batch_size":'"${MB:-40}"
  [[ $mode == colocated ]] && flags+=',"colocate":true,"engine_sleep_level":2,"offload_optimizer":true'
  echo "== $mode $(date +%T)" | tee -a "$OUT/summary.txt"
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits -lms 200 >"$OUT/apps_$mode.csv" &
  sampler=$!
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 200 >"$OUT/device_$mode.csv" &
  device_sampler=$!
  work=$PWD/runs/pressure-$mode; rm -rf "$work"
  (cd benchmarks && python3 recipe_runs.py --recipe sd3-grpo --checkpoint "$ckpt" --rollout-batch-size 2 \
    --num-rollout "${ROLLOUTS:-3}" --reward jpeg_compressibility --flags "{$flags}" --work-dir "$work" \
    --out "$OUT/pressure_$mode.json") 2>&1 | quiet | grep -v '^    \|^[{}]' | tail -6 | tee -a "$OUT/summary.txt"
  kill "$sampler" "$device_sampler"
  cp "$(ls "$work"/*/metrics.jsonl "$work"/metrics.jsonl 2>/dev/null | head -1)" "$OUT/metrics_$mode.jsonl" 2>/dev/null
  python3 - "$OUT/apps_$mode.csv" "$mode" "$OUT/device_$mode.csv" <<'PY' | tee -a "$OUT/summary.txt"
import collections, subprocess, sys
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[parts[0]] = max(peak[parts[0]], int(parts[1]))
card = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout.split()[0])
gib = lambda mib: mib / 1024
print(f"{sys.argv[2]}: per-process device peak (GiB, nvidia-smi, pid: peak):",
      {pid: round(gib(v), 2) for pid, v in peak.items()}, f"sum of peaks {gib(sum(peak.values())):.2f} GiB,"
      f" card {gib(card):.2f} GiB: the sum {'passes' if sum(peak.values()) > card else 'fits'} the card;",
      f"the device's own peak {gib(max(int(v) for v in open(sys.argv[3]).read().split() if v.isdigit())):.2f} GiB")
PY
done
echo "== done $(date +%T)"
