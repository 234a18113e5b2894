"""The glyph grid: where a grid-layout OCR model draws each character of the text its prompt quotes.

The image (48 px tall, a multiple of 16 px wide) is read as three rows of cells 16 px wide: top, middle and
bottom, centred at a quarter, a half and three quarters of the height. A text of at most one row's cells is laid
out centred in the middle row; a longer one is cut between words into the two most even lines that each fit
(by character where no cut between words does) and laid out centred in the top and bottom rows. Each character
then has a cell, and a cell a fixed place in the image.

The model sees that layout twice over (`diffrl.models.demo`, `DemoConfig.glyph_grid`): one conditioning token per
cell, ahead of the prompt's tokens, holding the cell's character (nothing for an empty cell), at a position id
equal to the cell's centre in image patches, so the transformer's rotary attention relates an image patch to the
character drawn over it from the start, instead of having to discover where each letter goes. Pretraining draws
each character centred in its cell (`render.render_grid_text`); the readers read such renders of the published
test texts as well as proportional ones (docs/ocr-world.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

CELL_WIDTH = 16  # pixels; a multiple of the model's 4-pixel patches, so cell centres fall on whole patch ids
HEIGHT = 48  # the only height the grid is laid out for (the OCR world's)
FONT_SIZE = 22  # Pillow's built-in font: glyphs up to ~16 px wide, read as well as proportional text (docs)
BOLD_PIXELS = 1  # each glyph drawn again 1 px to the right: vertical strokes 2 px wide, which a small pixel-space
                 # model draws more easily than 1-px ones (the readers read them as well: docs/ocr-world.md)
ROWS = 3  # top, middle, bottom


@dataclass(frozen=True)
class GlyphGrid:
    width: int

    def __post_init__(self):
        if self.width < CELL_WIDTH or self.width % CELL_WIDTH:
            raise ValueError(f"a glyph grid needs a width that is a multiple of {CELL_WIDTH} px, got {self.width}")

    @property
    def cells(self) -> int:
        """Cells in one row: the most characters one line holds."""
        return self.width // CELL_WIDTH

    @property
    def slots(self) -> int:
        """Cells in the grid: the conditioning tokens the layout adds."""
        return ROWS * self.cells

    def centre(self, slot: int) -> tuple[float, float]:
        """(y, x) in pixels of a cell's centre; slots run row by row, left to right."""
        row, column = divmod(slot, self.cells)
        return HEIGHT * (row + 1) / 4, CELL_WIDTH * column + CELL_WIDTH / 2

    def lines(self, text: str) -> list[str]:
        """One line, or the two most even lines cut between words that each fit, or cut by character (a text
        longer than two lines loses its end)."""
        if len(text) <= self.cells:
            return [text]
        words = text.split(" ")
        cuts = [(" ".join(words[:i]), " ".join(words[i:])) for i in range(1, len(words))]
        fitting = [(a, b) for a, b in cuts if len(a) <= self.cells and len(b) <= self.cells]
        if fitting:
            return list(min(fitting, key=lambda pair: abs(len(pair[0]) - len(pair[1]))))
        return [text[:self.cells], text[self.cells:2 * self.cells]]

    def layout(self, text: str | None) -> list[str | None]:
        """Each slot's character (a space included), None for an empty cell; no text, an empty grid."""
        grid: list[str | None] = [None] * self.slots
        if not text:
            return grid
        lines = self.lines(text)
        rows = (1,) if len(lines) == 1 else (0, 2)
        for line, row in zip(lines, rows, strict=True):
            start = row * self.cells + (self.cells - len(line)) // 2
            grid[start:start + len(line)] = list(line)
        return grid

    def placed(self, text: str | None) -> list[tuple[str, float, float]]:
        """(character, y, x) of every non-space character of the layout."""
        return [(char, *self.centre(slot)) for slot, char in enumerate(self.layout(text))
                if char is not None and char != " "]

    def patch_centres(self, patch: int) -> Sequence[tuple[float, float]]:
        """Each slot's centre in image patches: the (h, w) position ids of its conditioning token."""
        return [(y / patch - 0.5, x / patch - 0.5) for y, x in map(self.centre, range(self.slots))]
