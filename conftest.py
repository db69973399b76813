"""The fixtures shared by tests/ and bench/ live in one plugin, tests/support/fixtures.py.

A root conftest is the one place pytest loads for ``pytest``, ``pytest bench/``
and ``pytest tests/test_x.py`` alike, and it puts this directory on sys.path,
so ``tests.support`` imports from either tree.
"""

import pytest

# The helpers assert too (peers, clusters): rewritten, their failures explain themselves.
pytest.register_assert_rewrite("tests.support")

pytest_plugins = ["tests.support.fixtures"]
