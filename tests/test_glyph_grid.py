"""The OCR world's glyph grid (docs/ocr-world.md, "The glyph grid"): the layout of a quoted text on the grid, renders
both readers read, and a grid model whose conditioning holds one token per cell at the cell's place in the image,
through pretraining, saving, loading and the engine."""

import numpy as np
import pytest
import torch

from diffrl.data.ocr.glyph_grid import GlyphGrid
from diffrl.data.ocr.prompts import test_prompts as held_out_prompts  # aliased: not a test
from diffrl.data.ocr.render import render_grid, render_grid_text
from diffrl.rewards.ocr import quoted_text

WIDTH = 256
GRID = GlyphGrid(WIDTH)


def rows(layout):
    cells = GRID.cells
    return ["".join(c or "." for c in layout[r * cells:(r + 1) * cells]) for r in range(3)]


def test_a_short_text_is_centred_in_the_middle_row():
    assert rows(GRID.layout("Open Late")) == ["." * 16, "...Open Late....", "." * 16]


def test_a_long_text_is_cut_between_words_into_the_most_even_lines():
    assert GRID.lines("Spring Collection 2024") == ["Spring", "Collection 2024"]
    assert rows(GRID.layout("Trespassers Will Be Jousted")) == [
        "..Trespassers...", "." * 16, "Will Be Jousted."]
    # One word longer than a line: cut by character; past two lines the end is lost.
    assert GRID.lines("Supercalifragilistic") == ["Supercalifragili", "stic"]
    assert GRID.lines("x" * 40) == ["x" * 16, "x" * 16]


def test_every_published_test_text_keeps_its_characters_in_order():
    for prompt in held_out_prompts():
        text = quoted_text(prompt)
        laid = "".join(c for c in GRID.layout(text) if c is not None)
        assert laid.replace(" ", "") == text.replace(" ", ""), text  # the cut between lines drops one space


def test_no_text_is_an_empty_grid_and_odd_widths_are_refused():
    assert GRID.layout(None) == GRID.layout("") == [None] * 48
    with pytest.raises(ValueError, match="multiple of 16"):
        GlyphGrid(250)


def test_cell_centres_are_where_the_renderer_draws():
    image = render_grid("I", WIDTH)  # one narrow letter in the middle row's cell 7
    ink = np.argwhere(image.min(axis=-1) < 128)
    (y, x), = [GRID.centre(GRID.cells + 7)]
    assert abs(ink[:, 0].mean() - y) < 2 and abs(ink[:, 1].mean() - x) < 2


def test_each_glyph_drawn_once_and_placed_is_the_glyph_drawn_in_place():
    """`render_grid` places each glyph's cached coverage; drawing every glyph in place with Pillow (ink blended over
    the background, twice for the bold pixel) gives the same image up to Pillow's rounding of each blend."""
    from PIL import Image, ImageDraw

    from diffrl.data.ocr.glyph_grid import BOLD_PIXELS, FONT_SIZE, HEIGHT
    from diffrl.data.ocr.render import BUILTIN, load_font

    def in_place(text, ink, background):
        image = Image.fromarray(background)
        draw = ImageDraw.Draw(image)
        font = load_font(BUILTIN, FONT_SIZE)
        cap_top = font.getbbox("H", anchor="ls")[1]
        for char, y, x in GlyphGrid(256).placed(text):
            for dx in range(BOLD_PIXELS + 1):
                draw.text((x + dx - BOLD_PIXELS / 2, y - cap_top / 2), char, font=font, fill=ink, anchor="ms")
        return np.asarray(image)

    rng = np.random.default_rng(0)
    for text in [quoted_text(p) for p in held_out_prompts()[::25]] + ["WWWWWWWWWWWWWWWW", "g,j;y|Q@%&"]:
        ink = tuple(int(c) for c in rng.integers(0, 256, 3))
        background = rng.integers(0, 256, (HEIGHT, 256, 3), dtype=np.uint8)
        ours, pillow = render_grid(text, 256, ink, background).astype(int), in_place(text, ink, background).astype(int)
        assert np.abs(ours - pillow).max() <= 1, text


def test_both_readers_read_grid_renders_of_test_texts():
    """The 20 texts of the proportional renders' test (every 50th); measured on 40: PP-OCR 0.95, Tesseract 0.975
    exact (docs/ocr-world.md)."""
    pytest.importorskip("rapidocr_onnxruntime")
    pytest.importorskip("tesserocr")
    from diffrl.rewards import ocr as ppocr, tesseract

    texts = [quoted_text(p) for p in held_out_prompts()[::50]]
    for read in (ppocr.read_text, tesseract.read_text):
        exact = [ppocr.text_score(read(render_grid(t, WIDTH)), t) == 1 for t in texts]
        assert np.mean(exact) >= 0.9, (read.__module__, exact)


def test_varied_grid_renders_keep_the_layout_and_follow_the_seed():
    a, b = (render_grid_text("Fresh Eggs", np.random.default_rng(3), WIDTH) for _ in range(2))
    assert np.array_equal(a, b) and a.shape == (48, WIDTH, 3)
    other = render_grid_text("Fresh Eggs", np.random.default_rng(4), WIDTH)
    assert not np.array_equal(a, other)


@pytest.fixture(scope="module")
def grid_model(tmp_path_factory):
    from diffrl.cli.main import main as cli_main
    from diffrl.models.demo import DemoFamily

    out = tmp_path_factory.mktemp("grid") / "run"
    assert cli_main(["pretrain", "--world", "ocr", "--glyph-grid", "--output-dir", str(out), "--steps", "2",
                     "--batch-size", "2", "--num-workers", "0", "--checkpoint-every", "2", "--sample-steps", "1",
                     "--num-attention-heads", "2", "--attention-head-dim", "8", "--num-layers", "1",
                     "--num-single-layers", "1", "--text-d-model", "16"]) == 0
    return out, DemoFamily.load(out / "final")


def test_a_grid_model_conditions_on_one_token_per_cell(grid_model):
    _, family = grid_model
    assert family.config.glyph_grid and family.text_length == 48 + family.config.max_text_len
    ids, mask = family.tokenize(['A neon sign that says "Open Late" in bold letters.', ""])
    vocab = family.tokenizer.get_vocab()
    expected = [0 if c is None else vocab["▁" if c == " " else c] for c in GRID.layout("Open Late")]
    assert ids[0, :48].tolist() == expected and mask[0, :48].tolist() == [int(c != 0) for c in expected]
    assert mask[1, :48].sum() == 0  # the empty prompt (CFG's unconditional one): every cell empty
    cond = family.encode_prompts(['a sign that says "Hi"'])
    assert cond.embeds.shape[1] == len(cond.ids) == family.text_length
    centres = torch.tensor(GRID.patch_centres(family.config.patch_size))
    assert torch.equal(cond.ids[:48, 1:3], centres) and not cond.ids[:48, [0, 3]].any()
    assert torch.equal(cond.ids[48:, 3], torch.arange(family.config.max_text_len).float())


def test_a_grid_model_samples_through_the_engine_with_cfg(grid_model):
    from diffrl.engine.engine import Engine, EngineConfig
    from diffrl.engine.protocol import RolloutRequest

    _, family = grid_model
    engine = Engine(family, EngineConfig())
    outputs = engine.generate(RolloutRequest(prompt='a sign that says "Hi"', seed=0, num_outputs_per_prompt=2,
                                             num_inference_steps=2, guidance_scale=3.0, width=WIDTH, height=48))
    assert len(outputs) == 2 and outputs[0].generated_output.shape[-2:] == (48, WIDTH)
    assert torch.isfinite(outputs[0].generated_output).all()


def test_glyph_grid_flags_are_refused_where_they_do_not_apply(grid_model, tmp_path):
    from diffrl.cli.main import main as cli_main

    assert cli_main(["pretrain", "--world", "shapes", "--glyph-grid", "--output-dir", str(tmp_path / "a"),
                     "--steps", "1"]) == 2
    plain = tmp_path / "plain"
    assert cli_main(["pretrain", "--world", "ocr", "--output-dir", str(plain), "--steps", "1", "--batch-size", "2",
                     "--num-workers", "0", "--sample-steps", "1", "--num-attention-heads", "2",
                     "--attention-head-dim", "8", "--num-layers", "1", "--num-single-layers", "1",
                     "--text-d-model", "16"]) == 0
    assert cli_main(["pretrain", "--world", "ocr", "--glyph-grid", "--init-from", str(plain / "final"),
                     "--output-dir", str(tmp_path / "b"), "--steps", "1"]) == 2


def test_flow_grpo_on_a_grid_model_replays_its_rollout_exactly(grid_model, tmp_path):
    """The cell tokens travel with the rollout and come back in training as they went out."""
    import json

    from diffrl.cli.main import main as cli_main
    from diffrl.data.ocr.prompts import PROMPT_DIR

    out = tmp_path / "grpo"
    path, _ = grid_model
    assert cli_main(["train", "--model-path", str(path / "final"), "--diffusion-model-family", "demo",
                     "--prompt-data", str(PROMPT_DIR), "--reward", "jpeg_compressibility",
                     "--loss-type", "flow_grpo", "--num-rollout", "2", "--rollout-batch-size", "2",
                     "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--num-steps-per-rollout", "1",
                     "--diffusion-num-steps", "3", "--diffusion-guidance-scale", "2", "--eval-interval", "2",
                     "--eval-num-prompts", "2", "--output-dir", str(out)]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    diffs = [row["train/log_prob_mean_abs_diff"] for row in rows if "train/log_prob_mean_abs_diff" in row]
    assert len(diffs) == 2 and all(d == 0.0 for d in diffs)
