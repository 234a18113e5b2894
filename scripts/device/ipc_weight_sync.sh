#!/usr/bin/env bash
# miles-diffusion's CUDA IPC weight sync against /update_weights_from_tensor on one GPU (carry `.whl`):
# scripts/device/ipc_weight_sync.py (its docstring says what it sends and checks). Exit status 0: all held.
set -uo pipefail
bash scripts/device/install_wheels.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 scripts/device/ipc_weight_sync.py 2>&1 | tee "${OUT:-/tmp}/ipc_weight_sync.txt"
exit "${PIPESTATUS[0]}"
