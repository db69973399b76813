"""The processes of the tools that run a cluster of their own (demo, replay): FakeEngine
ranks, and a ``coordkit serve`` coordinator that can be killed and started again."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO

#: The package these tools belong to (``coordkit``, or a vendored copy's name), and the
#: directory its top-level package is found in: a child must start this very copy.
PACKAGE = __name__.rsplit(".", 2)[0]
PACKAGE_ROOT = Path(__file__).resolve().parents[PACKAGE.count(".") + 2]

STOP_TIMEOUT = 5.0  # seconds a terminated engine process gets before SIGKILL


@contextlib.contextmanager
def fake_engine_processes(
    address: str,
    count: int,
    options: Sequence[str],
    roles: Sequence[str | None] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``count`` ``coordkit fake-engine`` processes (ranks 0..count-1) with ``options``,
    rank ``r`` with ``--role roles[r]`` when ``roles`` names one (and ``env`` added to
    this process's environment), stopped on exit -- before the coordinator, so that it
    can still take their DISCONNECT."""
    engines: list[subprocess.Popen[bytes]] = []
    try:
        for rank in range(count):
            role = roles[rank] if rank < len(roles) else None
            own = [*options, "--role", role] if role else options
            engines.append(_spawn(address, rank, own, env or {}))
        yield engines
    finally:
        _stop(engines)


def _spawn(
    address: str, rank: int, options: Sequence[str], env: Mapping[str, str]
) -> subprocess.Popen[bytes]:
    command = ["fake-engine", "--address", address, "--rank", str(rank), "--quiet", *options]
    # An engine runs no coordinator: it skips loading the extension.
    return _child(command, {**env, "COORDKIT_PUREPYTHON": "1"}, None)


def _child(
    arguments: Sequence[str], env: dict[str, str], stderr: IO[bytes] | None
) -> subprocess.Popen[bytes]:
    """``coordkit ARGUMENTS`` in a process of its own (the tool's output is its own)."""
    env = {**os.environ, **env}
    # The child must import this very coordkit, installed or not, vendored or not.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(PACKAGE_ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", PACKAGE, *arguments]
    # Its own session: Ctrl-C reaches only the tool, which then stops its children itself.
    return subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True
    )


class CoordinatorProcess:
    """``coordkit serve --bind ADDRESS OPTIONS`` in a process, its stderr in ``log``;
    :meth:`fail_over` SIGKILLs it and starts another one at the same address, as
    systemd or a kubelet would."""

    def __init__(self, address: str, options: Sequence[str], log: Path):
        self.arguments = ["serve", "--bind", address, *options]
        self.log = log
        self.process = self._start()
        self.failovers = 0
        try:
            self.wait_listening()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as stderr:
            return _child(self.arguments, {}, stderr)

    def wait_listening(self, timeout: float = 60.0) -> None:
        """Until the coordinator said it listens; ConnectionError if it ended first."""
        deadline = time.monotonic() + timeout
        while self.log.read_text().count("coordkit listening") <= self.failovers:
            if self.process.poll() is not None or time.monotonic() > deadline:
                lines = self.log.read_text().strip().splitlines() or ["(nothing said)"]
                raise ConnectionError(f"the coordinator did not start: {lines[-1]}")
            time.sleep(0.02)

    def fail_over(self) -> None:
        """SIGKILL, then a new coordinator at once (its listening not awaited)."""
        self.process.kill()
        self.process.wait()
        self.failovers += 1
        self.process = self._start()

    def stop(self) -> None:
        _stop([self.process])


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
