#!/usr/bin/env bash
# RL on the OCR world (docs/ocr-world.md) on the lent GPU, from a base picked among the checkpoints that
# pretrain_ocr.sh left on the same warm machine (so the base need not travel), several seeds side by side on one
# card. Carry [".whl", ".whl-ocr"] (the tracked tree lightened as docs/ocr-world.md says).
#   RUNS     pretraining run folders on this machine (default: /tmp/*-run holding evals.jsonl), or BASE=DIR a model
#   PICK     the base: the checkpoint whose CFG-1 held-out OCR reward is closest to PICK (default 0.5)
#   RECIPES  default ocr-nft-gpu; several run side by side, each with SEEDS (default "0 1") or its own seeds
#            after a colon, e.g. RECIPES="ocr-nft-gpu:0,1 ocr-grpo-gpu:0"
#   ROLLOUTS per run (default 40); SECONDS_LIMIT per run (default 420)
#   WORKERS  reward worker processes per run (default: the cores shared out); EXTRA more `diffrl train` flags for
#            every run, EXTRA_<recipe with _ for -> for one recipe's runs (e.g. EXTRA_ocr_grpo_gpu="--lr 3e-5")
# Back through $OUT (packed into results.tgz by pack_out.sh): each run's metrics.jsonl, config.json and first/last evaluation grids as NAME-seedS-*, the
# base's evals line (base.json) and, when picked here, the base model as base.model.tar.part-* (15 MB parts).
set -uo pipefail
bash scripts/device/install_wheels.sh > /dev/null
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TESSDATA_PREFIX=/tmp/site/share/tessdata
jobs=()  # recipe:seed
for item in ${RECIPES:-ocr-nft-gpu}; do
  seeds=${SEEDS:-0 1}; [[ $item == *:* ]] && seeds=${item#*:}
  for s in ${seeds//,/ }; do jobs+=("${item%%:*}:$s"); done
done
runs_at_once=${#jobs[@]}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ -n ${BASE:-} ]]; then
  base=$BASE; echo "{\"model\": \"$base\"}" > "$OUT/base.json"
else
  runs=${RUNS:-$(dirname $(ls /tmp/*-run/evals.jsonl))}
  evals=$(for run in $runs; do echo "$run/evals.jsonl"; done)
  base=$(python3 scripts/device/pick_checkpoint.py ocr "${PICK:-0.5}" $evals --record "$OUT/base.json")/model
fi
echo "base: $base"; cat "$OUT/base.json"
[[ -f $base/model_index.json ]] || { echo "no model at $base"; exit 1; }
[[ -n ${BASE:-} ]] || tar -C "$(dirname "$base")" -cf - "$(basename "$base")" | split -b 15M - "$OUT/base.model.tar.part-"
workers=${WORKERS:-$(( ($(nproc) - runs_at_once) / runs_at_once ))}
for job in "${jobs[@]}"; do
  recipe=${job%%:*} s=${job##*:}
  run=/tmp/ocr-rl-$recipe-seed$s; rm -rf "$run"
  own_extra=EXTRA_${recipe//-/_}
  timeout "${SECONDS_LIMIT:-420}" python3 -m diffrl.cli.main train --recipe "$recipe" --model-path "$base" \
    --seed "$s" --num-rollout "${ROLLOUTS:-40}" --reward-workers "$workers" --output-dir "$run" ${EXTRA:-} ${!own_extra:-} \
    2>&1 | tr '\r' '\n' | grep -v "^train\|Loading\|Writing\|^ *$" > "$OUT/$recipe-seed$s.log" &
done
wait
for job in "${jobs[@]}"; do
  recipe=${job%%:*} s=${job##*:}
  run=/tmp/ocr-rl-$recipe-seed$s
  cp "$run/metrics.jsonl" "$OUT/$recipe-seed$s-metrics.jsonl"; cp "$run/config.json" "$OUT/$recipe-seed$s-config.json"
  evals=($(ls -d "$run"/eval/rollout-* 2>/dev/null | sort))
  for e in "${evals[0]:-}" "${evals[-1]:-}"; do
    [[ -n $e ]] && cp "$e/grid.png" "$OUT/$recipe-seed$s-$(basename "$e").png" && cp "$e/records.jsonl" "$OUT/$recipe-seed$s-$(basename "$e").jsonl"
  done
  python3 -c "import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    if 'eval/reward' in r: print(sys.argv[2], r['rollout'], {k: round(v, 3) for k, v in r.items() if k.startswith('eval/')})" \
    "$run/metrics.jsonl" "$recipe seed$s"
done
bash scripts/device/pack_out.sh  # a call brings back at most 8 files
