"""`eval/hue_spread` and `eval/chroma`: how varied and how saturated the held-out images' colours are, which no
reward of the text may see; and `grid_cells`, which reads a saved grid's images back exactly (to measure grids that
came back from a GPU)."""

import numpy as np
import pytest
import torch

from diffrl.evaluation.diversity import palette
from diffrl.utils.colour import srgb_to_lab
from diffrl.utils.images import grid_cells, save_grid, to_uint8


def test_lab_matches_the_published_d65_values_of_the_primaries_and_greys():
    """sRGB's primaries in CIELAB under its own D65 white, as colour references tabulate them (e.g. Lindbloom's
    calculator): red (53.24, 80.09, 67.20), green (87.73, −86.18, 83.18), blue (32.30, 79.19, −107.86)."""
    primaries = np.array([[1.0, 0, 0], [0, 1.0, 0], [0, 0, 1.0]])
    published = np.array([[53.24, 80.09, 67.20], [87.73, -86.18, 83.18], [32.30, 79.19, -107.86]])
    assert np.abs(srgb_to_lab(primaries) - published).max() < 0.05
    greys = srgb_to_lab(np.array([[1.0, 1.0, 1.0], [0.5, 0.5, 0.5], [0.0, 0.0, 0.0]]))
    assert np.allclose(greys[:, 0], [100.0, 53.39, 0.0], atol=0.05) and np.abs(greys[:, 1:]).max() < 1e-9


def _scenes(paper: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """The same kind of light glyph strokes on each image's paper colour ([N, 3])."""
    text = (torch.rand(len(paper), 1, 24, 96, generator=torch.Generator().manual_seed(seed)) > 0.8).float()
    return paper.view(-1, 3, 1, 1) * (1 - text) + 0.95 * text


def test_one_hue_spreads_nothing_and_hues_round_the_circle_spread_most():
    magenta = torch.tensor([0.75, 0.15, 0.65]).expand(16, 3)
    one = palette(_scenes(magenta))
    assert one["hue_spread"] == pytest.approx(0.0, abs=1e-9) and one["chroma"] > 40
    wheel = torch.tensor([[0.7, 0.3, 0.3], [0.3, 0.7, 0.3], [0.3, 0.3, 0.7], [0.7, 0.7, 0.3], [0.3, 0.7, 0.7],
                          [0.7, 0.3, 0.7]]).repeat(3, 1)
    assert palette(_scenes(wheel))["hue_spread"] > 0.6


def test_muted_papers_of_every_hue_spread_more_than_a_saturated_palette():
    """The OCR world's runs in small: muted backgrounds of random hues, against one saturated hue with a little jitter."""
    g = torch.Generator().manual_seed(1)
    muted = 0.55 + 0.15 * (torch.rand(32, 3, generator=g) - 0.5)
    saturated = torch.tensor([0.8, 0.1, 0.75]) + 0.05 * torch.rand(32, 3, generator=g)
    base, trained = palette(_scenes(muted)), palette(_scenes(saturated))
    assert base["hue_spread"] > 0.4 > 0.05 > trained["hue_spread"]
    assert trained["chroma"] > 3 * base["chroma"]


def test_uint8_images_videos_and_floats_agree():
    images = torch.rand(4, 3, 6, 10, generator=torch.Generator().manual_seed(2))
    quantized = torch.from_numpy(to_uint8(images)).permute(0, 3, 1, 2).float() / 255
    for key, value in palette(to_uint8(images)).items():
        assert value == pytest.approx(palette(quantized)[key], abs=1e-6)
    video = images.unsqueeze(2).expand(4, 3, 5, 6, 10)  # every frame the same: the images' palette
    for key, value in palette(video).items():
        assert value == pytest.approx(palette(images)[key], abs=1e-9)


def test_grid_cells_reads_back_exactly_what_save_grid_drew(tmp_path):
    images = torch.rand(11, 3, 12, 20, generator=torch.Generator().manual_seed(3))
    path = save_grid(images, tmp_path / "grid.png", ncols=4, captions=[f"image {k}" for k in range(11)],
                     caption_lines=3)
    cells = grid_cells(path, n=11, ncols=4, height=12, width=20, caption_lines=3)
    assert np.array_equal(cells, to_uint8(images))
    with pytest.raises(ValueError, match="no cell 12"):
        grid_cells(path, n=13, ncols=4, height=12, width=20, caption_lines=3)
