# Two commands do all set-up on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
MODEL ?= smollm2-135m-instruct
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: run test test-all conformance bench lint clean

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

# the architecture first (pyproject's [tool.importlinter]: the core's layers, plugins on the contract)
test: $(STAMP)
	$(VENV)/bin/lint-imports
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "not slow"

test-all: $(STAMP)
	$(VENV)/bin/lint-imports
	$(VENV)/bin/lmplug models pull $(MODEL)
	TRITON_INTERPRET=1 $(PY) -m pytest -q

# the conformance suite's table for every first-party backend that runs on the CPU
CONFORMANCE ?= attention:sdpa attention:paged kvcache:contiguous kvcache:paged scheduler:static \
	scheduler:continuous moe:reference drafter:ngram
conformance: $(STAMP)
	@for b in $(CONFORMANCE); do OMP_NUM_THREADS=1 $(VENV)/bin/lmplug plugins --check $$b || exit 1; done

bench: $(STAMP)
	$(VENV)/bin/lmplug models pull $(MODEL)
	$(PY) benchmarks/bench_vs_hf.py

lint: $(STAMP)
	$(VENV)/bin/ruff check core plugins tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
