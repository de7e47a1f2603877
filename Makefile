# ftrain: `make up` runs the one-machine cluster, `make test` runs the test suite,
# `make test-slow` the tests marked `slow` (minutes each) that `make test` leaves out.
# All set up what they need first (idempotent; a stamp file skips a second install).

SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.ftrain-setup
# The CPU build that lies on this machine's disk; pinned so nothing pulls another torch.
TORCH_VERSION := 2.13.0
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
ARGS ?=
# Test processes side by side (pytest-xdist). The integration tests are mostly torch imports
# (~2.8 s of CPU each) and waits: two on a 2-core machine take the suite from about 1,800 s
# to about 1,100 s (the CPU is the limit; more processes were slower). TEST_WORKERS=0 runs
# them all in pytest's own process.
TEST_WORKERS ?= 2

.PHONY: setup setup-test up test test-slow clean-venv

# `make up` needs etcd, torch and the package; the tests also want iproute2 (network
# namespaces), chromium (the dashboard's browser test), slurm-wlm and munge (the tests marked
# `slurm` start a SLURM cluster of their own) and the test extras. Each its stamp.
TEST_STAMP := $(VENV)/.ftrain-test-setup

setup: $(STAMP)

setup-test: $(TEST_STAMP)

$(STAMP): pyproject.toml
	@if ! command -v etcd >/dev/null 2>&1; then \
		echo "installing system packages: etcd-server"; \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y etcd-server; \
	fi
	@# Debian's python3 makes venvs only with python3-venv (ensurepip); install it on demand.
	[ -x $(PY) ] || python3 -m venv $(VENV) || { rm -rf $(VENV); \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv && python3 -m venv $(VENV); }
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -e .
	@$(PY) -c 'import torch, sys; v = torch.__version__.split("+")[0]; \
		sys.exit(0 if v == "$(TORCH_VERSION)" else f"torch {torch.__version__} installed, expected $(TORCH_VERSION)")'
	touch $@

$(TEST_STAMP): $(STAMP)
	@set -e; pkgs=""; \
	command -v ip >/dev/null 2>&1 || pkgs="$$pkgs iproute2"; \
	command -v chromium >/dev/null 2>&1 || pkgs="$$pkgs chromium"; \
	command -v slurmctld >/dev/null 2>&1 || pkgs="$$pkgs slurm-wlm"; \
	command -v munged >/dev/null 2>&1 || pkgs="$$pkgs munge"; \
	if [ -n "$$pkgs" ]; then \
		echo "installing system packages:$$pkgs"; \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $$pkgs; \
	fi
	$(PIP) install -e '.[test]'
	touch $@

up: $(STAMP)
	$(VENV)/bin/ftrain up $(ARGS)

test: $(TEST_STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests $(ARGS)

# The tests marked `slow`, one at a time: HA cluster faults, a leader cut from etcd (root),
# Schemathesis, long fault cases, SLURM allocations cancelled mid-run (root). About 25-30
# minutes on 2 cores; one at a time because several of them hold leases of 2 s that a
# starved machine lets lapse. FTRAIN_TEST_SLOW=1
# lets those that also check it run. The tests that need root or a GPU skip themselves.
test-slow: $(TEST_STAMP)
	FTRAIN_TEST_SLOW=1 $(PY) -m pytest -q -n 0 -m slow tests $(ARGS)

clean-venv:
	rm -rf $(VENV)
