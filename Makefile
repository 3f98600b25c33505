# `make demo` and `make test` set up everything on a fresh machine: a .venv with flashdsa installed.
# TORCH picks the torch wheel installed first; override it on a GPU box (e.g. TORCH=torch) so pip
# does not replace the build you already have.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/flashdsa demo

test: $(VENV)/.installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
