# `make test` and `make demo` set up .venv themselves (idempotent; a no-op when
# pyproject.toml has not changed since the last setup).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup test lint typecheck proto proto-check buf-lint demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev]'
	@touch $(STAMP)

proto: $(STAMP)            ## regenerate scheduler_service/gen from proto/
	$(PY) tools/genproto.py

proto-check: $(STAMP)      ## fail when the generated code is stale
	$(PY) tools/genproto.py --check

buf-lint:                  ## lint proto/ with buf (npm package @bufbuild/buf)
	tools/buf.sh lint

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

test: $(STAMP) proto-check buf-lint lint
	$(PY) -m pytest -q

demo: $(STAMP)
	$(VENV)/bin/slidingserve demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
