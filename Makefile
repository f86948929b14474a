# Two commands set everything up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
# pytest-xdist workers: the suite waits on servers and subprocesses part of the time, so three workers
# on 2 cores keep both busy (make test 19:16 with two, 15:22 with three and the files longest first;
# 14:14 with fewer collections, docs/development.md; peak memory 15 GB of 24); TEST_WORKERS=0 runs it
# in one process
TEST_WORKERS ?= 3
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS))

.PHONY: install test-deps serve test test-fast test-cluster bench guard lint clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[serve]'
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PY) -m pip install -q -e '.[serve,test]'
	# promtool (Debian's prometheus package) runs the chart's alert rules in tests/helm/test_helm_alert_rules.py
	command -v promtool >/dev/null || ! command -v apt-get >/dev/null || [ "$$(id -u)" != 0 ] || \
		{ apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; }
	touch $@

install: $(VENV)/.installed

test-deps: $(VENV)/.test-installed

# Fetches the default model (SmolLM2-135M-Instruct) into ~/.cache/vsurge on first use, then serves it.
serve: install
	$(VENV)/bin/vsurge serve --model default $(ARGS)

test: test-deps
	$(PY) -m pytest -q $(XDIST) $(ARGS)

test-fast: test-deps
	$(PY) -m pytest -q $(XDIST) -m "not slow" $(ARGS)

# Only the tests on real Kubernetes API servers (etcd + kube-apiserver 1.20 + apiextensions 0.36 + kcm from
# ../shared/k8s, on loopback); `make test` runs them too whenever ../shared/k8s is there (without it they are
# skipped, or under CI=true failed: tests/needs_kit.py).
test-cluster: test-deps
	$(PY) -m pytest -q -m cluster tests/cluster $(ARGS)

bench: test-deps
	$(PY) benchmarks/engine.py $(ARGS)

# The CPU speed guard: every hot path against the raw jitted loop, ratios in one process; fails below 0.5x
# (benchmarks/ratio_guard.py). .ci/run runs it as its own stage, alone on the machine: beside the suite's
# workers the two sides of a ratio would be timed under different loads.
guard: install
	$(PY) benchmarks/ratio_guard.py $(ARGS)

lint: test-deps
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check service operator tests benchmarks tools

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
