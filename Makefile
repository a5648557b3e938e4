VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dynemb-installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml scripts/setup_env.sh
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m dynemb demo

test: $(STAMP)
	$(PY) -m pytest

bench: $(STAMP)
	$(PY) benchmarks/table_ops.py --quick

clean:
	rm -rf $(VENV) demo-report
