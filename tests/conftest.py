"""One fixture, parametrised over the two implementations (the aio-libs pattern).

``impl`` gives a namespace with ``codec``, ``Router`` and ``Coordinator`` of
either the Cython (``[c]``) or the pure-Python (``[py]``) implementation.
Where the extension cannot be imported the ``[c]`` tests are skipped, unless
``COORDKIT_REQUIRE_EXTENSION=1`` (CI), where they fail.
"""

from __future__ import annotations

import os

import pytest

import coordkit

REQUIRE_EXTENSION = os.environ.get("COORDKIT_REQUIRE_EXTENSION", "") not in ("", "0")
IMPLEMENTATIONS = [pytest.param("c", marks=pytest.mark.c_extension), "py"]


def load(name: str):
    try:
        return coordkit.load_implementation(name)
    except ImportError as exc:
        if REQUIRE_EXTENSION:
            pytest.fail(f"the C extension is required but did not import: {exc}")
        pytest.skip(f"C extension not available: {exc}")


@pytest.fixture(params=IMPLEMENTATIONS)
def impl(request):
    return load(request.param)


@pytest.fixture
def c_impl():
    return load("c")


@pytest.fixture
def py_impl():
    return load("py")
