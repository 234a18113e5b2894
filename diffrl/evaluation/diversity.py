"""What a reward and its judge may not see: how varied a set of held-out images' colours is.

A policy trained on a reward that ignores colour may paint every image in the one palette that reward likes best
(the OCR world's runs did: light text on saturated magenta where the base model drew muted backgrounds of every
hue, docs/ocr-world.md). `palette` measures that on the images an evaluation already drew, so the narrowing shows
in the metrics and not only in the grids: `eval/hue_spread` falls toward 0 as the images converge on one hue, and
`eval/chroma` says how saturated they became."""

from __future__ import annotations

import numpy as np
import torch

_MAX_PIXELS = 1 << 12  # per image: an evenly strided subset of larger ones (an average colour needs no more)
_SRGB_TO_XYZ = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]])
_D65_WHITE = np.array([0.9505, 1.0, 1.089])


def srgb_to_lab(rgb: np.ndarray) -> np.ndarray:
    """CIELAB (D65) of sRGB colours `[..., 3]` in [0, 1]."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = linear @ _SRGB_TO_XYZ.T / _D65_WHITE
    f = np.where(xyz > 216 / 24389, np.cbrt(xyz), (24389 / 27 * xyz + 16) / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], axis=-1)


def _pixels(image) -> np.ndarray:
    """One image's (or video's) pixels as [P, 3] floats in [0, 1], at most `_MAX_PIXELS` of them, evenly strided."""
    if isinstance(image, np.ndarray):  # [H, W, 3] uint8
        flat = image.reshape(-1, 3)
        stride = max(1, len(flat) // _MAX_PIXELS)
        return flat[::stride].astype(np.float64) / 255.0
    flat = image.detach().flatten(1).T  # [3, …] floats -> [P, 3]
    stride = max(1, len(flat) // _MAX_PIXELS)
    return flat[::stride].double().clamp(0, 1).cpu().numpy()


def palette(images: torch.Tensor | np.ndarray) -> dict[str, float]:
    """Each image's average colour in CIELAB's a*b* plane (the mean over its pixels), then across the images:
    `hue_spread`, the circular variance of their hue angles (1 − the length of the mean unit vector: 0 when every
    image has the same hue, near 1 for hues spread round the circle), and `chroma`, their mean distance from grey
    (a*b* units: about 0 for greys, 20 for muted colours, 60 and more for saturated ones).

    `images`: [N, 3, H, W] (a video batch [N, 3, F, H, W]) floats in [0, 1], or [N, H, W, 3] uint8."""
    ab = np.stack([srgb_to_lab(_pixels(image))[:, 1:].mean(axis=0) for image in images])  # [N, 2]
    angles = np.arctan2(ab[:, 1], ab[:, 0])
    resultant = np.hypot(np.cos(angles).mean(), np.sin(angles).mean())
    return {"hue_spread": float(1.0 - resultant), "chroma": float(np.hypot(ab[:, 0], ab[:, 1]).mean())}
