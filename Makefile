# The two commands of the README, and a few helpers.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install slurm browser up lint typecheck test test-fast compose-test bench tiny-model clean docs

install:
	@scripts/install.sh

up: install
	@$(PY) -m loopline.common.local.up

# Real Slurm daemons for the training tests (Debian packages; needs root or sudo). Where that cannot
# work (a laptop), the Slurm tests skip unless LOOPLINE_REQUIRE_SLURM=1, which .ci/run sets.
slurm:
	@scripts/slurm/install.sh || echo "Slurm could not be installed: its tests will be skipped"

# Debian's headless Chromium for the browser tests (tests/support/browser.py; needs root or sudo).
# Where that cannot work, those tests skip, unless CI=true (.ci/run), where they fail.
browser:
	@scripts/browser/install.sh || echo "Chromium could not be installed: the browser tests will be skipped"

# Ruff's rules and mypy's settings are in pyproject.toml; `make test` runs both before pytest.
lint: install
	@$(VENV)/bin/ruff check libs services ml cli bench deploy tests scripts

typecheck: install
	@$(VENV)/bin/mypy

# The whole suite, as two pytest processes at once (scripts/test_lanes.py says why): the tests that
# start stacks, and the rest. `$(PY) -m pytest` runs it as one.
test: install slurm browser lint typecheck
	@$(PY) scripts/test_lanes.py $(PYTEST_ARGS)

# The edit loop: every test but the slow tiers (tests/support/tiers.py; README "Tests"), in a few
# minutes; no Slurm install, lint or type check. CI runs `make test`.
FAST := not (stack or slurm or chaos or soak or slow or smollm2 or postgres or compose)
test-fast: install
	@$(PY) -m pytest -m "$(FAST)" $(PYTEST_ARGS)

# docker-compose.yml for real: every image built with podman from Debian's packages (no registry),
# the stack up, a request served, a job trained, down and up again (tests/compose; root for podman;
# about 15 minutes the first time). Not part of `make test`.
compose-test: install
	@$(PY) -m pytest -m compose -s -p no:cacheprovider tests/compose $(PYTEST_ARGS)

bench: install
	@$(PY) bench/serving.py
	@$(PY) bench/training.py

# The tiny random test model (seconds to build); then: LOOPLINE_MODEL=.loopline/models/tiny make up
tiny-model: install
	@$(PY) -m loopline.ml.models.tiny --out .loopline/models/tiny

clean:
	rm -rf .loopline

# The README's configuration table, from the settings classes' field descriptions
# (tests/common/test_readme.py fails when it is out of date).
docs:
	@$(PY) -m loopline.common.config.settings_doc --write
