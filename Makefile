# The two entry points of the README. Each bootstraps the venv first (a no-op when current).
VENV ?= .venv
export TAILPROOF_VENV := $(VENV)
# VLLM=0.33 runs a target on another installed vLLM release (its overlay folder first on
# PYTHONPATH, scripts/vllm_env.sh); unset: the venv's own, the newest supported release.
ifdef VLLM
export PYTHONPATH := $(shell ./scripts/vllm_env.sh $(VLLM))
endif

# make test / make check run once per supported release (newest first); VLLM=0.33 runs one.
RELEASES ?= $(if $(VLLM),$(VLLM),$(shell ./scripts/vllm_env.sh --supported))
# Each release's command runs even when an earlier one failed; the target fails if any did.
PER_RELEASE = status=0; for r in $(RELEASES); do \
	  echo "== vLLM $$r: $(1)" >&2; \
	  PYTHONPATH="$$(./scripts/vllm_env.sh $$r)" $(1) || status=1; \
	done; exit $$status

.PHONY: check test venv lint bench device-pack device-dryrun

venv:
	@./scripts/bootstrap.sh

check: venv
	@$(call PER_RELEASE,$(VENV)/bin/tailproof check)

# The guards first (scripts/guards.sh: ruff, no type: ignore, commit subjects, import
# contracts): seconds, not a minute.
test: venv
	./scripts/guards.sh
	@$(call PER_RELEASE,$(VENV)/bin/python -m pytest)

lint: venv
	./scripts/guards.sh

bench: venv
	$(VENV)/bin/python -m pytest benchmarks --benchmark-only

# The GPU check (docs/impl.md, "GPU check"): the folder a lent machine gets (.devpack), and the
# dry run of the check on this machine, in a Python 3.12 venv holding only the machine's
# packages (first run: about 4 GB and several minutes of set-up). .ci/run runs it.
device-pack: venv
	./scripts/device_pack.sh

device-dryrun: venv
	./scripts/device_dryrun.sh
