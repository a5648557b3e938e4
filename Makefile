VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dynemb-installed

.PHONY: install sysdeps demo lint test test-quick bench clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

# redis-server for the serving tests (apt-get; a no-op when it is already installed).
sysdeps:
	bash scripts/install_system_deps.sh

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m dynemb demo

lint: $(STAMP)
	$(PY) -m ruff check .

# One torch thread per process: on small shared machines two threads stall each other badly.
test: lint sysdeps
	OMP_NUM_THREADS=1 $(PY) -m pytest

# Every test but those marked slow (multi-process runs, whole commands, long property tests): under 3 minutes.
test-quick: lint sysdeps
	OMP_NUM_THREADS=1 $(PY) -m pytest -m "not slow"

bench: $(STAMP)
	$(PY) benchmarks/table_ops.py --quick

clean:
	rm -rf $(VENV) demo-report
