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

.PHONY: setup setup-vllm test test-fast vllm-suite lint proto proto-check buf-lint deploy-check demo clean

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

test-fast: $(STAMP)        ## everything but the vLLM parts, without installing vLLM
	$(PY) -m pytest -q --ignore=tests/vllm

vllm-suite: $(VSTAMP)      ## vLLM's own scheduler tests with our scheduler class
	tools/vllm_tests.sh $(PY)

deploy-check: $(STAMP)     ## render the Kustomize overlays and validate every manifest offline
	tools/validate_deploy.sh --python $(PY)

demo: $(STAMP)
	$(VENV)/bin/slidingserve demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

.PHONY: default-predictor
default-predictor: $(STAMP) ## regenerate the bundled default predictor from the simulated A100 TP2 Llama-2-7B
	$(VENV)/bin/slidingserve predictor sweep --profile a100-tp2-llama2-7b --samples 3000 --seed 0 \
	  --out scheduler_service/core/data/default_predictor.json
