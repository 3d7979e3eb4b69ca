# Quick start: `make demo` and `make test` each bootstrap .venv on a fresh machine.
VENV  ?= .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.kvtier-installed

.PHONY: demo demo-single test test-serial test-ray-up bench-tree bench-transfer bench-storage bench-prefix bench-instances bench-matrix clean-venv

$(STAMP): pyproject.toml scripts/bootstrap.sh
	VENV=$(VENV) bash scripts/bootstrap.sh
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m kvtier demo

demo-single: $(STAMP)
	$(PY) examples/single_process.py

# two xdist workers, a test directory each at a time (tests/conftest.py), then the host tests
# alone (their link cuts and node deaths race Ray's health checks under load)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --ignore=tests/hosts
	$(PY) -m pytest -q tests/hosts

# the same suite in one process, in pytest's own order
test-serial: $(STAMP)
	$(PY) -m pytest -q

# `ray up` of cluster.yaml over three harness hosts, then kvtier serve on it (root, sshd)
test-ray-up: $(STAMP)
	$(PY) -m pytest -q -m '' tests/hosts/test_ray_up.py

bench-tree: $(STAMP)
	$(PY) -m kvtier bench gen-trace --out /tmp/kvtier-trace.jsonl
	$(PY) -m kvtier bench tree --trace /tmp/kvtier-trace.jsonl --page-size 64 --capacity 131072 --json

bench-transfer: $(STAMP)
	$(PY) -m kvtier bench transfer --json

bench-storage: $(STAMP)
	for b in file mooncake nixl; do $(PY) -m kvtier bench storage --backend $$b --json || exit 1; done

bench-prefix: $(STAMP)
	$(PY) -m kvtier bench prefix --json

bench-instances: $(STAMP)
	$(PY) -m kvtier bench instances --json

bench-matrix: $(STAMP)
	$(PY) -m kvtier bench matrix --quick --out /tmp/kvtier-matrix

clean-venv:
	rm -rf $(VENV)
