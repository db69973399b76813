"""The pytest plugin of tests/ and bench/ (registered by the root conftest.py).

``impl`` is parametrised over the two implementations, ids ``[c]`` and ``[py]``:
a namespace with the ``codec``, ``Router`` and ``Coordinator`` of either. Where
the extension does not import the ``[c]`` cases skip, unless
``COORDKIT_REQUIRE_EXTENSION=1`` (CI), where they fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.support.implementations import load

IMPLEMENTATIONS = [
    pytest.param("c", marks=pytest.mark.c_extension, id="c"),
    pytest.param("py", id="py"),
]


# Session scope: an implementation is a set of imported modules, loaded once.
@pytest.fixture(scope="session", params=IMPLEMENTATIONS)
def impl(request) -> SimpleNamespace:
    return load(request.param)


@pytest.fixture(scope="session")
def c_impl() -> SimpleNamespace:
    return load("c")


@pytest.fixture(scope="session")
def py_impl() -> SimpleNamespace:
    return load("py")
