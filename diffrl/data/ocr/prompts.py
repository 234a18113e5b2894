"""The OCR world's prompts: the published held-out split, and a generator of training prompts.

`test.txt` beside this module is Flow-GRPO's OCR test split (GitHub yifan123/flow_grpo, `dataset/ocr/test.txt`
at commit ac4c86e, 1,017 prompts, MIT license, copyright (c) 2025 Jie Liu): each prompt describes a scene
holding a double-quoted text. It is the world's held-out evaluation only: none of its quoted texts is ever
rendered for pretraining or drawn for RL (its train split is not in the mirror this was built from; a user
who holds it passes `--prompt-data DIR` with both files).

Training prompts are generated: a scene template around a phrase from `phrases.py` (the test split's
quoted texts excluded), half of them followed by a sentence of scene, toward the published prompts' length. `train.txt` beside this module is
`training_prompts(TRAIN_SEED, TRAIN_PROMPTS)`, written by `write_train_file` (a test checks it).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from diffrl.data.ocr.phrases import normalized, phrase, vocabulary

if TYPE_CHECKING:
    import numpy as np

PROMPT_DIR = Path(__file__).resolve().parent / "prompts"
TEST_FILE = PROMPT_DIR / "test.txt"
TRAIN_FILE = PROMPT_DIR / "train.txt"
TRAIN_SEED, TRAIN_PROMPTS = 20261210, 5000

OPENINGS = ("A photo of", "A realistic photograph of", "A close-up of", "An illustration of", "A poster of",
            "A cozy scene with", "A busy street with", "A quiet morning with", "A vintage picture of",
            "A bright studio shot of", "A night scene with", "A sunny day with")
CARRIERS = ("a wooden sign", "a neon sign", "a chalkboard", "a billboard", "a storefront banner", "a t-shirt",
            "a coffee mug", "a book cover", "a paper note", "a street sign", "a cake", "a poster", "a label",
            "a movie poster", "a whiteboard", "a flag", "a laptop screen", "a birthday card", "a road sign",
            "a shop window", "a menu board", "a tote bag", "a license plate", "a sticker", "a doormat")
SAYS = ("that says", "that reads", "with the words", "displaying", "with the text", "showing", "labeled",
        "printed with", "written with", "that spells out")
CLOSINGS = ("", "", " in bold letters", " in a playful font", " in elegant script", " under warm light",
            ", set against a blurred background", ", with soft shadows and a clean layout",
            " on a rainy evening, reflections glowing on the wet pavement",
            ", surrounded by plants and small lights", " in a minimalist style",
            ", with people walking past in the background", " at sunset, colors fading to orange")

# Sentences that may follow (the published prompts run 34 words on average; a template alone, about 15).
SCENES = ("The scene is lit by soft morning light, and a few people walk past.",
          "Around it, shelves of colorful goods fill a cozy little shop.",
          "The background shows a city skyline under a clear blue sky.",
          "Rain falls gently, and the street lights reflect on the wet ground.",
          "It hangs on an old brick wall covered with climbing green plants.",
          "A small dog sits nearby, looking up at the camera.",
          "The photo has warm tones, sharp details and a shallow depth of field.",
          "Snow covers the ground, and the air looks cold and still.")


@functools.cache
def test_prompts() -> tuple[str, ...]:
    """The published test split, in its order."""
    return tuple(line.strip() for line in TEST_FILE.read_text(encoding="utf-8").splitlines() if line.strip())


@functools.cache
def test_texts() -> frozenset[str]:
    """The test split's quoted texts, normalized as the reward compares them."""
    return frozenset(normalized(p.split('"')[1]) for p in test_prompts())


def make_prompt(text: str, rng: np.random.Generator) -> str:
    pick = lambda pool: pool[rng.integers(len(pool))]  # noqa: E731
    prompt = f'{pick(OPENINGS)} {pick(CARRIERS)} {pick(SAYS)} "{text}"{pick(CLOSINGS)}.'
    return f"{prompt} {pick(SCENES)}" if rng.random() < 0.5 else prompt


def sample_prompt(rng: np.random.Generator) -> tuple[str, str]:
    """(prompt, its quoted text), the text never one of the test split's."""
    text = phrase(rng, test_texts())
    return make_prompt(text, rng), text


def training_prompts(seed: int, count: int) -> list[str]:
    import numpy as np  # deferred: the recipes import this module for PROMPT_DIR; `diffrl train --help` loads no numpy

    rng = np.random.default_rng(seed)
    return [sample_prompt(rng)[0] for _ in range(count)]


def scene_vocabulary() -> list[str]:
    """Every word outside the quotes of a generated prompt and inside its phrases, lower-cased (the OCR
    tokenizer's words)."""
    words = set(vocabulary())
    for pool in (OPENINGS, CARRIERS, SAYS, CLOSINGS, SCENES):
        for item in pool:
            words.update(w.lower() for w in re.findall(r"\w+", item))  # as the tokenizer splits them
    return sorted(words)


def write_train_file(path: Path = TRAIN_FILE) -> Path:
    path.write_text("\n".join(training_prompts(TRAIN_SEED, TRAIN_PROMPTS)) + "\n", encoding="utf-8")
    return path
