# `make demo` and `make test` both start from nothing: they create .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

.PHONY: venv demo test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch first: a bare torch requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test,bench,fleet]'
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/kvbridge demo

test: venv
	$(VENV)/bin/ruff check kvbridge tests
	$(PY) -m pytest -x -q

lint: venv
	$(VENV)/bin/ruff check kvbridge tests
	$(VENV)/bin/ruff format --check kvbridge tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
