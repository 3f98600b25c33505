# `make demo` and `make test` set up everything on a fresh machine: a .venv with flashdsa installed.
# TORCH picks the torch wheel installed first; override it on a GPU box (e.g. TORCH=torch) so pip
# does not replace the build you already have. Each step says what it does; pip shows its progress.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	@echo "[make 1/3] creating the virtual environment $(VENV) (seconds)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[make 2/3] installing $(TORCH) into $(VENV) (the largest step: a minute or more the first time)"
	$(PY) -m pip install "$(TORCH)"
	@echo "[make 3/3] installing flashdsa (editable) with triton, transformers and the test tools (about a minute)"
	$(PY) -m pip install -e ".[test]"
	touch $@
	@echo "[make] installed: run the command line as $(VENV)/bin/flashdsa, or 'source $(VENV)/bin/activate' first"

demo: $(VENV)/.installed
	@echo "[make] $(VENV)/bin/flashdsa demo (the tiny preset on the CPU: under a minute)"
	$(VENV)/bin/flashdsa demo

test: $(VENV)/.installed
	@echo "[make] the test suite (CPU: several minutes)"
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
