# Two entry points (README): `make demo` runs the main job, `make test` runs the tests.
# Both set up .venv on first use (scripts/setup.sh).
PY := .venv/bin/python

.PHONY: setup demo test test-all
setup:
	@bash scripts/setup.sh

demo: setup
	$(PY) -m diffrl.cli.main train --recipe shapes-nft

# Two workers (pytest-xdist): most of the suite's time is processes starting and single-threaded Python. On this
# workplace's 2-core machine, 2026-12-06, a fresh clone's `bash .ci/run` ran 1,393 tests in 634 s and, an hour later,
# in 805 s on two workers (the machine is shared); one worker had taken 946 s for the 1,255 tests of that morning.
# That evening 1,461 tests took 792 s (924 s with the setup).
test: setup
	$(PY) -m pytest -n 2

test-all: setup
	$(PY) -m pytest -n 2 -m "slow or not slow"
