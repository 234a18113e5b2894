#!/usr/bin/env bash
# Pretrain the editing world's demo model (`diffrl pretrain --world shapes-edit`, docs/editing-world.md) from the
# shipped text-to-image demo model on the lent GPU, and bring back its logs, each kept checkpoint's held-out strict
# edit accuracy (the `--world shapes-edit` task's evaluation: diffrl/evaluation/shapes_edit.py) and checkpoints.
# Run through the device tool with ".whl" carried (scripts/device/fetch_wheels.sh; diffusers 0.42.1, tyro, scipy is
# in the image).
#   MINUTES   wall-clock training budget (default 6.5)
#   INIT      the model it starts from (default diffrl/assets/demo-shapes, the shipped text-to-image model; its
#             reference-mode blocks start as copies of its image mode's, its tokenizer gains the edit verbs)
#   EXTRA     extra flags for `diffrl pretrain` (default: batch 256, lr 1e-3, warm-up 300, compiled, a checkpoint
#             every 500 steps, 14 render workers)
#   SCALES    CFG scales of the checkpoint evaluations (default "1 3")
#   PER_KIND  held-out edits per edit kind in each evaluation, one image each (default 64: 256 images)
#   PICK      instead of four checkpoints, bring back the one whose CFG-1 held-out strict accuracy is closest to
#             PICK (a base that is good but imperfect, e.g. 0.55: RL has work to do), as model.tar split in
#             15 MiB parts: `cat NAME-step-N.model.tar.part-* | tar -x`
#   NAME      prefix of the run folder and of every returned file (default pretrain-edit)
set -euo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
name=${NAME:-pretrain-edit}
run=/tmp/$name-run
rm -rf "$run"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
extra=${EXTRA:---compile --batch-size 256 --lr 1e-3 --steps 1000000 --warmup-steps 300 --checkpoint-every 500 --log-every 200 --num-workers 14}
python3 -m diffrl.cli.main pretrain --world shapes-edit --init-from "${INIT:-diffrl/assets/demo-shapes}" \
  --output-dir "$run" --max-minutes "${MINUTES:-6.5}" $extra \
  2>&1 | tr '\r' '\n' | grep -v '^pretrain: ' | grep -v 'Writing model shards' > "$OUT/$name.log" || { tail -30 "$OUT/$name.log"; exit 1; }
tail -3 "$OUT/$name.log"
# Every kept checkpoint on PER_KIND held-out edits of each kind at each CFG scale: one JSON line per (checkpoint,
# scale) with eval/strict, eval/strict/<kind> and eval/score.
: > "$run/evals.jsonl"
for ckpt in "$run"/checkpoints/step-*; do
  python3 -m diffrl.evaluation.shapes_edit --model-path "$ckpt/model" --guidance-scale ${SCALES:-1 3} \
    --per-kind "${PER_KIND:-64}" --num-steps 10 --output-dir "$run/evals/$(basename "$ckpt")" \
    | python3 -c "import json, sys
for line in sys.stdin:
    print(json.dumps({'checkpoint': sys.argv[1], **json.loads(line)}))" "$(basename "$ckpt")" | tee -a "$run/evals.jsonl"
done
# The evaluations' grids (each output after its source), not their images.
mkdir -p "$run/eval-grids"
for grid in "$run"/evals/*/cfg*/rollout-00000/grid.png; do
  scale_dir=$(dirname "$(dirname "$grid")")
  cp "$grid" "$run/eval-grids/$(basename "$(dirname "$scale_dir")")-$(basename "$scale_dir").png"
done
tar -C "$run" -cf "$OUT/$name-logs.tar" config.json metrics.jsonl evals.jsonl eval-grids $(cd "$run" && ls -d samples/*.png)
bash scripts/device/bring_back_checkpoints.sh "$run" "$name" "$run/evals.jsonl" eval/strict "held-out strict edit accuracy"
