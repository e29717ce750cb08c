# The two entry points of the README. Each bootstraps the venv first (a no-op when current).
VENV ?= .venv
export TAILPROOF_VENV := $(VENV)
# VLLM=0.33 runs a target on another installed vLLM release (its overlay folder first on
# PYTHONPATH, scripts/vllm_env.sh); unset: the venv's own, the newest supported release.
ifdef VLLM
export PYTHONPATH := $(shell ./scripts/vllm_env.sh $(VLLM))
endif

.PHONY: check test venv lint bench

venv:
	@./scripts/bootstrap.sh

check: venv
	$(VENV)/bin/tailproof check

# The import contracts (pyproject.toml [tool.importlinter]) first: a second, not a minute.
test: venv
	./scripts/lint_imports.sh
	$(VENV)/bin/python -m pytest

lint: venv
	$(VENV)/bin/ruff check .
	./scripts/lint_imports.sh

bench: venv
	$(VENV)/bin/python -m pytest benchmarks --benchmark-only
