# The two entry points of the README. Each bootstraps the venv first (a no-op when current).
VENV ?= .venv
export TAILPROOF_VENV := $(VENV)

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
