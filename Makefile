# Developer tasks. Each runs in the active virtualenv (pip install -e '.[dev]').
PYTHON ?= python

# Every Cython source: the package's modules, their included parts, the test-only helpers.
CYTHON_SOURCES = $(shell find coordkit tests/support -name '*.pyx' -o -name '*.pxd')

.PHONY: build constants debug test lint typecheck docs bench wheel check clean

build:  ## compile the extensions in place (optimized)
	$(PYTHON) setup.py build_ext --inplace

constants:  ## regenerate coordkit/_constants.pxd from protocol.py, _shared.py and _policies.py
	$(PYTHON) buildutils/constants.py

debug:  ## debug build (DEBUG counters, line tracing, -O0 -g, annotation), the C tests on it, then back
	COORDKIT_DEBUG=1 $(PYTHON) setup.py build_ext --inplace --force
	COORDKIT_REQUIRE_EXTENSION=1 $(PYTHON) -m pytest -q -m c_extension
	$(PYTHON) setup.py build_ext --inplace --force

test: build  ## the suite, one pass over both implementations, as CI runs it
	COORDKIT_REQUIRE_EXTENSION=1 $(PYTHON) -m pytest -q

lint:  ## ruff, cython-lint, the generated constants up to date, relative imports and no cycle
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .
	cython-lint $(CYTHON_SOURCES)
	$(PYTHON) buildutils/constants.py --check
	$(PYTHON) buildutils/imports.py

typecheck:
	$(PYTHON) -m mypy

docs:  ## the documentation site into site/, failing on any broken link or reference (the docs extra)
	NO_MKDOCS_2_WARNING=1 $(PYTHON) -m mkdocs build --strict

bench: build  ## the coordinator cost table and the C/Python microbenchmarks
	coordkit bench
	$(PYTHON) -m pytest -q bench/ --benchmark-enable

wheel:
	$(PYTHON) -m pip wheel --no-deps -w dist .

clean:  ## the build products: build/, dist/, site/, the generated .c, the .so, the annotation html
	rm -rf build dist site
	find coordkit tests -name '*.so' -delete -o -name '*.c' -delete -o -name '*.html' -delete

check: lint typecheck test
