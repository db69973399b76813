"""Loading an implementation for a test: skip without the C extension, fail in CI."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import NoReturn

import pytest

import coordkit

#: CI sets it: a build that failed must not pass as a pure-Python run.
REQUIRE_EXTENSION = os.environ.get("COORDKIT_REQUIRE_EXTENSION", "") not in ("", "0")


def unavailable(reason: str, details: str = "") -> NoReturn:
    """Skip a test that needs something compiled; fail it under COORDKIT_REQUIRE_EXTENSION=1.

    ``details`` (a build's output, say) go into the failure only: a skip stays one line.
    """
    if REQUIRE_EXTENSION:
        message = f"required under COORDKIT_REQUIRE_EXTENSION=1, but {reason}"
        pytest.fail(f"{message}\n{details}".strip(), pytrace=False)
    pytest.skip(reason)


def load(name: str) -> SimpleNamespace:
    try:
        return coordkit.load_implementation(name)
    except ImportError as exc:
        reason = f"the C extension did not import: {exc}"
    unavailable(reason)
