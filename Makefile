# deepfleet developer commands. `make demo` and `make test` are the README's quick start:
# on a fresh machine each one installs what it needs into .venv first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU install path pins torch exactly: a range lets pip pull a multi-GB CUDA build. Where the
# package index serves the CUDA build for that pin (PyPI does on Linux), take the CPU wheel from
# PyTorch's index: make install TORCH_INDEX=https://download.pytorch.org/whl/cpu
TORCH_PIN := torch==2.13.0
TORCH_INDEX ?=
# Progress is shown (pip's bar and one line per package): a first install takes minutes.
PIP_FLAGS ?= --progress-bar on
EXTRAS := engine,inference,hf,kernels,privacy,controller,kubernetes,azure,monitor,dev
PYTEST_ARGS ?=

export PIP_DISABLE_PIP_VERSION_CHECK=1
export OMP_NUM_THREADS ?= 1

.PHONY: install demo test test-fast test-all lint bench images clean

$(VENV)/.installed: pyproject.toml
	@echo "==> [1/3] creating $(VENV) and updating pip"
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install $(PIP_FLAGS) --upgrade pip "setuptools>=75" wheel
	@echo "==> [2/3] installing $(TORCH_PIN) (the largest download)"
	$(PIP) install $(PIP_FLAGS) $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX)) $(TORCH_PIN)
	@echo "==> [3/3] installing deepfleet with extras $(EXTRAS)"
	$(PIP) install $(PIP_FLAGS) $(TORCH_PIN) -e ".[$(EXTRAS)]"
	@echo "==> installed into $(VENV)"
	touch $@

install: $(VENV)/.installed

# Interactive (a terminal): after the job, the controller stays up with its page and a token until
# Ctrl-C. Not a terminal (CI, pipes), or DEMO_EXIT=1: it ends after the job (exit 0 when SUCCEEDED).
demo: install
	$(PY) -m deepfleet.controller.demo $(if $(DEMO_EXIT),--exit)

test: install
	bash .ci/test.sh -n auto --dist loadfile --durations=25 $(PYTEST_ARGS)

# Both runs spread test files over one process per core (pytest-xdist; a file's tests stay together,
# so module fixtures are built once). PYTEST_ARGS="-n 0" runs in one process.
test-fast: install
	bash .ci/test.sh -m "not slow" -n auto --dist loadfile $(PYTEST_ARGS)

# import-linter sees the mapped `deepfleet.*` packages only as a real tree on disk (the editable
# install maps them virtually), so lint a fresh non-editable install of the checkout. It runs from
# the repo root, where pyproject's own contract type lives (tests/arch/contract_types.py).
LINT_SITE := build/lint-site

lint: install
	$(VENV)/bin/ruff check .
	rm -rf $(LINT_SITE)
	$(PIP) install -q --no-deps --no-build-isolation --target $(LINT_SITE) .
	PYTHONPATH=$(abspath $(LINT_SITE)) $(abspath $(VENV))/bin/lint-imports --no-cache pyproject.toml

bench: install
	$(PY) benchmarks/run_all.py

images:
	docker build -f worker/Dockerfile -t deepfleet-worker:0.1.0 .
	docker build -f controller/Dockerfile -t deepfleet-controller:0.1.0 .

clean:
	rm -rf $(VENV) build *.egg-info .ci/bin
