#!/usr/bin/env bash
# Colocation under memory pressure on one GPU (carry `.whl`): a full finetune of SD3.5-Medium at its real size
# (random weights built in code, as bench_recipes.sh builds them) with Flow-GRPO's sampling settings
# (`--recipe sd3-grpo`, 512², 10 steps, CFG 4.5, 9 trained steps per sample), micro-batches of MB (default 40)
# pairs, gradient checkpointing, a bf16 forward, the CPU reward jpeg_compressibility, 2 prompt groups × 16.
# MODES (default "colocated embedded"): colocated = --colocate --engine-sleep-level 2 --offload-optimizer (the
# engine in its own process), embedded = the engine in the trainer's process. nvidia-smi samples every process's
# device memory every 200 ms, so the trainer's and the engine's peaks are measured apart (a process's peak
# includes what its allocator keeps cached); summary.txt says whether the trainer's peak plus the awake engine's
# passes the card, and the device's own peak. CARD_GIB (default 79.6, an H100 80GB's usable memory): on a larger card
# a ballast process holds the rest, so the run has an 80 GB card's memory whichever card comes; it is left out of
# the per-process peaks. Results in $OUT: pressure_<mode>.json (benchmarks/recipe_runs.py),
# (per rollout: engine_released_gib, what the engine's sleep gave the device), apps_<mode>.csv and device_<mode>.csv (the samples), summary.txt.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
ckpt=$PWD/runs/sd3-random  # the name bench_recipes.sh uses: a warm machine keeps it between calls
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/summary.txt"
quiet() { tr '\r' '\n' | grep -v "Loading\|float32\|torchvision\|^ *$\|Writing model\|^train " ; }
[[ -d $ckpt ]] || (cd benchmarks && python3 -c "
import sys, torch; from pathlib import Path; from family_rollout import make_checkpoint
make_checkpoint('sd3', Path(sys.argv[1]), torch.device('cuda'))" "$ckpt")
stop_ballast() { pkill -f ballast_ready; rm -f /tmp/ballast_ready; sleep 1; }  # matches the ballast's own code
stop_ballast; trap stop_ballast EXIT; trap 'exit 143' TERM INT
ballast=
if python3 -c "import torch, sys; sys.exit(torch.cuda.mem_get_info()[1] / 2**30 <= ${CARD_GIB:-79.6} + 0.5)"; then
  python3 -c "
import time, torch
free, total = torch.cuda.mem_get_info()
keep = int(${CARD_GIB:-79.6} * 2**30) - (total - free)  # what others (none) and this context already hold count too
x = torch.empty(free - keep, dtype=torch.uint8, device='cuda')
print(f'ballast holds {x.numel() / 2**30:.2f} GiB of {total / 2**30:.2f}: {${CARD_GIB:-79.6}} GiB left to the run', flush=True)
open('/tmp/ballast_ready', 'w').close()
time.sleep(1e6)" >/tmp/ballast.txt 2>&1 &
  ballast=$!
  for _ in $(seq 60); do [[ -e /tmp/ballast_ready ]] && break; sleep 1; done
  cat /tmp/ballast.txt | tee -a "$OUT/summary.txt"
  ballast=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader | head -1)  # the only process yet, as nvidia-smi names it
fi
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
  python3 - "$OUT/apps_$mode.csv" "$mode" "$OUT/device_$mode.csv" "$ballast" <<'PY' | tee -a "$OUT/summary.txt"
import collections, subprocess, sys
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit() and parts[0] != sys.argv[4]:  # the ballast is not the run's
        peak[parts[0]] = max(peak[parts[0]], int(parts[1]))
card = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout.split()[0])
ballast = max((int(p[1]) for p in (l.split(",") for l in open(sys.argv[1])) if len(p) == 2 and p[0].strip() == sys.argv[4]
               and p[1].strip().isdigit()), default=0)
card -= ballast  # what the run had
gib = lambda mib: mib / 1024
print(f"{sys.argv[2]}: per-process device peak (GiB, nvidia-smi, pid: peak):",
      {pid: round(gib(v), 2) for pid, v in peak.items()}, f"sum of peaks {gib(sum(peak.values())):.2f} GiB,"
      f" card {gib(card):.2f} GiB: the sum {'passes' if sum(peak.values()) > card else 'fits'} the card;",
      f"the device's own peak {gib(max(int(v) for v in open(sys.argv[3]).read().split() if v.isdigit()) - ballast):.2f} GiB")
PY
done
echo "== done $(date +%T)"
