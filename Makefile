# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel for this machine. GPU users: `make demo TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"`
# or install a CUDA torch into .venv before running make.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.installed: pyproject.toml constraints.txt | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH_SPEC)
	$(PY) -m pip install -q -c constraints.txt -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/relayrl demo

test: $(VENV)/.installed-test
	$(PY) -m pytest -q

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check relayrl tests
	$(VENV)/bin/ruff format --check relayrl tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) runs
