#!/usr/bin/env bash
# Deterministic mode on the lent H200 (carry `.whl`): benchmarks/determinism.py runs each job's training
# command twice with --deterministic-mode (compared bit for bit: metrics.jsonl without its wall-clock fields,
# every tensor of the final checkpoint) and once without (the cost: seconds per rollout, deterministic over
# plain, rollouts 2..N). JOBS="demo sd35m" by default (about 3 and 5 minutes; one call can run either alone):
#   demo   `--recipe shapes-nft-gpu` on the shipped demo model, ROLLOUTS rollouts; held-out and validation
#          sets cut to 16 images per category (the recipe's: 64) to keep the evaluations short
#   sd35m  `--recipe sd3-grpo` on SD3.5-Medium at its real size (random weights built in code, as
#          bench_sd35m.sh builds runs/sd35m-random), jpeg_compressibility in 4 worker processes; the rollout
#          cut to 1 prompt × SAMPLES samples (default 8; the recipe's: 4 × 16) to fit the time
# ROLLOUTS (default 5). Results land in $OUT: determinism_{demo,sd35m}.json, summary.txt (the table), and the
# tail of each run's log (3 per job). Both jobs make 9 files, one more than a call brings back: pack_out.sh then
# puts all but summary.txt into $OUT/results.tgz.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
ckpt=$PWD/runs/sd35m-random  # runs/ is git-ignored: kept on a warm machine between calls
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
rollouts=${ROLLOUTS:-5}
for job in ${JOBS:-demo sd35m}; do
  echo "== $job $(date +%T)"
  case $job in
    demo)
      python3 benchmarks/determinism.py --name demo --work-dir runs/determinism --out "$OUT/determinism_demo.json" \
        -- --recipe shapes-nft-gpu --num-rollout "$rollouts" --checkpoint-interval 1000 \
        --eval-images-per-category 16 --val-images-per-category 16 ;;
    sd35m)
      [[ -d $ckpt ]] || (cd benchmarks && python3 -c "
import sys, torch; from pathlib import Path; from family_rollout import make_checkpoint
make_checkpoint('sd3', Path(sys.argv[1]), torch.device('cuda'))" "$ckpt")
      samples=${SAMPLES:-8}
      python3 benchmarks/determinism.py --name sd35m --work-dir runs/determinism --out "$OUT/determinism_sd35m.json" \
        -- --recipe sd3-grpo --model-path "$ckpt" --diffusion-model-family sd3 --num-rollout "$rollouts" \
        --reward jpeg_compressibility --reward-workers 4 --rollout-batch-size 1 --n-samples-per-prompt "$samples" \
        --rollout-microgroup-size "$samples" --global-batch-size "$samples" --checkpoint-interval 1000 ;;
  esac
  for log in runs/determinism/"$job"-*.log; do tail -n 40 "$log" > "$OUT/$(basename "$log")"; done
done
python3 benchmarks/determinism.py --table "$OUT"/determinism_*.json | tee "$OUT/summary.txt"
echo "== done $(date +%T)"
bash scripts/device/pack_out.sh
