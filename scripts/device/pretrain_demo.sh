#!/usr/bin/env bash
# Pretrain the demo model on the lent H200 and bring back its checkpoints (run through the device tool,
# with `.whl` carried: diffusers 0.42.1, tyro and its two dependencies as cp312 wheels).
#   MINUTES   wall-clock training budget (default 6.5)
#   EXTRA     extra flags for `diffrl pretrain`
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
run=/tmp/pretrain-run
rm -rf "$run"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m diffrl.cli.main pretrain --output-dir "$run" --max-minutes "${MINUTES:-6.5}" ${EXTRA:-} \
  2>&1 | tr '\r' '\n' | grep -v '^pretrain: ' | grep -v 'Writing model shards' > "$OUT/pretrain.log" || { tail -30 "$OUT/pretrain.log"; exit 1; }
tail -3 "$OUT/pretrain.log"
python3 scripts/eval_checkpoints.py "$run" --guidance-scales 1 2 3 4.5 --out "$run/evals.json"
# Bring back logs and evals in one archive, and up to 4 checkpoints (evenly spaced, the last included).
tar -C "$run" -cf "$OUT/logs.tar" config.json metrics.jsonl samples evals.json
mapfile -t ckpts < <(ls -d "$run"/checkpoints/step-* | sort)
n=${#ckpts[@]}
for k in 1 2 3 4; do
  i=$(( (n * k + 3) / 4 - 1 )); [ "$i" -ge 0 ] || continue
  name=$(basename "${ckpts[$i]}")
  [ -f "$OUT/$name.tar" ] || tar -C "${ckpts[$i]}" -cf "$OUT/$name.tar" model
done
ls -la "$OUT"
