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
	$(VENV)/bin/ruff check src tests scripts

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
