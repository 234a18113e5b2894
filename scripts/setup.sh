#!/usr/bin/env bash
# Creates .venv (once) with the CPU torch wheel pinned, then installs diffrl in editable mode.
# Idempotent: a second call only checks that the stamp is newer than pyproject.toml.
set -euo pipefail
cd "$(dirname "$0")/.."
stamp=.venv/.diffrl-installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
# The pin matters: a bare `torch` pulls a multi-GB CUDA build; 2.13.0 is the CPU wheel on this machine kind.
.venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[test]'
touch "$stamp"
