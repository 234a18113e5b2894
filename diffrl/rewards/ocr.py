"""`ocr`: does the image show the text the prompt quotes? The Flow-GRPO OCR task's reward.

The text to render is the prompt's first double-quoted span ("…" or “…”, as Flow-GRPO's OCR prompts quote
it), else its first single-quoted one ('…' or ‘…’, whose quotes are not apostrophes inside a word, as in
"kid's"). A real OCR model reads the
image: RapidOCR's PP-OCR detector and recogniser in ONNX, which ship inside the `rapidocr-onnxruntime`
wheel (`pip install 'diffrl[ocr]'`), so nothing is downloaded at run time, at PaddleOCR's detection size
and without the angle classifier, as Flow-GRPO's scorer runs PaddleOCR. Both texts are compared
lower-cased with whitespace removed: 1 when the image's text contains the target, else
1 − min(edit distance, len(target)) / len(target), so partial spellings get partial credit and
unrelated text scores 0. A video `[B, C, F, H, W]` scores as the mean over its frames.
"""

from __future__ import annotations

import functools
import os

import torch

from diffrl.data.ocr.quotes import first_quoted
from diffrl.rewards.frames import mean_over_frames
from diffrl.rewards.registry import register_reward
from diffrl.utils.images import to_uint8


def quoted_text(prompt: str) -> str:
    """The prompt's quoted text (`first_quoted`); a prompt without one has nothing for OCR to check."""
    text = first_quoted(prompt)
    if text is None:
        raise ValueError(f"ocr reward: the prompt quotes no text to render: {prompt!r}")
    return text


def _normalized(text: str) -> str:
    return "".join(text.split()).lower()


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions cost 1)."""
    previous = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        current = [i]
        for j, cb in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ca != cb)))
        previous = current
    return previous[-1]


def text_score(read: str, target: str) -> float:
    read, target = _normalized(read), _normalized(target)
    if not target:
        raise ValueError("ocr reward: the quoted text is empty")
    if target in read:
        return 1.0
    return 1.0 - min(edit_distance(read, target), len(target)) / len(target)


@functools.cache
def _reader():
    """One OCR engine per process (a reward worker pool builds its own)."""
    try:
        from rapidocr_onnxruntime import RapidOCR
    except ImportError:
        raise ValueError("the ocr reward needs RapidOCR: pip install 'diffrl[ocr]' "
                         "(rapidocr-onnxruntime, whose wheel holds the OCR models)") from None
    # PaddleOCR's own defaults, as Flow-GRPO's scorer runs it (`PaddleOCR(use_angle_cls=False)`): detection
    # shrinks an image whose longer side passes 960 px and never enlarges one, and no angle classifier.
    # RapidOCR's defaults instead enlarge every image to a 736 px shorter side: on a 64×256 text render that is
    # a 736×2944 detection, 30–70× slower on a CPU and less accurate (docs/ocr-world.md, "The readers").
    # ONNX Runtime's sessions otherwise take a thread per core each: a pool of reward workers (one torch thread
    # each, `rewards/workers.py`) then runs workers × cores threads. Two workers on 2 cores read a 48×256 render
    # in 0.030 s each with one thread against 0.061 s with the default (2026-12-07); three runs of 4 workers on a
    # 16-core GPU machine took 48 s a 512-image rollout, against 7 s of training.
    return RapidOCR(det_limit_type="max", det_limit_side_len=960, use_cls=False,
                    intra_op_num_threads=reader_threads(), inter_op_num_threads=1)


def reader_threads() -> int:
    """ONNX Runtime threads of this process's reader: torch's (1 in a reward worker, the cores in-process)."""
    return max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def read_text(pixels) -> str:
    """The text OCR finds in one [H, W, 3] uint8 image, boxes in reading order (top to bottom, then left
    to right), joined."""
    found, _ = _reader()(pixels)
    boxes = sorted(found or [], key=lambda item: (min(y for _, y in item[0]), min(x for x, _ in item[0])))
    return "".join(text for _, text, _ in boxes)


@register_reward("ocr")
@mean_over_frames
def ocr_reward(images, prompts, metadata=None) -> list[float]:
    targets = [quoted_text(p) for p in prompts]  # refuse a prompt without quotes before any OCR runs
    return [text_score(read_text(pixels), target) for pixels, target in zip(to_uint8(images), targets, strict=True)]


ocr_reward.check_prompt = quoted_text  # a prompt set is checked for quoted text up front (rewards.check_prompts)
