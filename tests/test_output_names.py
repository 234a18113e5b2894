"""The names the docs promise for what a run folder, `diffrl evaluate` and `diffrl compare` write are the names the
code writes (issue 41, finding 7, asks for one output naming scheme).

Pinned as they are today, which is not one scheme: a run folder writes `report.md`, the reward comparison
`compare.md` and `compare.json`, an evaluation by a reward (`diffrl evaluate --reward`, a run's held-out
`eval/rollout-N/`, each column of the reward comparison) `summary.json` and `records.jsonl`, while the shapes-world
`diffrl evaluate` and `diffrl compare` write `report.json` (and `samples.jsonl`), which docs/cli.md does not name.
Renaming any of them changes the docs and every reader's scripts: this test fails until both sides agree.

Static (no model runs): each name must appear in its command's line or paragraph of the docs, and as a string
constant in the module that writes it. The files themselves are checked by the tests that run the commands
(test_reward_eval.py, test_eval_reward.py, test_run_folders.py, test_report.py, test_resume_faults.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (what, the doc, a string that picks its line or paragraph, the modules that write the files, the names promised)
PROMISED = [
    ("diffrl evaluate --prompt-data --reward", "docs/cli.md", "diffrl evaluate --prompt-data",
     ["diffrl/evaluation/reward_eval.py"], ["images/", "records.jsonl", "summary.json", "grid.png"]),
    ("diffrl compare --prompt-data --reward", "docs/cli.md", "diffrl compare --base DIR --trained",
     ["diffrl/cli/compare.py"], ["compare.md", "compare.json", "side_by_side.png"]),
    ("a run folder", "docs/training.md", "A run folder",
     ["diffrl/train/trainer.py", "diffrl/train/metrics.py", "diffrl/train/report.py", "diffrl/evaluation/reward_eval.py"],
     ["config.json", "metrics.jsonl", "tensorboard/", "report.md", "reward_curve.png", "grid.png", "records.jsonl",
      "summary.json"]),
]


def _passage(doc: str, marker: str) -> str:
    """The paragraph (lines up to a blank one) of `doc` holding `marker`; in a code block, the line holding it."""
    text = (ROOT / doc).read_text()
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if marker in line)
    if text.count("```", 0, text.find(lines[at])) % 2:  # inside a code block: one command per line
        return lines[at]
    start, end = at, at
    while start > 0 and lines[start - 1].strip():
        start -= 1
    while end + 1 < len(lines) and lines[end + 1].strip():
        end += 1
    return "\n".join(lines[start : end + 1])


def _string_constants(module: str) -> set[str]:
    tree = ast.parse((ROOT / module).read_text())
    return {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


@pytest.mark.parametrize(("what", "doc", "marker", "writers", "names"), PROMISED, ids=[p[0] for p in PROMISED])
def test_the_docs_and_the_code_name_the_same_output_files(what, doc, marker, writers, names):
    passage = _passage(doc, marker)
    written = set().union(*(_string_constants(m) for m in writers))
    not_in_docs = [n for n in names if not re.search(rf"(?<![\w.-]){re.escape(n)}(?![\w.-])", passage)]
    not_written = [n for n in names if n.rstrip("/") not in written]
    assert not not_in_docs, f"{doc} no longer names {not_in_docs} for {what}"
    assert not not_written, f"{', '.join(writers)} no longer write {not_written} ({doc} promises them for {what})"
