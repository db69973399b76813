# Developer tasks. Each runs in the active virtualenv (pip install -e '.[dev]').
PYTHON ?= python

.PHONY: build constants debug test lint typecheck bench wheel check

build:  ## compile the extensions in place (optimized)
	$(PYTHON) setup.py build_ext --inplace

constants:  ## regenerate coordkit/_constants.pxd from protocol.py and _shared.py
	$(PYTHON) buildutils/constants.py

debug:  ## debug build (DEBUG counters, line tracing, -O0 -g, annotation), the C tests on it, then back
	COORDKIT_DEBUG=1 $(PYTHON) setup.py build_ext --inplace --force
	COORDKIT_REQUIRE_EXTENSION=1 $(PYTHON) -m pytest -q -m c_extension
	$(PYTHON) setup.py build_ext --inplace --force

test: build  ## the suite (both implementations), then again with the pure-Python default
	COORDKIT_REQUIRE_EXTENSION=1 $(PYTHON) -m pytest -q
	COORDKIT_PUREPYTHON=1 $(PYTHON) -m pytest -q

lint:  ## ruff, cython-lint, and the generated constants up to date
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	cython-lint coordkit/*.pyx coordkit/*.pxd
	$(PYTHON) buildutils/constants.py --check

typecheck:
	$(PYTHON) -m mypy

bench: build  ## the coordinator cost table and the C/Python microbenchmarks
	coordkit bench
	$(PYTHON) -m pytest -q bench/ --benchmark-enable

wheel:
	$(PYTHON) -m pip wheel --no-deps -w dist .

check: lint typecheck test
