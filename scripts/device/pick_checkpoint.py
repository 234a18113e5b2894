"""The kept checkpoint whose CFG-1 score is closest to a target, among one or more pretraining runs' evaluations
(each file a JSON list or JSON lines of {checkpoint, guidance_scale, METRIC}, in the run folder beside its
checkpoints/). Prints the checkpoint's folder; --record FILE writes the chosen row and every candidate.

    python3 scripts/device/pick_checkpoint.py ocr 0.5 /tmp/a-run/evals.jsonl /tmp/b-run/evals.jsonl
"""

import argparse
import json
from pathlib import Path

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("metric")
parser.add_argument("target", type=float)
parser.add_argument("evals", type=Path, nargs="+")
parser.add_argument("--record", type=Path)
args = parser.parse_args()
rows = []
for evals in args.evals:
    text = evals.read_text()
    found = json.loads(text) if text.lstrip().startswith("[") else [json.loads(l) for l in text.splitlines() if l.strip()]
    rows += [{**r, "run": str(evals.parent)} for r in found if r["guidance_scale"] == 1.0]
if not rows:
    raise SystemExit(f"no CFG-1 evaluation in {', '.join(map(str, args.evals))}")
best = min(rows, key=lambda r: abs(r[args.metric] - args.target))
if args.record:
    args.record.write_text(json.dumps({**best, "candidates": rows}) + "\n")
print(Path(best["run"]) / "checkpoints" / best["checkpoint"])
