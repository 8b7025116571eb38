# The two commands of the README, and a few helpers.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install up test bench tiny-model clean

install:
	@scripts/install.sh

up: install
	@$(PY) -m loopline.common.up

test: install
	@$(PY) -m pytest $(PYTEST_ARGS)

bench: install
	@$(PY) bench/serving.py

# The tiny random test model (seconds to build); then: LOOPLINE_MODEL=.loopline/models/tiny make up
tiny-model: install
	@$(PY) -m loopline.ml.models.tiny --out .loopline/models/tiny

clean:
	rm -rf .loopline
