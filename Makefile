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

# ruff's formatter is not applied tree-wide (the code keeps its hanging indents); new
# files may use it.
lint: venv
	$(VENV)/bin/ruff check kvbridge tests

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
