# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv on first use (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo test test-all
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m diffrl.cli.main train --recipe shapes-nft

test: setup
	$(PY) -m pytest

test-all: setup
	$(PY) -m pytest -m "slow or not slow"
