#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with the cp312 wheels the lent GPU machine lacks, at the versions this
# checkout's .venv runs (so the device imports what the tests here passed with). Run here once per
# fresh checkout, then carry [".whl"] in every device call; install_wheels.sh installs them there.
# The device has torch, transformers, peft, accelerate, safetensors, numpy, scipy, pillow, matplotlib,
# httpx (with anyio, h11), tqdm, onnxruntime and opencv-python-headless; what `python -m diffrl.cli.main`
# imports beyond that is below, and the OCR reward's RapidOCR with its two compiled needs.
set -euo pipefail
cd "$(dirname "$0")/../.."
pip=.venv/bin/pip
[[ -x $pip ]] || { echo "no .venv: run scripts/setup.sh (or make test) first" >&2; exit 1; }
packages=(diffusers tyro docstring-parser typeguard typing-extensions
          pydantic pydantic-core annotated-types typing-inspection
          fastapi starlette annotated-doc opentelemetry-api uvicorn msgpack
          rapidocr-onnxruntime pyclipper shapely)
pins=()
for p in "${packages[@]}"; do
  v=$($pip show "$p" 2>/dev/null | sed -n 's/^Version: //p')
  [[ -n $v ]] || { echo "$p is not installed in .venv" >&2; exit 1; }
  pins+=("$p==$v")
done
mkdir -p .whl
$pip download -q --no-deps --only-binary=:all: --dest .whl --python-version 3.12 --implementation cp --abi cp312 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform any "${pins[@]}"
ls .whl && du -sh .whl
