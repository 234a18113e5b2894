"""The `ocr` reward: a real OCR model (RapidOCR's PP-OCR in ONNX, from its wheel) reads rendered text."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, ImageFont

from diffrl.rewards import get_reward
from diffrl.rewards.ocr import edit_distance, quoted_text, text_score


def render(text: str, size: int = 256) -> torch.Tensor:
    """Black text on white, [3, H, W] in [0, 1]."""
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((16, size // 2 - 20), text, fill="black", font=ImageFont.load_default(size=36))
    return torch.from_numpy(np.array(image)).permute(2, 0, 1).float() / 255


def test_quoted_text_and_the_score_formula():
    assert quoted_text('a sign that says "Open Late"') == "Open Late"
    assert quoted_text("a mug with ‘coffee’ on it") == "coffee"
    assert edit_distance("kitten", "sitting") == 3 and edit_distance("", "abc") == 3
    assert text_score("OPEN late!!", "open late") == 1.0  # contained, case and spaces aside
    assert text_score("opem late", "open late") == pytest.approx(1 - 1 / 8)
    assert text_score("something else entirely", "open") == 0.0  # distance capped at the target's length
    with pytest.raises(ValueError, match="quotes no text"):
        quoted_text("a sign with nothing quoted")


def test_an_apostrophe_does_not_open_a_quoted_span():
    """Double quotes win over single ones, and an apostrophe inside a word is not a quote."""
    assert quoted_text('A kid\'s drawing labeled "Mom\'s house"') == "Mom's house"
    assert quoted_text("Baker's dozen sign: 'FRESH'") == "FRESH"
    assert quoted_text("a sign that says 'Don't Panic' in red") == "Don't Panic"
    assert quoted_text("a sign that says “Don’t Panic”") == "Don’t Panic"
    assert quoted_text("the chef's menu reads ‘soup’") == "soup"
    with pytest.raises(ValueError, match="quotes no text"):
        quoted_text("the chef's special")


def test_ocr_reads_the_quoted_text_back():
    reward = get_reward("ocr")
    prompts = ['a poster that says "diffrl"', 'a poster that says "diffrl"', 'a sign reading "hello"']
    images = torch.stack([render("diffrl"), render("diffusion"), torch.ones(3, 256, 256)])
    right, wrong, blank = reward(images, prompts)
    assert right == 1.0
    assert 0.0 < wrong < 1.0  # "diffusion" shares a prefix with "diffrl": partial credit
    assert blank == 0.0  # nothing to read


def test_a_prompt_without_quotes_is_refused_before_any_ocr():
    with pytest.raises(ValueError, match="quotes no text to render: 'a red circle'"):
        get_reward("ocr")(torch.ones(1, 3, 64, 64), ["a red circle"])


def test_a_video_scores_as_the_mean_of_its_frames(monkeypatch):
    """The frame plumbing, with a stand-in reader (the OCR model itself is tested above): a bright frame
    reads "diffrl", a dark one "diff"."""
    import diffrl.rewards.ocr as ocr

    monkeypatch.setattr(ocr, "read_text", lambda pixels: "diffrl" if pixels.mean() > 128 else "diff")
    reward = get_reward("ocr")
    frames = torch.stack([torch.ones(3, 8, 8), torch.zeros(3, 8, 8), torch.ones(3, 8, 8)])
    prompt = ['a poster that says "diffrl"']
    per_frame = reward(frames, prompt * 3)
    assert per_frame == pytest.approx([1.0, 4 / 6, 1.0])  # frames that score differently
    video = frames.permute(1, 0, 2, 3)[None]  # [B, C, F, H, W]
    assert reward(video, prompt) == pytest.approx([sum(per_frame) / 3])


def test_a_prompt_set_without_quoted_text_is_refused_up_front(tmp_path):
    """`--reward ocr` on prompts without quotes fails before any model loads (it failed when the first such
    prompt was scored: after the held-out evaluation), naming the file and the prompt; inside `multi:` too."""
    from diffrl.cli.main import main as cli_main
    from diffrl.rewards import check_prompts

    check_prompts("ocr", ['a sign that says "hi"'], "p.txt")
    check_prompts("jpeg_compressibility", ["a cat"], "p.txt")  # rewards without a check are not asked
    with pytest.raises(ValueError, match=r"^p.txt, prompt 2: ocr reward: the prompt quotes no text to render: 'a cat'$"):
        check_prompts("multi:jpeg_compressibility=0.5,ocr=1", ['a sign that says "hi"', "a cat"], "p.txt")
    (tmp_path / "test.txt").write_text('a sign that says "hi"\na cat\n')
    missing_model = tmp_path / "no-model"  # never reached: the prompts are refused first
    assert cli_main(["evaluate", "--model-path", str(missing_model), "--prompt-data", str(tmp_path / "test.txt"),
                     "--reward", "ocr", "--output-dir", str(tmp_path / "ev")]) == 2
    assert not (tmp_path / "ev").exists()
