"""One naming scheme for what `diffrl evaluate`, `diffrl compare` and a run's held-out evaluations write (issue 41),
and the files of folders written before it, read back.

Every such folder holds `report.json` (the machine-readable summary), `records.jsonl` (one row per sample), its
images (`grid.png`, compare's `side_by_side.png`, `images/`) and, where there is a page for people (a run folder,
a comparison by a reward), `report.md`. Before the one scheme an evaluation by a reward wrote `summary.json`, a
comparison by a reward `compare.json` and `compare.md`, the shapes world's evaluation `samples.jsonl`: a reader
takes the new name and falls back to the old one (`output_file`), so old folders still read.
"""

from __future__ import annotations

import json
from pathlib import Path

REPORT_JSON = "report.json"
RECORDS = "records.jsonl"
REPORT_MD = "report.md"

# Each name of the one scheme and what folders written before it called the same file.
OLD_NAMES: dict[str, tuple[str, ...]] = {
    REPORT_JSON: ("summary.json", "compare.json"),
    RECORDS: ("samples.jsonl",),
    REPORT_MD: ("compare.md",),
}


def output_file(folder: str | Path, name: str) -> Path:
    """`folder/name`; for a folder written before the one scheme, the old name it holds instead. `folder/name` when
    neither is there (the error then names the new file)."""
    folder = Path(folder)
    for candidate in (name, *OLD_NAMES.get(name, ())):
        if (folder / candidate).is_file():
            return folder / candidate
    return folder / name


def read_report(folder: str | Path) -> dict:
    """The folder's machine-readable summary: `report.json`, else an older folder's `summary.json` or
    `compare.json`."""
    return json.loads(output_file(folder, REPORT_JSON).read_text(encoding="utf-8"))


def read_records(folder: str | Path) -> list[dict]:
    """The folder's rows, one per sample: `records.jsonl`, else an older folder's `samples.jsonl`."""
    text = output_file(folder, RECORDS).read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]
