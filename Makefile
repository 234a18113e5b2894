# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv on first use (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo test test-all
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m diffrl.cli.main train --recipe shapes-nft

# Two workers (pytest-xdist): most of the suite's time is processes starting and single-threaded Python, so two
# workers on CI's two cores take about 0.8x of one (715 s against about 900 s, 2026-12-06, this 2-core machine).
test: setup
	$(PY) -m pytest -n 2

test-all: setup
	$(PY) -m pytest -n 2 -m "slow or not slow"
