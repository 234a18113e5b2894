"""Why held-out images fail: from a shapes `diffrl evaluate` folder's records.jsonl, the failures by kind (count,
shape, color, relation, noise), the commonest (prompt, failure) pairs, and the shape confusions
(expected → read as). Usage: failure_reasons.py FOLDER|RECORDS_JSONL [--top N]; a folder written before the one
naming scheme holds samples.jsonl instead, read the same way (as is such a file named directly)."""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

from diffrl.utils.output_files import read_records

# The verifier's shape failure: "shape: object 1 expected a red circle, found a blue square"
_SHAPE = re.compile(r"expected an? (?:\w+ )?(\w+), found an? (?:\w+ )?(\w+)$")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("records", type=Path, help="an evaluation folder, or its records.jsonl (samples.jsonl)")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    rows = (read_records(args.records) if args.records.is_dir()
            else [json.loads(line) for line in args.records.read_text().splitlines() if line.strip()])
    failures = [r for r in rows if not r["strict"]]
    print("failures by kind:", dict(collections.Counter(r["reason"].split(":")[0] for r in failures).most_common()))
    pairs = collections.Counter((r["prompt"], r["reason"]) for r in failures)
    for (prompt, reason), n in pairs.most_common(args.top):
        print(f"{n:4d}  {prompt!r}: {reason}")
    shapes = collections.Counter(m.groups() for r in failures if r["reason"].startswith("shape")
                                 and (m := _SHAPE.search(r["reason"])))
    print("shape read as:", ", ".join(f"{want}→{got} {n}" for (want, got), n in shapes.most_common()))


if __name__ == "__main__":
    main()
