"""Which image size can the OCR world use? Clean renders (`render_clean`: black on white, the largest size that
fits) of the published test split's first N quoted texts, read by PP-OCR (the `ocr` reward's reader) and by
Tesseract at page segmentation modes 6 (a block) and 7 (one line), as they are and enlarged 2×; prints and
writes, per size, each reader's exact-read fraction, mean score and seconds per image (docs/ocr-world.md).
A size spelled `grid:48x256` renders on the glyph grid instead (`render_grid`: each character centred in its cell).

    OMP_THREAD_LIMIT=1 .venv/bin/python scripts/ocr_resolution.py OUT.json 200 32x256 48x256 64x256
    OMP_THREAD_LIMIT=1 .venv/bin/python scripts/ocr_resolution.py OUT.json 200 grid:48x256
"""

import json
import sys
import time

import numpy as np
import tesserocr
from PIL import Image

from diffrl.data.ocr.prompts import test_prompts
from diffrl.data.ocr.render import render_clean, render_grid
from diffrl.rewards.ocr import quoted_text, read_text, text_score
from diffrl.rewards.tesseract import tessdata_dir

out_path, n, sizes = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
texts = [quoted_text(p) for p in test_prompts()][:n]
apis = {psm: tesserocr.PyTessBaseAPI(path=str(tessdata_dir()), lang="eng", psm=psm) for psm in (6, 7)}


def tesseract(img, psm, scale):
    im = Image.fromarray(img)
    if scale != 1:
        im = im.resize((im.width * scale, im.height * scale), Image.LANCZOS)
    apis[psm].SetImage(im)
    return apis[psm].GetUTF8Text()


readers = {"ppocr": read_text, **{f"tesseract psm{psm} x{sc}": (lambda img, psm=psm, sc=sc: tesseract(img, psm, sc))
                                  for psm in (6, 7) for sc in (1, 2)}}
out = {}
for size in sizes:
    layout, _, hw = size.rpartition(":")
    h, w = map(int, hw.split("x"))
    if layout == "grid" and h != 48:
        raise SystemExit(f"{size}: the glyph grid is laid out for 48-pixel-tall images only")
    scores, secs = {k: [] for k in readers}, dict.fromkeys(readers, 0.0)
    for text in texts:
        img = render_grid(text, w) if layout == "grid" else render_clean(text, h, w)
        for name, read in readers.items():
            start = time.time()
            scores[name].append(text_score(read(img), text))
            secs[name] += time.time() - start
    out[size] = {k: {"exact": round(float(np.mean([v == 1 for v in vs])), 3), "mean": round(float(np.mean(vs)), 3),
                           "s_per_image": round(secs[k] / len(vs), 3)} for k, vs in scores.items()}
    print(size, json.dumps(out[size]), flush=True)
with open(out_path, "w") as f:
    json.dump({"texts": n, "sizes": out}, f, indent=1)
