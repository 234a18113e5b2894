"""The OCR world (docs/ocr-world.md): the judge and the reward read clean renders of the published test texts
alike and both mark corrupted renders down; renders are deterministic; the tokenizer spells the quoted text
character by character; no held-out text is ever generated; a tiny OCR demo model pretrains."""

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter

from diffrl.data.ocr.prompts import TRAIN_FILE, TRAIN_PROMPTS, TRAIN_SEED, sample_prompt, training_prompts
# Aliased: pytest would collect functions named test_* imported into a test module as tests.
from diffrl.data.ocr.prompts import test_prompts as held_out_prompts
from diffrl.data.ocr.prompts import test_texts as held_out_texts
from diffrl.data.ocr.phrases import normalized
from diffrl.data.ocr.render import render_clean, render_text
from diffrl.models.random_checkpoints.demo import ocr, tokenizer_for
from diffrl.models.random_checkpoints.tokenizers import SPACE_IN_QUOTES
from diffrl.rewards import ocr as ppocr, tesseract
from diffrl.rewards.ocr import quoted_text

HEIGHT, WIDTH = ocr().height, ocr().width
READERS = {"ocr": ppocr.read_text, "tesseract": tesseract.read_text}


def scores(images, texts):
    pytest.importorskip("rapidocr_onnxruntime")  # both come with the test extra: pip install -e '.[test]'
    pytest.importorskip("tesserocr")
    return {name: [ppocr.text_score(read(np.asarray(im)), t) for im, t in zip(images, texts, strict=True)]
            for name, read in READERS.items()}


def test_both_readers_read_clean_renders_of_test_texts():
    """20 texts spread over the split (every 50th); docs/ocr-world.md has the 200-text measurement."""
    texts = [quoted_text(p) for p in held_out_prompts()[::50]]
    for name, values in scores([render_clean(t, HEIGHT, WIDTH) for t in texts], texts).items():
        assert np.mean([v == 1 for v in values]) >= 0.95, (name, values)


def _cut(image):
    out = image.copy()
    out[:, WIDTH // 2:] = out[0, 0]  # the right half painted over with the background
    return out


def test_corrupted_renders_score_lower_on_both():
    texts = ["Spring Collection 2024", "Forever Yours", "Try Our New Burger", "Step Goal Achieved"]
    clean = scores([render_clean(t, HEIGHT, WIDTH) for t in texts], texts)
    corrupted = {
        "cut": [_cut(render_clean(t, HEIGHT, WIDTH)) for t in texts],
        "misspelled": [render_clean(t.replace("e", "a").replace("o", "u"), HEIGHT, WIDTH) for t in texts],
        "blurred": [np.asarray(Image.fromarray(render_clean(t, HEIGHT, WIDTH)).filter(ImageFilter.GaussianBlur(3)))
                    for t in texts],
    }
    for kind, images in corrupted.items():
        for name, values in scores(images, texts).items():
            assert np.mean(values) < np.mean(clean[name]) - 0.2, (kind, name, values, clean[name])


def _reader_threads_in_a_worker(_):
    torch.set_num_threads(1)  # what a reward worker sets (diffrl.rewards.workers)
    sessions = (ppocr._reader().text_det.infer.session, ppocr._reader().text_rec.session.session)
    return [s.get_session_options().intra_op_num_threads for s in sessions]


def test_the_ocr_reader_takes_one_thread_in_a_reward_worker():
    """ONNX Runtime would take a thread per core in every worker of a pool: the reader follows torch's threads."""
    import multiprocessing

    pytest.importorskip("rapidocr_onnxruntime")
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        assert pool.map(_reader_threads_in_a_worker, [0]) == [[1, 1]]


def test_renders_are_deterministic_by_seed():
    first = render_text("Open 24 Hours", np.random.default_rng(3), HEIGHT, WIDTH)
    again = render_text("Open 24 Hours", np.random.default_rng(3), HEIGHT, WIDTH)
    other = render_text("Open 24 Hours", np.random.default_rng(4), HEIGHT, WIDTH)
    assert first.shape == (HEIGHT, WIDTH, 3) and first.dtype == np.uint8
    assert np.array_equal(first, again) and not np.array_equal(first, other)


def test_the_tokenizer_spells_the_quoted_text_by_character():
    tokenizer = tokenizer_for("ocr", ocr().max_text_len)
    for prompt in held_out_prompts()[:300]:
        text = quoted_text(prompt)
        if not text.isascii():
            continue
        ids = tokenizer(prompt)["input_ids"]
        assert len(ids) <= ocr().max_text_len
        tokens = tokenizer.convert_ids_to_tokens(ids)
        start = tokens.index('"') + 1
        spelled = tokens[start: start + len(text)]
        assert spelled == [SPACE_IN_QUOTES if c == " " else c for c in text], prompt
        assert tokens[start + len(text)] == '"'
        assert "".join(spelled).replace(SPACE_IN_QUOTES, " ") == text


def test_no_test_text_is_ever_generated():
    held_out = held_out_texts()
    rng = np.random.default_rng(0)
    for _ in range(3000):
        prompt, text = sample_prompt(rng)
        assert normalized(text) not in held_out and quoted_text(prompt) == text
    shipped = TRAIN_FILE.read_text(encoding="utf-8").splitlines()
    assert shipped == training_prompts(TRAIN_SEED, TRAIN_PROMPTS)
    assert not {normalized(quoted_text(p)) for p in shipped} & held_out
    assert len(held_out_prompts()) == 1018


def test_a_tiny_ocr_model_pretrains(tmp_path):
    from diffrl.cli.main import main as cli_main
    from diffrl.models.demo import DemoFamily

    out = tmp_path / "run"
    assert cli_main(["pretrain", "--world", "ocr", "--patch-size", "8", "--output-dir", str(out), "--steps", "2",
                     "--batch-size", "2", "--num-workers", "0", "--checkpoint-every", "2", "--sample-steps", "1", "--log-every", "1",
                     "--num-attention-heads", "2", "--attention-head-dim", "96", "--num-layers", "1",
                     "--num-single-layers", "1", "--text-d-model", "16"]) == 0
    model = DemoFamily.load(out / "final")
    assert model.default_size() == (HEIGHT, WIDTH) and (out / "samples" / "step-0000002.png").is_file()
    assert model.prepare_ids().shape[0] == (HEIGHT // 8) * (WIDTH // 8)  # --patch-size 8: 6 x 32 tokens
    # A patch of more pixel values (3 x 8 x 8 = 192) than transformer channels (2 x 8) is refused before anything runs.
    narrow = tmp_path / "narrow"
    assert cli_main(["pretrain", "--world", "ocr", "--patch-size", "8", "--output-dir", str(narrow), "--steps", "1",
                     "--num-attention-heads", "2", "--attention-head-dim", "8"]) == 2
    assert not narrow.exists()
    # A shapes model is refused as the start of an OCR pretraining, naming the flag.
    assert cli_main(["pretrain", "--world", "shapes", "--init-from", str(out / "final"),
                     "--output-dir", str(tmp_path / "other"), "--steps", "1"]) == 2


@pytest.mark.parametrize("name", ["ocr-nft", "ocr-grpo"])
def test_ocr_recipes_train_the_ocr_model_judged_by_tesseract(name):
    from diffrl.data.ocr.prompts import PROMPT_DIR
    from diffrl.models.demo import SHIPPED_OCR_MODEL
    from diffrl.recipes import recipe_config

    for device in ("cpu", "cuda"):
        cfg = recipe_config(name, device)
        cfg.check()
        assert (cfg.model.model_path, cfg.task.prompt_data) == (SHIPPED_OCR_MODEL, PROMPT_DIR)
        assert (cfg.task.reward, cfg.task.eval_reward) == ("ocr", "tesseract")
