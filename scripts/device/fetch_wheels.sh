#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the cp312 wheels the lent GPU machine lacks, at the versions this
# checkout's .venv runs (so the device imports what the tests here passed with). Run here once per
# fresh checkout, then carry [".whl"] in every device call; install_wheels.sh installs them there.
# The device has torch, transformers, peft, accelerate, safetensors, numpy, scipy, pillow, matplotlib,
# httpx (with anyio, h11), tqdm, onnxruntime and opencv-python-headless; what `python -m diffrl.cli.main`
# imports beyond that is below. The OCR reward's RapidOCR with its two compiled needs (18 MB) go to .whl-ocr/:
# carry [".whl", ".whl-ocr"] only for a call that scores OCR; with both, the working tree passes the 64 MiB a
# call may carry unless results/ (30 MB) is moved out of the checkout for that call.
set -euo pipefail
cd "$(dirname "$0")/../.."
pip=.venv/bin/pip
[[ -x $pip ]] || { echo "no .venv: run scripts/setup.sh (or make test) first" >&2; exit 1; }
packages=(diffusers tyro docstring-parser typeguard typing-extensions
          pydantic pydantic-core annotated-types typing-inspection
          fastapi starlette annotated-doc opentelemetry-api uvicorn httptools msgpack)
ocr_packages=(rapidocr-onnxruntime pyclipper shapely)
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
