"""Child Python processes that import this checkout's coordkit: commands, engines.

The command that starts a fake engine process is spelled in one place,
:func:`fake_engine_command`; tests start engines through :func:`engine_processes`,
which kills whatever is left of them at exit. :func:`single_frame_engine_process`
starts a raw Megatron-Core 0.19 engine (which imports no coordkit) the same way.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import coordkit
from tests.support.peers import wait_for

#: The directory that holds the coordkit package these tests import.
ROOT = Path(coordkit.__file__).parent.parent


def python_env() -> dict[str, str]:
    """The environment for a child Python that must import this coordkit, not another one."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def coordkit_command(*args: str) -> list[str]:
    """The ``coordkit`` command line, run by this interpreter."""
    return [sys.executable, "-m", "coordkit", *args]


def fake_engine_command(address: str, rank: int, *options: str) -> list[str]:
    """A fake engine process of ``rank`` serving the coordinator at ``address``."""
    return coordkit_command("fake-engine", "--address", address, "--rank", str(rank), *options)


@contextlib.contextmanager
def engine_processes(
    address: str, ranks: int | Iterable[int], *options: str, **popen: Any
) -> Iterator[list[subprocess.Popen]]:
    """Fake engine processes (ranks ``0..n-1``, or the ones given), killed at exit.

    ``options`` are the engine's own flags; ``popen`` goes to ``subprocess.Popen``.
    """
    ranks = range(ranks) if isinstance(ranks, int) else ranks
    processes: list[subprocess.Popen] = []
    try:
        for rank in ranks:
            command = fake_engine_command(address, rank, *options)
            processes.append(subprocess.Popen(command, env=python_env(), **popen))
        yield processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


@contextlib.contextmanager
def single_frame_engine_process(
    address: str, identity: bytes, *, hold: bool = False, main: bool = False
) -> Iterator[subprocess.Popen]:
    """A Megatron-Core 0.19 engine rank on the wire (``tests/support/peers.py`` run as
    a script, no coordkit in it), or with ``main`` Megatron main's: it echoes each
    prompt back, or with ``hold`` keeps every request unanswered. Killed at exit."""
    command = [sys.executable, "-m", "tests.support.peers", "--address", address]
    command += ["--identity", identity.decode()] + (["--hold"] if hold else [])
    command += ["--main"] if main else []
    process = subprocess.Popen(command, env=python_env(), cwd=ROOT)
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def free_tcp_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{probe.getsockname()[1]}"


@contextlib.contextmanager
def serve(address: str, impl_name: str, log: Path, *options: str) -> Iterator[subprocess.Popen]:
    """``coordkit serve`` at ``address`` (stderr in ``log``), killed at exit."""
    command = coordkit_command("serve", "--bind", address, "--implementation", impl_name, *options)
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, env=python_env(), stderr=stderr)
    try:
        wait_for(lambda: "listening" in log.read_text() or process.poll() is not None, 30)
        assert process.poll() is None, log.read_text()
        yield process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGCONT)  # a stopped process cannot die until resumed
            process.kill()
        process.wait()


@contextlib.contextmanager
def ha_candidate(
    address: str, impl_name: str, log: Path, name: str, ttl: float = 1
) -> Iterator[subprocess.Popen]:
    """``coordkit serve --ha NAME`` at ``address`` (stderr in ``log``), killed at exit:
    it serves once elected (its log then says "listening")."""
    command = coordkit_command(
        "serve", "--bind", address, "--implementation", impl_name,
        "--ha", name, "--ha-ttl", f"{ttl:g}",
    )  # fmt: skip
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, env=python_env(), stderr=stderr)
    try:
        yield process
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait()
