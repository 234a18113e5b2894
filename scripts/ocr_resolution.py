"""Which image size can the OCR world use? Clean renders (`render_clean`: black on white, the largest size that
fits) of the published test split's first N quoted texts, read by PP-OCR (the `ocr` reward's reader) and by
Tesseract at page segmentation modes 6 (a block) and 7 (one line), as they are and enlarged 2×; prints and
writes, per size, each reader's exact-read fraction, mean score and seconds per image (docs/ocr-world.md).

    OMP_THREAD_LIMIT=1 .venv/bin/python scripts/ocr_resolution.py OUT.json 200 32x256 48x256 64x256
"""

import json
import sys
import time

import numpy as np
import tesserocr
from PIL import Image

from diffrl.data.ocr.prompts import test_prompts
from diffrl.data.ocr.render import render_clean
from diffrl.rewards.ocr import quoted_text, read_text, text_score
from diffrl.rewards.tesseract import tessdata_dir

out_path, n, sizes = sys.argv[1], int(sys.argv[2]), [tuple(map(int, s.split("x"))) for s in sys.argv[3:]]
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
for h, w in sizes:
    scores, secs = {k: [] for k in readers}, dict.fromkeys(readers, 0.0)
    for text in texts:
        img = render_clean(text, h, w)
        for name, read in readers.items():
            start = time.time()
            scores[name].append(text_score(read(img), text))
            secs[name] += time.time() - start
    out[f"{h}x{w}"] = {k: {"exact": round(float(np.mean([v == 1 for v in vs])), 3), "mean": round(float(np.mean(vs)), 3),
                           "s_per_image": round(secs[k] / len(vs), 3)} for k, vs in scores.items()}
    print(h, w, json.dumps(out[f"{h}x{w}"]), flush=True)
with open(out_path, "w") as f:
    json.dump({"texts": n, "sizes": out}, f, indent=1)
