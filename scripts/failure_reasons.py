"""Why held-out images fail: from `diffrl evaluate`'s samples.jsonl, the failures by kind (count,
shape, color, relation, noise), the commonest (prompt, failure) pairs, and the shape confusions
(expected → read as). Usage: failure_reasons.py SAMPLES_JSONL [--top N]"""

from __future__ import annotations

import argparse
import collections
import json
import re

# The verifier's shape failure: "shape: object 1 expected a red circle, found a blue square"
_SHAPE = re.compile(r"expected an? (?:\w+ )?(\w+), found an? (?:\w+ )?(\w+)$")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("samples")
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    failures = [r for r in map(json.loads, open(args.samples)) if not r["strict"]]
    print("failures by kind:", dict(collections.Counter(r["reason"].split(":")[0] for r in failures).most_common()))
    pairs = collections.Counter((r["prompt"], r["reason"]) for r in failures)
    for (prompt, reason), n in pairs.most_common(args.top):
        print(f"{n:4d}  {prompt!r}: {reason}")
    shapes = collections.Counter(m.groups() for r in failures if r["reason"].startswith("shape")
                                 and (m := _SHAPE.search(r["reason"])))
    print("shape read as:", ", ".join(f"{want}→{got} {n}" for (want, got), n in shapes.most_common()))


if __name__ == "__main__":
    main()
