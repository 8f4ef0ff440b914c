# Plain entry points. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install test bench clean

install: $(STAMP)

# Recreated when the dependency list changes. The constraints file pins torch/torchvision
# to the builds on the project machines' local disk, so this installs without downloads.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) bench/layers.py --json bench/results/layers.json

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
