#!/usr/bin/env bash
# Install the carried wheels (.whl/: cp312, --no-deps; made here by fetch_wheels.sh) into /tmp/site, which every device script puts on
# PYTHONPATH. One install at a time: two jobs of one call (pretrain_demo.sh NAME=…, sweep_shapes.sh
# GPUS=…) may start together, and pip writing one --target twice at once can leave it broken.
set -euo pipefail
exec 9>/tmp/site.lock
if command -v flock >/dev/null; then flock 9; fi
# .whl-ocr/ (RapidOCR and its needs) travels only with calls that score OCR.
shopt -s nullglob
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  .whl-ocr/*.whl
