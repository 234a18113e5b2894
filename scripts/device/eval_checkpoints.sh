#!/usr/bin/env bash
# Held-out evaluations of carried checkpoints on the GPU (carry `.whl` and the checkpoints, e.g. under
# runs/carry/). Usage on the device: EVALS=scripts/device/evals/NAME.txt bash $0
# Each line is `label  diffrl-evaluate-flags…`; the evaluations are dealt round-robin over the GPUs and
# each writes report.json and records.jsonl under $OUT/evals.tgz (one archive: the device returns few files).
set -uo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
root=/tmp/evals; mkdir -p "$root"
gpus=$(nvidia-smi --list-gpus | wc -l); i=0
while read -r label flags; do
  [[ -z "$label" || "$label" == \#* ]] && continue
  gpu=$(( i++ % gpus ))
  ( CUDA_VISIBLE_DEVICES=$gpu python3 -m diffrl.cli.main evaluate $flags --device cuda --output-dir "$root/$label" \
      >"$root/$label.log" 2>&1; echo "$label (GPU $gpu) exit $?" ) &
  (( i % gpus == 0 )) && wait  # one evaluation per GPU at a time
done <"${EVALS:?set EVALS to an evaluation list}"
wait
python3 - "$root" <<'PY' | tee "$root/summary.txt"
import json, pathlib, sys
for report in sorted(pathlib.Path(sys.argv[1]).glob("*/report.json")):
    r = json.loads(report.read_text())
    cats = " ".join(f"{c[:8]} {v['strict']:.3f}" for c, v in r["categories"].items())
    print(f"{report.parent.name:32s} strict {r['overall_strict']:.3f}  {cats}")
PY
(cd "$root" && tar czf "$OUT/evals.tgz" */report.json */records.jsonl summary.txt *.log)
