"""FakeEngine processes for the tools that run a cluster of their own (demo, replay)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

#: The package these tools belong to (``coordkit``, or a vendored copy's name), and the
#: directory its top-level package is found in: a child must start this very copy.
PACKAGE = __name__.rsplit(".", 2)[0]
PACKAGE_ROOT = Path(__file__).resolve().parents[PACKAGE.count(".") + 2]

STOP_TIMEOUT = 5.0  # seconds a terminated engine process gets before SIGKILL


@contextlib.contextmanager
def fake_engine_processes(
    address: str, count: int, options: Sequence[str]
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` ``coordkit fake-engine`` processes (ranks 0..count-1) with ``options``,
    stopped on exit -- before the coordinator, so that it can still take their
    DISCONNECT."""
    engines: list[subprocess.Popen[bytes]] = []
    try:
        engines += (_spawn(address, rank, options) for rank in range(count))
        yield engines
    finally:
        _stop(engines)


def _spawn(address: str, rank: int, options: Sequence[str]) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    # The child must import this very coordkit, installed or not, vendored or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    env["COORDKIT_PUREPYTHON"] = "1"  # an engine runs no coordinator: skip loading the extension
    command = [sys.executable, "-m", PACKAGE, "fake-engine", "--address", address]
    command += ["--rank", str(rank), "--quiet", *options]  # the tool's output is its own
    # Its own session: Ctrl-C reaches only the tool, which then stops the engines itself.
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, start_new_session=True)


def _stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + STOP_TIMEOUT
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
