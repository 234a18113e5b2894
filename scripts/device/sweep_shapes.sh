#!/usr/bin/env bash
# Several training runs at once on one GPU (the demo model is small and launch-bound, so runs share
# the GPU well). Usage on the device (carry `.whl`): SWEEP=scripts/device/sweeps/NAME.txt MINUTES=7 [FINAL_EVAL=128] [RUNS="a b"] bash $0
# RUNS (optional) picks sweep lines by name, so a sweep written for four GPUs can run two at a time.
# Each sweep line is `name  flags…`; every run gets --time-budget-minutes $MINUTES and its own folder.
# Sweep files pin the recipe values changed since they ran; code changes (e.g. the verifier) are in git.
# On a machine with several GPUs the runs are dealt round-robin over them (run i on GPU i mod count);
# GPUS="1" (indices) keeps the sweep to those GPUs, e.g. when another job holds GPU 0.
set -uo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2}
root=/tmp/sweep; mkdir -p "$root"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
read -ra gpu_ids <<<"${GPUS:-$(nvidia-smi --query-gpu=index --format=csv,noheader | tr '\n' ' ')}"
gpus=${#gpu_ids[@]}; i=0
limit_s=$(awk -v m="${MINUTES:-7}" 'BEGIN { printf "%d", m * 60 + 150 }')  # MINUTES may be fractional
while read -r name flags; do
  [[ -z "$name" || "$name" == \#* ]] && continue
  [[ -n "${RUNS:-}" && " $RUNS " != *" $name "* ]] && continue
  gpu=${gpu_ids[$(( i++ % gpus ))]}
  ( CUDA_VISIBLE_DEVICES=$gpu timeout "$limit_s" python3 -m diffrl.cli.main train $flags \
      --time-budget-minutes "${MINUTES:-7}" --output-dir "$root/$name" >"$root/$name.log" 2>&1
    echo "$name (GPU $gpu) exit $?" ) &
done <"${SWEEP:?set SWEEP to a sweep file}"
wait
nvidia-smi --query-gpu=memory.used --format=csv,noheader
for log in "$root"/*.log; do  # a run that died before making its folder (an import error, a bad flag)
  [[ -e "$log" && ! -d "${log%.log}" ]] && { echo "== $(basename "${log%.log}") failed:"; tail -5 "$log"; }
done
for run in "$root"/*/; do
  name=$(basename "$run")
  echo "== $name"; grep -E "^reward:|^held-out|Error|error" "$root/$name.log" | tail -4
  cp "$root/$name.log" "$run/train.log"
done
python3 scripts/summarize_runs.py "$root"/*/  # the summary is re-made from the metrics (summarize_runs.py)
# FINAL_EVAL=N: each run's last checkpoint and checkpoints/best on N held-out images per category (the
# trainer's seeds 10 000 + k, its evaluation CFG and steps), one run per GPU at a time; reports, and every image
# with its prompt, seed and verdict (--save-images, re-scorable offline), in the archives.
if [[ -n "${FINAL_EVAL:-}" ]]; then
  i=0
  for run in "$root"/*/; do
    gpu=${gpu_ids[$(( i++ % gpus ))]}
    read -r guidance steps < <(python3 -c "import json, sys; c = json.load(open(sys.argv[1])); c = c.get('flags', c)  # config.json: {tree, flags, …} (flat before)
print(c['eval_guidance_scale'] or c['diffusion_guidance_scale'], c['eval_num_steps'] or c['diffusion_num_steps'])" "$run/config.json")
    ( for ckpt in $(ls -d "$run"checkpoints/rollout-* 2>/dev/null | sort | tail -1) "$run"checkpoints/best; do
        [[ -d "$ckpt" ]] || continue
        out="$run/eval$FINAL_EVAL-$(basename "$ckpt")"
        CUDA_VISIBLE_DEVICES=$gpu python3 -m diffrl.cli.main evaluate --checkpoint "$ckpt" --images-per-category "$FINAL_EVAL" \
          --seed 10000 --guidance-scale "$guidance" --num-steps "$steps" --device cuda --output-dir "$out" --save-images >"$out.log" 2>&1
      done ) &
    (( i % gpus == 0 )) && wait
  done
  wait
  grep -H "^overall" "$root"/*/eval"$FINAL_EVAL"-*.log
fi
# One archive per run (the device returns at most 8 files of 16 MiB, 64 MiB in all, and one
# checkpoint is ~11 MiB): metrics, log, config, the first and last eval grids, the FINAL_EVAL reports
# with their images and records,
# and one checkpoint without its optimizer state (text encoder kept, 1 MiB: without it the checkpoint
# silently borrows whatever base `--model-path` names when evaluated, e.g. a newer shipped model): checkpoints/best when
# the run validates (--val-images-per-category), else its last one.
for run in "$root"/*/; do
  name=$(basename "$run")
  ckpt=$(cd "$root" && ls -d "$name"/checkpoints/rollout-* 2>/dev/null | sort | tail -1)
  [[ -d "$run/checkpoints/best" ]] && ckpt="$name/checkpoints/best"
  [[ "${KEEP_CHECKPOINT:-1}" == 0 ]] && ckpt=""  # KEEP_CHECKPOINT=0: metrics, logs and grids only
  grids=$(cd "$root" && ls "$name"/eval/*.png 2>/dev/null | sort | sed -n '1p;$p' | sort -u)
  (cd "$root" && tar czf "$OUT/$name.tgz" --exclude=train_state.pt \
     "$name"/metrics.jsonl "$name"/config.json "$name"/reward_curve.png "$name"/train.log $grids ${ckpt:+"$ckpt"} \
     $(ls -d "$name"/eval*-*/{report.json,records.jsonl,images} 2>/dev/null))
  # A larger model's archive passes 16 MiB: split it (here: cat NAME.tgz.part-* | tar xz).
  if (( $(stat -c %s "$OUT/$name.tgz") > 15 * 2**20 )); then
    split -b 15M "$OUT/$name.tgz" "$OUT/$name.tgz.part-" && rm "$OUT/$name.tgz"
  fi
done
ls -la "$OUT"
