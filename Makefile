# `make train` and `make test` create the virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: train test bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	touch $@

train: $(VENV)/.installed
	$(PY) train.py --config configs/demo.yaml $(ARGS)

test: $(VENV)/.installed
	$(PY) -m pytest tests -n 2 --dist loadfile $(ARGS)

clean:
	rm -rf runs .pytest_cache
