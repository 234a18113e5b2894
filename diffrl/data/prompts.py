"""Prompt datasets: what `--prompt-data` and `--eval-prompt-data` read, and the order a run walks them.

Accepted layouts (those of the public Flow-GRPO prompt sets: ocr, pickscore, geneval):
- a `.txt` file, one prompt per line (blank lines skipped);
- a `.jsonl` file, one JSON object per line: `--input-key` (default `prompt`) is the prompt, `image` or
  `images` name its condition images (an edit's source; `condition_images.py`), `negative_prompt` (a string) is
  that prompt's own unconditional prompt for CFG in rollouts and evaluation (else `--negative-prompt`), every other
  key is that prompt's metadata and reaches the reward (e.g. GenEval's `tag`, `include`) beside the keys diffrl sets for
  each sample (`SAMPLE_KEYS`), which a file may therefore not use;
- a directory with `train.txt` / `test.txt` or `train_metadata.jsonl` / `test_metadata.jsonl`
  (the jsonl file wins when both exist: it carries the metadata).

A run draws its training prompts through `PromptStream`: the dataset shuffled once per epoch by a
permutation that is a function of (seed, epoch) only, read in order. Its state is two integers
(epoch, position), saved in every checkpoint with the dataset's size and `fingerprint`, so `--resume`
continues with exactly the prompt that was next, and refuses a prompt file edited since.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np

from diffrl.data.condition_images import CONDITION_IMAGES_KEY, ConditionImage, row_images

Split = Literal["train", "test"]
DEFAULT_INPUT_KEY = "prompt"

# What the reward's metadata also holds for each image: its seed (training and evaluation), and in training its
# group and index in the group (rollout/manager.py). A prompt's own key of one of these names would be
# overwritten before the reward sees it, so a file using one is refused.
SAMPLE_KEYS = ("seed", "group_index", "sample_index", CONDITION_IMAGES_KEY)
NEGATIVE_PROMPT_KEY = "negative_prompt"  # a row's own unconditional prompt (kept in its metadata too)


def negative_prompt_of(metadata: dict | None, default: str) -> str:
    """A prompt's unconditional prompt for CFG: its row's `negative_prompt`, else the run's `default`."""
    own = (metadata or {}).get(NEGATIVE_PROMPT_KEY)
    return own if isinstance(own, str) else default


@dataclass(frozen=True)
class PromptRecord:
    prompt: str
    metadata: dict = field(default_factory=dict)
    images: tuple[ConditionImage, ...] = ()
    """The prompt's condition images (an edit's source), in the row's order; () for text-only prompts."""
    line: int | None = field(default=None, compare=False)
    """The line of its prompt file (from 1), for errors that name a row; None when not read from a file. Not part of
    the record's identity: the same prompt moved to another line is the same prompt."""


def load_prompts(path: str | Path, split: Split = "train", input_key: str = DEFAULT_INPUT_KEY) -> list[PromptRecord]:
    """The prompts of a file, or of a directory's `split`; refused with one line naming the problem."""
    path = prompt_file(path, split)
    if path.suffix == ".jsonl":
        records = _read_jsonl(path, input_key)
    elif path.suffix == ".txt":
        records = [PromptRecord(line.strip(), line=number)
                   for number, line in enumerate(_read_lines(path), start=1) if line.strip()]
    else:
        raise ValueError(f"prompt data {path}: expected a .txt file (one prompt per line), a .jsonl file "
                         "or a directory holding train.txt/test.txt or train_metadata.jsonl/test_metadata.jsonl")
    if not records:
        raise ValueError(f"prompt data {path}: no prompts")
    return records


def prompt_file(path: str | Path, split: Split) -> Path:
    """The file `load_prompts` reads for `split`: `path` itself, or a directory's split file."""
    path = Path(path)
    if path.is_dir():
        return split_file(path, split)
    if not path.is_file():
        raise FileNotFoundError(f"prompt data {path}: no such file or directory")
    return path


def check_input_key(input_key: str, files: dict[str, Path]) -> None:
    """A ValueError naming --input-key when it is set but no file read has keys: `.txt` prompt files hold one prompt
    per line, so the flag would be ignored. `files`: the flag (with its path) each file was read for → the file."""
    if input_key == DEFAULT_INPUT_KEY or not files or any(f.suffix == ".jsonl" for f in files.values()):
        return
    read = "; ".join(f"{flag} reads {file}" for flag, file in files.items())
    raise ValueError(f"--input-key {input_key}: {read}, one prompt per line with no keys to pick from; drop "
                     "--input-key, or pass a .jsonl file whose prompts are under that key")


def split_file(directory: Path, split: Split) -> Path:
    """The file holding a directory's split: `<split>_metadata.jsonl`, else `<split>.txt`."""
    for name in (f"{split}_metadata.jsonl", f"{split}.txt"):
        if (directory / name).is_file():
            return directory / name
    raise FileNotFoundError(f"prompt data {directory}: no {split}_metadata.jsonl or {split}.txt in it")


def _read_lines(path: Path) -> list[str]:
    """The file's lines as UTF-8. A byte-order mark (what Windows editors write first) is dropped, not
    left at the start of the first prompt; other encodings are refused naming the line."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8-sig").splitlines()
    except UnicodeDecodeError as err:
        line = raw[: err.start].count(b"\n") + 1
        raise ValueError(f"prompt data {path}:{line}: not UTF-8 (byte {raw[err.start]:#04x}); "
                         "save the file as UTF-8") from None


def _read_jsonl(path: Path, input_key: str) -> list[PromptRecord]:
    records = []
    for number, line in enumerate(_read_lines(path), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"prompt data {path}:{number}: not JSON ({err.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"prompt data {path}:{number}: expected a JSON object, got {type(row).__name__}")
        prompt = row.pop(input_key, None)
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompt data {path}:{number}: no text under --input-key {input_key!r} "
                             f"(keys: {', '.join(sorted(row)) or 'none'})")
        if taken := [k for k in SAMPLE_KEYS if k in row]:
            raise ValueError(f"prompt data {path}:{number}: metadata key {taken[0]!r} is set by diffrl for each "
                             "sample (keys it sets: " + ", ".join(SAMPLE_KEYS) + "); rename it in the file")
        if not isinstance(row.get(NEGATIVE_PROMPT_KEY, ""), str):
            raise ValueError(f"prompt data {path}:{number}: {NEGATIVE_PROMPT_KEY!r} must be a string, got "
                             f"{type(row[NEGATIVE_PROMPT_KEY]).__name__}")
        images = row_images(row, path.parent, f"prompt data {path}:{number}")
        records.append(PromptRecord(prompt, row, images, number))
    return records


def fingerprint(records: list[PromptRecord]) -> str:
    """sha256 over the prompts, their metadata and their condition images' bytes, in order: equal for the same
    loaded dataset, whatever the file's layout or folder, and different for an edit that keeps the number of
    prompts."""
    digest = hashlib.sha256()
    for r in records:
        row = [r.prompt, r.metadata, [i.sha256 for i in r.images]] if r.images else [r.prompt, r.metadata]
        digest.update(json.dumps(row, sort_keys=True, ensure_ascii=False).encode() + b"\n")
    return digest.hexdigest()


class PromptStream:
    """The dataset in a fresh shuffled order each epoch; `take(n)` reads the next n, crossing into the
    next epoch's order when one runs out. Every rank of a data-parallel run holds the same stream."""

    def __init__(self, records: list[PromptRecord], seed: int = 0, shuffle: bool = True,
                 source: str = "--prompt-data"):
        """`source`: the flag and file the records came from, as a refused resume names them."""
        if not records:
            raise ValueError("a prompt stream needs at least one prompt")
        self.records, self.seed, self.shuffle, self.source = list(records), seed, shuffle, source
        self.fingerprint = fingerprint(self.records)
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.records))
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.records))

    def take(self, n: int) -> list[PromptRecord]:
        out, order = [], self._order(self.epoch)
        while len(out) < n:
            if self.position == len(self.records):
                self.epoch, self.position = self.epoch + 1, 0
                order = self._order(self.epoch)
            out.append(self.records[order[self.position]])
            self.position += 1
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "size": len(self.records),
                "sha256": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        if state.get("size", len(self.records)) != len(self.records):
            raise ValueError(f"--resume: the checkpoint walked a prompt set of {state['size']} prompts; "
                             f"{self.source} now holds {len(self.records)}")
        # Checkpoints written before the fingerprint have only the size to check.
        if state.get("sha256", self.fingerprint) != self.fingerprint:
            raise ValueError(f"--resume: {self.source} is not the prompt set the checkpoint was trained on "
                             f"(same {len(self.records)} prompts in number, other text, metadata or order); "
                             "resume with the original file, or start a new run in another --output-dir")
        self.epoch, self.position = int(state.get("epoch", 0)), int(state.get("position", 0))
