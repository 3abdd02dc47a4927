# Developer entry points. Each target sets up what it needs in ./.venv first.
VENV ?= .venv
PYTHON ?= $(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3)

.PHONY: run check test-fast test stress demo chaos chaos-ci bench bench-smoke clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e .
	touch $@

# Set up and run the daemon on a local default configuration: ./var/primary -> ./var/mirror.
run: $(VENV)/.installed
	mkdir -p var/primary var/mirror
	@echo "mirrord: drop checkpoints (*.pt) into $(CURDIR)/var/primary; copies appear in $(CURDIR)/var/mirror"
	@echo "mirrord: the command is $(VENV)/bin/mirrord (make does not put it on PATH; . $(VENV)/bin/activate does)"
	@echo "mirrord: on a terminal the daemon's banner shows the retention in force; Ctrl-C stops"
	$(VENV)/bin/mirrord run --config config/local.toml

# Test tiers (README, Tests). The parallel run: pytest-xdist workers, the `host` tests in one group.
PYTEST ?= $(PYTHON) -m pytest -q -p no:cacheprovider
PARALLEL ?= -n 4 --dist loadgroup

# The inner loop: lint, types and the unit tier (under a minute).
check:
	$(PYTHON) -m ruff format --check mirrord tests bench setup.py
	$(PYTHON) -m ruff check mirrord tests
	$(PYTHON) -m mypy mirrord
	$(PYTEST) tests/unit

# Everything that needs no container, no mount or loop device, no S3 server and no trainer library.
test-fast:
	$(PYTEST) $(PARALLEL) -m "not (host or s3 or trainers or deploy)"

# Set up everything the tests need and run them all (what CI runs).
test:
	bash .ci/run

# The whole suite three times in a row under stress-ng (2 CPU workers; STRESS_IO=1 adds 2 I/O workers); all must pass.
stress:
	bash .ci/stress

# A one-minute simulated training run against ./var/demo.
demo: $(VENV)/.installed
	$(VENV)/bin/mirrord demo

# Every chaos scenario at full scale (>= 500 kill -9 rounds, ...); rewrites tests/chaos/RESULTS.md.
# Needs the test environment (make test, or .ci/run) first. See tests/chaos/README.md.
chaos:
	$(PYTHON) -m tests.chaos --full

# The CI-sized chaos run (also part of the default pytest run).
chaos-ci:
	$(PYTHON) -m tests.chaos

# Every performance budget in one table (about 9 minutes on the build machine); bench/results/goals.md.
bench:
	$(PYTHON) -m bench

bench-smoke:
	$(PYTHON) -m bench --smoke

clean:
	rm -rf var build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache
