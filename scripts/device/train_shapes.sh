#!/usr/bin/env bash
# A time-boxed training run on the lent GPU (carry `.whl`). RECIPE, ROLLOUTS, SECONDS_LIMIT, EXTRA.
set -uo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
run=/tmp/train-run
timeout "${SECONDS_LIMIT:-300}" python3 -m diffrl.cli.main train --recipe "${RECIPE:-shapes-grpo-gpu}" \
  --num-rollout "${ROLLOUTS:-20}" --output-dir "$run" ${EXTRA:-} 2>&1 | tr '\r' '\n' | grep -v "^train\|Loading\|Writing" | tail -20
python3 - "$run" <<'PY'
import json, sys
sys.path.insert(0, ".")
from diffrl.train.metrics import MetricsLogger
from diffrl.train.trainer import run_summary
from pathlib import Path
run = Path(sys.argv[1])
records = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
for r in records:
    print(r["rollout"], {k: round(v, 3) for k, v in r.items() if k in (
        "rollout/reward/raw_mean", "eval/strict", "train/log_prob_mean_abs_diff", "rollout/seconds", "train/seconds")})
print(run_summary(records))
MetricsLogger(run).plot_curves()
PY
cp "$run/metrics.jsonl" "$run/config.json" "$run/reward_curve.png" "$OUT/" 2>/dev/null
last=$(ls "$run"/eval/*.png | sort | tail -1); first=$(ls "$run"/eval/*.png | sort | head -1)
cp "$first" "$OUT/eval_first.png"; cp "$last" "$OUT/eval_last.png"
