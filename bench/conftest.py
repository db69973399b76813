"""The ``impl`` fixture of tests/conftest.py, for the benchmarks (tests/ is not a package)."""

from __future__ import annotations

import os

import pytest

import coordkit

REQUIRE_EXTENSION = os.environ.get("COORDKIT_REQUIRE_EXTENSION", "") not in ("", "0")


@pytest.fixture(params=["c", "py"])
def impl(request):
    try:
        return coordkit.load_implementation(request.param)
    except ImportError as exc:
        if REQUIRE_EXTENSION:
            pytest.fail(f"the C extension is required but did not import: {exc}")
        pytest.skip(f"C extension not available: {exc}")
