"""The editing world's rewards: `verify_edit` on each output against its prompt's source (the metadata's
`condition_images`), the instruction being the prompt (docs/editing-world.md).

`shapes_edit`: the verdict's partial credit, the mean of the edit term (0 or 1) and the preservation term (what of
the source's other objects, background and cleanliness the output keeps), for training; `shapes_edit_strict`: 1
when the edit is done and everything else preserved, else 0, for evaluation.
"""

from __future__ import annotations

from diffrl.data.condition_images import CONDITION_IMAGES_KEY
from diffrl.data.shapes.edits import EditVerdict, parse_edit, verify_edit
from diffrl.rewards.registry import register_reward
from diffrl.utils.images import to_uint8


def edit_verdicts(images, prompts, metadata) -> list[EditVerdict]:
    """Each output judged against its source; a ValueError naming the sample when it has no source or another
    size than its output."""
    verdicts = []
    for i, (output, prompt) in enumerate(zip(to_uint8(images), prompts, strict=True)):
        sources = (metadata[i] if metadata else {}).get(CONDITION_IMAGES_KEY) or ()
        if not sources:
            raise ValueError(f"shapes_edit: sample {i} ({prompt!r}) has no source image (the editing world's prompts "
                             "carry their rendered source as a condition image)")
        source = to_uint8(sources[0][None])[0]
        if source.shape != output.shape:
            raise ValueError(f"shapes_edit: sample {i}: the output is {output.shape[1]}x{output.shape[0]} and its "
                             f"source {source.shape[1]}x{source.shape[0]}; sample at the source's size")
        verdicts.append(verify_edit(source, output, prompt))
    return verdicts


@register_reward("shapes_edit")
def shapes_edit_reward(images, prompts, metadata=None) -> list[float]:
    """Partial credit of the edit verifier: the edit done (0 or 1) and the source preserved, averaged."""
    return [v.score for v in edit_verdicts(images, prompts, metadata)]


@register_reward("shapes_edit_strict")
def shapes_edit_strict_reward(images, prompts, metadata=None) -> list[float]:
    """1 when the edit is done and everything else of the source preserved, else 0."""
    return [float(v.strict) for v in edit_verdicts(images, prompts, metadata)]


def _edit_prompt(prompt: str) -> None:
    parse_edit(prompt)  # a ValueError naming the problem; the scene is checked when the source is seen


for _reward in (shapes_edit_reward, shapes_edit_strict_reward):
    _reward.check_prompt = _edit_prompt
