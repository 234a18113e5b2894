"""Short phrases to render, made from a fixed vocabulary: the OCR world's training texts.

A phrase is 1–4 words in the shapes of sign and poster texts (an adjective and a noun, an imperative, a
name with a number or a year, a greeting), in title case, upper case or lower case. Phrases equal to a
quoted text of the published test split (compared as the reward compares: case and spaces aside) are never
emitted, so no held-out text is ever rendered for pretraining or drawn for RL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # only annotations here: the recipes import this package for its prompt folder (train --help)
    import numpy as np

ADJECTIVES = (
    "big new old red blue green gold silver dark bright quiet wild free fresh hot cold sweet happy lucky "
    "grand royal urban secret hidden lost brave golden magic cosmic lunar solar early late daily weekly "
    "open closed best fast slow simple modern classic vintage little great final first last true pure "
    "local global north south east west summer winter spring autumn midnight morning sunny rainy frozen").split()
NOUNS = (
    "cafe coffee bakery garden market river forest ocean mountain city street avenue station harbor bridge "
    "tower castle island valley desert planet rocket robot dragon tiger eagle wolf fox bear owl horse "
    "pizza burger noodle taco bread cake cookie candy juice tea soup grill kitchen diner bar pub club "
    "library museum school academy studio gallery theater cinema arena stadium park zoo farm ranch shop "
    "store outlet books music radio news games sports fitness yoga dance jazz rock blues party festival "
    "sale deals offer prize ticket pass map guide plan project mission journey quest adventure story "
    "dream hope love peace joy luck light star moon sun sky cloud storm rain snow fire water stone wood "
    "gear code data cloud signal network pixel engine motor garage repair service office clinic hotel").split()
VERBS = (
    "save join visit try enjoy explore discover welcome watch listen read play build grow shop eat drink "
    "keep stay stop go follow dream believe create share find meet ride fly run start order call").split()
NAMES = ("Alex Sam Max Leo Mia Zoe Nina Omar Ravi Lena Hugo Ivy Kai Luna Otto Rosa Theo Vera Yuki Ezra "
         "Nova Atlas Orion Echo Aurora Phoenix Willow Juniper Maple Cedar").split()
GREETINGS = ("hello", "welcome", "thank you", "good luck", "happy birthday", "see you soon", "get well soon",
             "well done", "congrats", "good morning", "good night", "cheers")
FILLERS = ("the", "our", "your", "and", "of", "for", "to", "at", "in", "my", "all", "no", "now", "here")


def _words(rng: np.random.Generator) -> str:
    pick = lambda pool: pool[rng.integers(len(pool))]  # noqa: E731
    shape = rng.integers(9)
    if shape == 0:
        return f"{pick(ADJECTIVES)} {pick(NOUNS)}"
    if shape == 1:
        return f"{pick(VERBS)} {pick(FILLERS)} {pick(NOUNS)}"
    if shape == 2:
        return f"{pick(NAMES)}'s {pick(NOUNS)}"
    if shape == 3:
        return f"{pick(NOUNS)} {rng.integers(1950, 2040)}"
    if shape == 4:
        return f"{pick(ADJECTIVES)} {pick(NOUNS)} {pick(NOUNS)}"
    if shape == 5:
        return pick(GREETINGS) + (f" {pick(NAMES)}" if rng.random() < 0.5 else "")
    if shape == 6:
        return f"{pick(NOUNS)} {pick(FILLERS)} {pick(ADJECTIVES)} {pick(NOUNS)}"
    if shape == 7:
        return f"{rng.integers(1, 100)}% off" if rng.random() < 0.3 else f"{pick(NOUNS)} no {rng.integers(1, 100)}"
    return pick(NOUNS)


def _cased(phrase: str, rng: np.random.Generator) -> str:
    style = rng.choice(4, p=[0.6, 0.2, 0.1, 0.1])
    if style == 0:  # title case, keeping a name's own capitals
        return " ".join(w[:1].upper() + w[1:] for w in phrase.split(" "))
    return phrase.upper() if style == 1 else phrase.lower() if style == 2 else phrase[:1].upper() + phrase[1:]


def normalized(text: str) -> str:
    """How the reward compares texts: lower case, whitespace removed."""
    return "".join(text.split()).lower()


def phrase(rng: np.random.Generator, excluded: frozenset[str]) -> str:
    """One phrase of at most 29 characters (the test split's longest) whose normalized form is not in
    `excluded`."""
    while True:
        text = _cased(_words(rng), rng)
        if len(text) <= 29 and normalized(text) not in excluded:
            return text


def vocabulary() -> list[str]:
    """Every word a phrase can hold, lower-cased (scene words are added by the prompt templates)."""
    words = {w.lower() for pool in (ADJECTIVES, NOUNS, VERBS, NAMES, FILLERS) for w in pool}
    words.update(w for g in GREETINGS for w in g.split())
    return sorted(words)
