#!/usr/bin/env bash
# Engine microgroup benchmark on the lent GPU (carry `.whl`: diffusers, fastapi, uvicorn, pydantic, … as cp312 wheels).
set -euo pipefail
bash scripts/device/install_wheels.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 benchmarks/engine_microgroups.py --model demo --dtype bfloat16 --repeats 3 --out "$OUT/engine_demo_h200.json" 2>&1 | grep -v "Loading\|keep in float32\|kept in float32" | grep "images/s"
python3 benchmarks/engine_microgroups.py --model sd35m-compute --dtype bfloat16 --repeats ${REPEATS:-1} --out "$OUT/engine_sd35m_h200.json" 2>&1 | grep -v "Loading\|kept in float32" | tail -80
