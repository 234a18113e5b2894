"""What a reward and its judge may not see: how varied a set of held-out images' colours is.

A policy trained on a reward that ignores colour may paint every image in the one palette that reward likes best
(the OCR world's runs did: light text on saturated magenta where the base model drew muted backgrounds of every
hue, docs/ocr-world.md). `palette` measures that on the images an evaluation already drew, so the narrowing shows
in the metrics and not only in the grids: `eval/hue_spread` falls toward 0 as the images converge on one hue, and
`eval/chroma` says how saturated they became."""

from __future__ import annotations

import numpy as np
import torch

from diffrl.utils.colour import mean_ab


def palette(images: torch.Tensor | np.ndarray) -> dict[str, float]:
    """Each image's average colour in CIELAB's a*b* plane (the mean over its pixels), then across the images:
    `hue_spread`, the circular variance of their hue angles (1 − the length of the mean unit vector: 0 when every
    image has the same hue, near 1 for hues spread round the circle), and `chroma`, their mean distance from grey
    (a*b* units: about 0 for greys, 20 for muted colours, 60 and more for saturated ones).

    `images`: [N, 3, H, W] (a video batch [N, 3, F, H, W]) floats in [0, 1], or [N, H, W, 3] uint8."""
    ab = mean_ab(images)  # [N, 2]
    angles = np.arctan2(ab[:, 1], ab[:, 0])
    resultant = np.hypot(np.cos(angles).mean(), np.sin(angles).mean())
    return {"hue_spread": float(1.0 - resultant), "chroma": float(np.hypot(ab[:, 0], ab[:, 1]).mean())}
