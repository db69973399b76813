"""coordkit's tests: a package so that ``tests.support`` is one importable name."""
