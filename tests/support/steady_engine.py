"""An engine process whose requests take 1.5-3 s, for the failover tests.

``python -m tests.support.steady_engine ADDRESS RANK IMPL LOG`` runs a
:class:`coordkit.Engine` that generates for every request (its prompt's first
token is its number ``n``) for 1.5 + (n % 7) / 4 seconds, as the bench's
failover engines do (:func:`coordkit.tools.bench.failover.generate_steadily`:
a streaming request gets a partial ``{"n": n, "i": i}`` every 0.25 s, and every
request ends with ``{"n": n, "partials": count}``, an aborted one at once). Each
request it starts is written to LOG (``n``, one a line, flushed at once), so that
a test sees one started twice, and each abort it gets for a request it runs
(``abort n``). :func:`steady_engines` starts such processes for a test,
:func:`started` and :func:`aborted` count what their logs say.
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from coordkit.engine import Engine
from coordkit.tools.bench.failover import generate_steadily
from tests.support.processes import ROOT, python_env


@contextlib.contextmanager
def steady_engines(address: str, impl_name: str, logs: list[Path]) -> Iterator[None]:
    command = [sys.executable, "-m", "tests.support.steady_engine", address]
    processes = [
        subprocess.Popen([*command, str(rank), impl_name, str(log)], env=python_env(), cwd=ROOT)
        for rank, log in enumerate(logs)
    ]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


async def collect(stream) -> list:
    return [part async for part in stream]


def started(logs: list[Path]) -> collections.Counter:
    """How many times each request number was started, over every engine."""
    return collections.Counter(int(n) for n in _log_lines(logs) if n.isdigit())


def aborted(logs: list[Path]) -> collections.Counter:
    """How many times each request number was aborted at an engine that ran it."""
    return collections.Counter(
        int(line.split()[1]) for line in _log_lines(logs) if line.startswith("abort ")
    )


def _log_lines(logs: list[Path]) -> list[str]:
    return [line for log in logs if log.exists() for line in log.read_text().splitlines()]


def check_outcome(
    logs: list[Path], finals: list, parts: list, requests: int, later: int = 0
) -> None:
    """Requests ``0..requests-1`` got their real finals, the streams after them every
    partial once, in order, and no request (of those and ``later`` more) started
    twice at an engine."""
    assert [final["n"] for final in finals] == list(range(requests))
    for n, got in enumerate(parts, requests):
        *partials, final = got
        assert final == {"n": n, "partials": len(partials)}, (n, got)
        assert partials == [{"n": n, "i": i} for i in range(len(partials))], (n, got)
    counts = started(logs)
    assert sorted(counts) == list(range(requests + len(parts) + later))
    assert max(counts.values()) == 1, [n for n, c in counts.items() if c > 1]


def main(address: str, rank: int, implementation: str, log_path: str) -> None:
    with (
        open(log_path, "a", buffering=1) as log,
        Engine(
            address,
            rank=rank,
            implementation=implementation,
            heartbeat_interval=0.2,
            coordinator_timeout=1.0,
        ) as engine,
    ):
        generate_steadily(
            engine,
            lambda n: 1.5 + (n % 7) / 4,
            lambda numbers: log.write("".join(f"{n}\n" for n in numbers)),
            lambda: True,
            lambda n: log.write(f"abort {n}\n"),
        )


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
