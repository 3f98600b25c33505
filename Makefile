# `make demo` and `make test` set up everything on a fresh machine: a .venv with flashdsa installed.
# TORCH picks the torch wheel installed first (e.g. TORCH=torch for the newest). TORCH_INDEX: where a
# machine without an NVIDIA driver gets PyTorch's CPU build (PyPI's Linux wheel is the CUDA one, several
# GB); empty where nvidia-smi exists, so a GPU box gets the CUDA build. Each step says what it does.
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,https://download.pytorch.org/whl/cpu)
PY := $(VENV)/bin/python

.PHONY: demo test clean

$(VENV)/.installed: pyproject.toml
	@echo "[make 1/3] creating the virtual environment $(VENV) (seconds)"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[make 2/3] installing $(TORCH) into $(VENV) (the largest step: a minute or more the first time)"
	$(PY) -m pip install "$(TORCH)" $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX))
	@echo "[make 3/3] installing flashdsa (editable) with triton, transformers, matplotlib and the test tools (about a minute)"
	$(PY) -m pip install -e ".[test,hf,bench]"
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
