# Two commands, on a machine with nothing but Python 3.10+:
#   make demo   set up .venv, then run the demo
#   make test   set up .venv, then run the whole test suite
# torch comes first and pinned: here `torch==2.13.0` is a local CPU wheel, while an unpinned
# torch would pull a multi-GB CUDA build. A GPU user with their own CUDA torch already in .venv
# runs `make test TORCH=` to skip that step.

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specbus-installed

.PHONY: install test demo clean distclean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes (or the venv is new).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install --quiet '$(TORCH)')
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

test: $(STAMP)
	$(BIN)/python -m pytest tests -q

demo: $(STAMP)
	$(BIN)/specbus demo

# Build and test leftovers; the venv stays (distclean removes it too).
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
