#!/usr/bin/env bash
# Pretrain the OCR world's demo model (`diffrl pretrain --world ocr`: 48x256 text renders, docs/ocr-world.md) on
# the lent GPU and bring back its logs, each kept checkpoint's held-out OCR score and checkpoints. Run through the
# device tool with [".whl", ".whl-ocr"] carried (scripts/device/fetch_wheels.sh makes both; .whl-ocr holds
# RapidOCR, which scores the checkpoints; the tesseract judge is run here afterwards, on the CPU).
#   MINUTES      wall-clock training budget (default 6.5)
#   EXTRA        extra flags for `diffrl pretrain` (e.g. --glyph-grid: the grid-layout model, docs/ocr-world.md;
#                --profile-steps 5: where a step's time goes, profile.txt in the logs tar)
#   SCALES       CFG scales of the checkpoint evaluations (default "1 3")
#   EVAL_PROMPTS held-out test prompts per evaluation, one image each (default 128)
#   PICK         instead of four checkpoints, bring back the one whose CFG-1 held-out OCR reward is closest to
#                PICK (issue 46 asks for a base at 0.3-0.7, e.g. 0.5), as model.tar split in 15 MiB parts:
#                `cat NAME-step-N.model.tar.part-* | tar -x`
#   NAME         prefix of the run folder and of every returned file (default pretrain-ocr)
set -euo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TESSDATA_PREFIX=/tmp/site/share/tessdata
name=${NAME:-pretrain-ocr}
run=/tmp/$name-run
rm -rf "$run"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -m diffrl.cli.main pretrain --world ocr --output-dir "$run" --max-minutes "${MINUTES:-6.5}" ${EXTRA:-} \
  2>&1 | tr '\r' '\n' | grep -v '^pretrain: ' | grep -v 'Writing model shards' > "$OUT/$name.log" || { tail -30 "$OUT/$name.log"; exit 1; }
tail -3 "$OUT/$name.log"
# Every kept checkpoint on the first EVAL_PROMPTS test prompts at each CFG scale: one JSON line each.
: > "$run/evals.jsonl"
for ckpt in "$run"/checkpoints/step-*; do
  for g in ${SCALES:-1 3}; do
    out=$run/evals/$(basename "$ckpt")-cfg$g
    python3 -m diffrl.cli.main evaluate --model-path "$ckpt/model" --diffusion-model-family demo \
      --prompt-data diffrl/data/ocr/prompts --reward ocr --num-prompts "${EVAL_PROMPTS:-128}" --num-steps 10 \
      --guidance-scale "$g" --output-dir "$out" --no-save-images > /dev/null
    python3 -c "import json, sys; s = json.load(open(sys.argv[1])); print(json.dumps({'checkpoint': sys.argv[2], \
'guidance_scale': float(sys.argv[3]), 'ocr': s['eval/reward']}))" "$out/report.json" "$(basename "$ckpt")" "$g" \
      | tee -a "$run/evals.jsonl"
  done
done
tar -C "$run" -cf "$OUT/$name-logs.tar" config.json metrics.jsonl samples evals.jsonl $(cd "$run" && ls profile.txt 2>/dev/null)
bash scripts/device/bring_back_checkpoints.sh "$run" "$name" "$run/evals.jsonl" ocr "held-out OCR reward"
