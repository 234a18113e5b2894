"""One output naming scheme (issue 41, finding 7), and the docs naming the files the code writes.

Every output folder of `diffrl evaluate`, `diffrl compare` and a run's held-out evaluations (`eval/rollout-N/`, each
column of a comparison by a reward) writes `report.json` (the machine-readable summary), `records.jsonl` (one row per
sample), its images (`grid.png`, compare's `side_by_side.png`, `images/`) and `report.md` where there is a page for
people (a run folder, a comparison by a reward). Before it, an evaluation by a reward wrote `summary.json`, a
comparison by a reward `compare.json` and `compare.md`, the shapes world's evaluation `samples.jsonl`: no writer writes
those names now, and every reader (`diffrl.utils.output_files`, `scripts/failure_reasons.py`, `rescore`) still reads
a folder that holds them.

Static (no model runs): each name must appear in its command's line or paragraph of the docs, and as a string
constant in the module that writes it. The files themselves are checked by the tests that run the commands
(test_reward_eval.py, test_eval_reward.py, test_run_folders.py, test_report.py, test_resume_faults.py, test_shapes.py).
"""

from __future__ import annotations

import ast
import json
import re
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from diffrl.utils.output_files import OLD_NAMES, output_file, read_records, read_report

ROOT = Path(__file__).resolve().parents[1]
OLD = {old for olds in OLD_NAMES.values() for old in olds}

# (what, the doc, a string that picks its line or paragraph, the modules that write the files, the names promised)
PROMISED = [
    ("diffrl evaluate (shapes world)", "docs/cli.md", "diffrl evaluate [--model-path DIR]",
     ["diffrl/cli/evaluate.py", "diffrl/evaluation/shapes.py"], ["report.json", "records.jsonl", "grid.png", "images/"]),
    ("diffrl evaluate --prompt-data --reward", "docs/cli.md", "diffrl evaluate --prompt-data",
     ["diffrl/evaluation/reward_eval.py"], ["images/", "records.jsonl", "report.json", "grid.png"]),
    ("diffrl compare (shapes world)", "docs/cli.md", "diffrl compare --trained RUN",
     ["diffrl/cli/compare.py"], ["report.json", "side_by_side.png"]),
    ("diffrl compare --prompt-data --reward", "docs/cli.md", "diffrl compare --base DIR --trained",
     ["diffrl/cli/compare.py"], ["report.md", "report.json", "side_by_side.png"]),
    ("a run folder", "docs/training.md", "A run folder",
     ["diffrl/train/trainer.py", "diffrl/train/metrics.py", "diffrl/train/report.py", "diffrl/evaluation/reward_eval.py"],
     ["config.json", "metrics.jsonl", "tensorboard/", "report.md", "reward_curve.png", "grid.png", "records.jsonl",
      "report.json"]),
]
WRITERS = sorted({m for p in PROMISED for m in p[3]} | {"diffrl/evaluation/compare.py", "diffrl/tasks/prompt_set.py"})


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


def _named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])", text) is not None


@pytest.mark.parametrize(("what", "doc", "marker", "writers", "names"), PROMISED, ids=[p[0] for p in PROMISED])
def test_the_docs_and_the_code_name_the_same_output_files(what, doc, marker, writers, names):
    passage = _passage(doc, marker)
    written = set().union(*(_string_constants(m) for m in writers))
    not_in_docs = [n for n in names if not _named(passage, n)]
    not_written = [n for n in names if n.rstrip("/") not in written]
    assert not not_in_docs, f"{doc} no longer names {not_in_docs} for {what}"
    assert not not_written, f"{', '.join(writers)} no longer write {not_written} ({doc} promises them for {what})"
    if "\n" not in passage:  # a command's line of docs/cli.md promises the new names only
        assert not [n for n in OLD if _named(passage, n)], f"{doc} still names an old file for {what}"


@pytest.mark.parametrize("module", WRITERS)
def test_no_writer_makes_a_path_with_an_old_name(module):
    """`folder / "summary.json"` (and the other old names) appears only to remove a stale file, never to write one."""
    tree = ast.parse((ROOT / module).read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    made = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and isinstance(node.right, ast.Constant)
                and node.right.value in OLD):
            parent = parents.get(node)
            if not (isinstance(parent, ast.Attribute) and parent.attr == "unlink"):
                made.append(node.right.value)
    assert not made, f"{module} makes paths with the old names {made}"


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


ROWS = [{"index": 0, "prompt": "a red circle", "category": "single_object", "seed": 0, "strict": False, "score": 0.5,
         "reason": "shape: object 1 expected a red circle, found a red square", "background_delta_e": 0.0},
        {"index": 1, "prompt": "a blue square", "category": "single_object", "seed": 1, "strict": True, "score": 1.0,
         "reason": "", "background_delta_e": 0.0}]


def test_a_folder_written_with_the_old_names_is_still_read(tmp_path, monkeypatch, capsys):
    # An evaluation by a reward (diffrl evaluate --reward, a run's eval/rollout-N/, a comparison's column).
    evaluation = tmp_path / "run" / "eval" / "rollout-00002"
    evaluation.mkdir(parents=True)
    (evaluation / "summary.json").write_text(json.dumps({"eval/reward": 0.25, "n_images": 2}))
    _write_jsonl(evaluation / "records.jsonl", [{"prompt": "p", "reward": 0.25}])
    assert read_report(evaluation)["eval/reward"] == 0.25
    assert output_file(evaluation, "report.json").name == "summary.json"
    # A comparison by a reward.
    comparison = tmp_path / "cmp"
    comparison.mkdir()
    (comparison / "compare.json").write_text(json.dumps({"totals": {"prompts": 2}}))
    (comparison / "compare.md").write_text("| prompt |\n")
    assert read_report(comparison)["totals"]["prompts"] == 2
    assert output_file(comparison, "report.md").read_text() == "| prompt |\n"
    # A shapes evaluation: report.json already, samples.jsonl for its rows.
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    (shapes / "report.json").write_text(json.dumps({"overall_strict": 0.5}))
    _write_jsonl(shapes / "samples.jsonl", [{k: v for k, v in r.items() if k != "index"} for r in ROWS])
    assert read_report(shapes)["overall_strict"] == 0.5
    assert [r["prompt"] for r in read_records(shapes)] == ["a red circle", "a blue square"]
    monkeypatch.setattr(sys, "argv", ["failure_reasons.py", str(shapes)])
    runpy.run_path(str(ROOT / "scripts" / "failure_reasons.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert "failures by kind: {'shape': 1}" in out and "circle→square 1" in out
    # A shapes evaluation with --save-images from before: records.jsonl (rows naming their images) beside
    # samples.jsonl; the rows that name images win, and rescoring still reads them.
    from diffrl.evaluation.shapes import saved_samples

    (shapes / "images").mkdir()
    Image.fromarray(np.full((8, 8, 3), 255, np.uint8)).save(shapes / "images" / "00000.png")
    _write_jsonl(shapes / "records.jsonl", [{**ROWS[0], "file": "images/00000.png"}])
    assert [row["file"] for row, _ in saved_samples(shapes)] == ["images/00000.png"]


def test_the_new_name_wins_over_an_old_one_and_a_missing_file_is_named_by_its_new_name(tmp_path):
    (tmp_path / "summary.json").write_text(json.dumps({"which": "old"}))
    (tmp_path / "report.json").write_text(json.dumps({"which": "new"}))
    assert read_report(tmp_path) == {"which": "new"}
    with pytest.raises(FileNotFoundError, match="records.jsonl"):
        read_records(tmp_path)
