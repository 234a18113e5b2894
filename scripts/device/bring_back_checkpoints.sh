#!/usr/bin/env bash
# The tail of every pretrain_*.sh: bring a pretraining run's checkpoints back through $OUT.
# Usage: bring_back_checkpoints.sh RUN_DIR NAME EVALS METRIC WHAT
#   EVALS: the run's per-checkpoint evaluations (a JSON list or JSON lines, each with checkpoint, guidance_scale and
#   METRIC); WHAT names METRIC in the log line. With PICK set, only the checkpoint whose CFG-1 METRIC is closest to
#   PICK comes back, as $OUT/NAME-<step>.model.tar.part-* (15 MB parts); otherwise four checkpoints spread over the
#   run (the last one included) as $OUT/NAME-<step>.tar.
set -uo pipefail
run=$1 name=$2 evals=$3 metric=$4 what=$5
if [[ -n "${PICK:-}" ]]; then
  pick=$(basename "$(python3 "$(dirname "$0")/pick_checkpoint.py" "$metric" "$PICK" "$evals")")
  echo "picked $pick (CFG-1 $what closest to $PICK)"
  tar -C "$run/checkpoints/$pick" -cf - model | split -b 15M - "$OUT/$name-$pick.model.tar.part-"
else
  mapfile -t ckpts < <(ls -d "$run"/checkpoints/step-* | sort)
  n=${#ckpts[@]}
  for k in 1 2 3 4; do
    i=$(( (n * k + 3) / 4 - 1 )); [ "$i" -ge 0 ] || continue
    ckpt_name=$(basename "${ckpts[$i]}")
    [ -f "$OUT/$name-$ckpt_name.tar" ] || tar -C "${ckpts[$i]}" -cf "$OUT/$name-$ckpt_name.tar" model
  done
fi
ls -la "$OUT"
