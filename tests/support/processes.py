"""Child Python processes that import this checkout's coordkit: commands, engines.

The command that starts a fake engine process is spelled in one place,
:func:`fake_engine_command`; tests start engines through :func:`engine_processes`,
which kills whatever is left of them at exit.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import coordkit

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
