"""Captions under grid cells: wrapped at words, and a failed sample says why."""

from __future__ import annotations

import pytest
import torch
from PIL import ImageDraw

from diffrl.evaluation.shapes import SampleRecord, record_caption, save_records_grid, short_reason
from diffrl.utils.images import save_grid


@pytest.fixture
def drawn(monkeypatch) -> list[str]:
    """Every line of text a grid draws."""
    lines: list[str] = []
    original = ImageDraw.ImageDraw.text

    def text(self, xy, line, *args, **kwargs):
        lines.append(line)
        return original(self, xy, line, *args, **kwargs)

    monkeypatch.setattr(ImageDraw.ImageDraw, "text", text)
    return lines


def test_captions_wrap_at_words(drawn, tmp_path):
    captions = ["X a orange triangle to the left of a green square", "ok a purple diamond above a yellow circle",
                "trained X three blue squares and two orange diamonds"]
    save_grid(torch.rand(3, 3, 64, 64), tmp_path / "grid.png", ncols=3, captions=captions, caption_lines=4)
    words = {w for c in captions for w in c.split()}
    assert drawn and all(set(line.split()) <= words for line in drawn), drawn
    assert " ".join(drawn) == " ".join(captions)  # nothing lost: each caption fits in four lines


def test_a_long_caption_ends_with_an_ellipsis_at_a_word(drawn, tmp_path):
    caption = " ".join(["a orange triangle to the left of a green square"] * 6)
    save_grid(torch.rand(1, 3, 32, 32), tmp_path / "grid.png", ncols=1, captions=[caption], caption_lines=2)
    assert len(drawn) == 2 and drawn[-1].endswith("…")
    assert set(" ".join(drawn).removesuffix("…").split()) <= set(caption.split())


def test_a_failed_sample_says_why(drawn, tmp_path):
    records = [SampleRecord("a red circle and a blue square", "two_objects", 0, False, 0.5,
                            "count: expected 2 objects, found 3"),
               SampleRecord("a orange circle", "single_object", 0, False, 0.4,
                            "shape: object 0 expected a orange circle, found a orange blunt shape "
                            "(its top 0.28 of its base wide, not an apex)"),
               SampleRecord("a green square", "single_object", 0, True, 1.0, "ok")]
    save_records_grid(records, torch.rand(3, 3, 64, 64), tmp_path / "grid.png")
    text = " ".join(drawn)
    assert "count: expected 2 objects, found 3" in text
    assert "shape: expected a orange circle, found a orange blunt shape" in text and "0.28" not in text
    assert "ok a green square" in text
    assert record_caption(records[2], "base") == "base ok a green square"
    assert record_caption(records[0], "trained").startswith("trained X a red circle")


def test_short_reason():
    assert short_reason("shape: object 2 expected a triangle, found a purple stretched shape (aspect 1.57)") == \
        "shape: expected a triangle, found a purple stretched shape"
    assert short_reason("relation: the red diamond is not to the left of the orange diamond") == \
        "relation: the red diamond is not to the left of the orange diamond"
