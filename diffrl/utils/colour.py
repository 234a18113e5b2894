"""Colour measures of images that a reward of the text cannot see: CIELAB, and each image's average colour in its
a*b* plane (hue and chroma), which `evaluation/diversity.py` and the `diverse@` group reward read."""

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


def mean_ab(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """Each image's average colour in CIELAB's a*b* plane, `[N, 2]` (its hue is the angle, its chroma the length).
    `images`: [N, 3, H, W] (a video batch [N, 3, F, H, W]) floats in [0, 1], or [N, H, W, 3] uint8."""
    return np.stack([srgb_to_lab(_pixels(image))[:, 1:].mean(axis=0) for image in images]).reshape(-1, 2)
