# Quickstart: `make run` (service on the embedded model) and `make test` (whole suite).
# Flags for the server: `make run ARGS="--port 50052 --decode-workers 2"`.
VENV ?= .venv
PY := $(VENV)/bin/python
export RAY_AUTH_MODE ?= disabled
export RAY_USAGE_STATS_ENABLED ?= 0

.PHONY: setup model run test test-slow soak soak-stop style lint protos flags-doc clean

setup: $(VENV)/.installed

# scripts/install.sh: torch pinned to 2.13.0 (the pin fixes the version, not the build:
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu make setup installs the CPU build),
# pdserve with its test tools, the embedded model's package, then bytecode compiled on
# every core. The image (deploy/Dockerfile) is built by the same script.
$(VENV)/.installed: pyproject.toml scripts/install.sh
	scripts/install.sh $(VENV)
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
# while streaming, the planner, several Ray nodes), about 5 minutes; CI runs them after
# `make test`.
test-slow: model
	$(PY) -m pytest -q -m slow

# Ten minutes of Poisson load on a 2P2D CPU service while workers are killed and the
# decode pool grows and shrinks, then the only decode worker killed with streams on it
# and a SIGTERM to the service's process group with streams in flight (bench/soak.py);
# not part of `make test`. ARGS=--quick: two minutes of load.
soak: model
	$(PY) -m bench.soak --out $(or $(OUT),soak.json) $(ARGS)

# Twenty stops of a CPU service with streams in flight, by SIGTERM to its process group
# or to every process (bench/stop_soak.py): each stream's final message within 1 s,
# exit 0 within 5 s, nothing left running.
soak-stop: model
	$(PY) -m bench.stop_soak --out $(or $(OUT),stop_soak.json) $(ARGS)

protos:
	scripts/gen_protos.sh

# docs/flags.md, every subcommand's flags from the parser itself (tests/test_flags_doc.py
# fails when it is stale).
flags-doc: setup
	$(PY) -m router.cli.flags_doc --write

clean:
	rm -rf $(VENV) build *.egg-info
