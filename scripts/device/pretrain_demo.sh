#!/usr/bin/env bash
# Pretrain the demo model on the lent H200 and bring back its checkpoints (run through the device tool,
# with `.whl` carried: diffusers 0.42.1, tyro and its two dependencies as cp312 wheels).
#   MINUTES   wall-clock training budget (default 6.5)
#   EXTRA     extra flags for `diffrl pretrain`
#   SCALES    CFG scales of the checkpoint evaluations (default "1 2 3 4.5")
#   PICK      instead of four checkpoints, bring back the one whose CFG-1 held-out accuracy is closest
#             to PICK (a base matched to the shipped model's, e.g. 0.55), as model.tar split in 15 MiB
#             parts (the device returns files of at most 16 MiB): `cat NAME-step-N.model.tar.part-* | tar -x`
#   NAME      prefix of the run folder and of every returned file (default pretrain), so two pretraining
#             jobs can share one call (one per GPU, CUDA_VISIBLE_DEVICES set by the caller)
set -euo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
name=${NAME:-pretrain}
run=/tmp/$name-run
rm -rf "$run"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m diffrl.cli.main pretrain --output-dir "$run" --max-minutes "${MINUTES:-6.5}" ${EXTRA:-} \
  2>&1 | tr '\r' '\n' | grep -v '^pretrain: ' | grep -v 'Writing model shards' > "$OUT/$name.log" || { tail -30 "$OUT/$name.log"; exit 1; }
tail -3 "$OUT/$name.log"
python3 scripts/eval_checkpoints.py "$run" --guidance-scales ${SCALES:-1 2 3 4.5} --out "$run/evals.json"
# Bring back logs and evals in one archive, and up to 4 checkpoints (evenly spaced, the last included).
tar -C "$run" -cf "$OUT/$name-logs.tar" config.json metrics.jsonl samples evals.json
bash scripts/device/bring_back_checkpoints.sh "$run" "$name" "$run/evals.json" overall_strict "held-out accuracy"
