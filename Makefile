# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test test-all conformance bench lint clean gpu-compile gpu-compile-all

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch lies on this machine's disk; a bare `torch` would download a CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/lmplug models pull $(MODEL)
	$(VENV)/bin/lmplug generate --chat --temperature 0 --max-tokens 64 --stats "$(PROMPT)"

# the architecture first (pyproject's [tool.importlinter]: the core's layers, plugins on the contract);
# tests/conftest.py turns TRITON_INTERPRET=1 on only where no CUDA GPU is visible
test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -m "not slow" --durations=40 --durations-min=5

test-all: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/lmplug models pull $(MODEL)
	$(PY) -m pytest -q

# the conformance suite's table for every first-party backend that runs on the CPU
CONFORMANCE ?= attention:sdpa attention:paged kvcache:contiguous kvcache:paged scheduler:static \
	scheduler:continuous moe:reference drafter:ngram constraint:xgrammar constraint:llguidance mixer:torch \
	kvconnector:host
conformance: $(STAMP)
	@for b in $(CONFORMANCE); do OMP_NUM_THREADS=1 $(VENV)/bin/lmplug plugins --check $$b || exit 1; done

# every Triton kernel compiled for sm_80 and sm_90 without a GPU (docs/triton-on-cpu.md): the
# installed triton on a sample of configurations per kernel, then the older triton of GPU images
# on torch 2.11 on a smaller sample; gpu-compile-all compiles every configuration
GPU_COMPILE := $(PY) tools/gpu_compile.py
GPU_COMPILE_SAMPLE ?= 6
TRITON_OLD ?= 3.6.0
TRITON_OLD_SAMPLE ?= 3
# the lmplug cache folder (lmplug.kit.paths.cache_dir): $LMPLUG_CACHE or ~/.cache/lmplug
TRITON_OLD_DIR = $(or $(LMPLUG_CACHE),$(HOME)/.cache/lmplug)/triton-$(TRITON_OLD)

$(TRITON_OLD_DIR)/.installed: $(STAMP)
	$(PIP) install -q --no-deps --target $(TRITON_OLD_DIR) triton==$(TRITON_OLD)
	touch $@

# both runs report before the target fails
gpu-compile: $(STAMP) $(TRITON_OLD_DIR)/.installed
	@rc=0; $(GPU_COMPILE) --sample $(GPU_COMPILE_SAMPLE) || rc=1; \
	$(GPU_COMPILE) --sample $(TRITON_OLD_SAMPLE) --triton-path $(TRITON_OLD_DIR) || rc=1; exit $$rc

gpu-compile-all: $(STAMP) $(TRITON_OLD_DIR)/.installed
	@rc=0; $(GPU_COMPILE) --quiet || rc=1; \
	$(GPU_COMPILE) --sample $(GPU_COMPILE_SAMPLE) --triton-path $(TRITON_OLD_DIR) || rc=1; exit $$rc

bench: $(STAMP)
	$(VENV)/bin/lmplug models pull $(MODEL)
	$(PY) benchmarks/bench_vs_hf.py

lint: $(STAMP)
	$(VENV)/bin/ruff check core plugins tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info

# on a lent GPU machine (its image has torch and triton; no registry): tests, conformance and
# benchmarks with compiled kernels, summary in $OUT or ./gpu-check-out (docs/gpu.md). Before,
# where pip reaches a registry: `make gpu-wheels` fetches the other dependencies into .gpu-wheels/
.PHONY: gpu-check gpu-wheels
GPU_PYTHON ?= python3
GPU_PYTHON_VERSION ?= 3.12
gpu-check:
	$(GPU_PYTHON) tools/gpu_check.py

gpu-wheels: $(STAMP)
	$(PY) tools/gpu_check.py --download-wheels --python-version $(GPU_PYTHON_VERSION)
