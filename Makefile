# ftrain: `make up` runs the one-machine cluster, `make test` runs the whole test suite.
# Both set up what they need first (idempotent; a stamp file skips a second install).

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
# (~2.8 s of CPU each here) and waits: two on a 2-core machine took the suite from 1,792 s
# to 1,089-1,142 s (1,103 s in stop 19, after torchrun came from the fork server: the CPU is
# the limit, and more processes were slower). TEST_WORKERS=0 runs them all in pytest's own process.
TEST_WORKERS ?= 2

.PHONY: setup up test clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml
	@set -e; pkgs=""; \
	command -v etcd >/dev/null 2>&1 || pkgs="$$pkgs etcd-server"; \
	command -v ip >/dev/null 2>&1 || pkgs="$$pkgs iproute2"; \
	command -v chromium >/dev/null 2>&1 || pkgs="$$pkgs chromium"; \
	if [ -n "$$pkgs" ]; then \
		echo "installing system packages:$$pkgs"; \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y $$pkgs; \
	fi
	@# Debian's python3 makes venvs only with python3-venv (ensurepip); install it on demand.
	[ -x $(PY) ] || python3 -m venv $(VENV) || { rm -rf $(VENV); \
		$(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv && python3 -m venv $(VENV); }
	$(PIP) install "torch==$(TORCH_VERSION)"
	$(PIP) install -e '.[test]'
	@$(PY) -c 'import torch, sys; v = torch.__version__.split("+")[0]; \
		sys.exit(0 if v == "$(TORCH_VERSION)" else f"torch {torch.__version__} installed, expected $(TORCH_VERSION)")'
	touch $@

up: $(STAMP)
	$(VENV)/bin/ftrain up $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests $(ARGS)

clean-venv:
	rm -rf $(VENV)
