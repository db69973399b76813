"""An engine process whose requests take 1.5-3 s, for the failover tests.

``python -m tests.support.steady_engine ADDRESS RANK IMPL LOG`` runs a
:class:`coordkit.Engine` that generates for every request (its prompt's first
token is its number ``n``) for 1.5 + (n % 7) / 4 seconds; a streaming request
gets a partial ``{"n": n, "i": i}`` every 0.25 s, and every request ends with
``{"n": n, "partials": count}``. Each request it starts is written to LOG
(``n``, one a line, flushed at once), so that a test sees one started twice.
:func:`steady_engines` starts such processes for a test, :func:`started`
counts what their logs say.
"""

from __future__ import annotations

import collections
import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from coordkit.engine import Abort, Engine, Request
from coordkit.protocol import STREAM_KEY
from tests.support.processes import ROOT, python_env

PARTIAL_EVERY = 0.25


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
    return collections.Counter(
        int(line) for log in logs if log.exists() for line in log.read_text().split()
    )


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
    active: dict[int, list] = {}  # server rid -> [n, end, streaming, partials, next partial]
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
        while True:
            now = time.monotonic()
            for event in engine.poll(0.02):
                if isinstance(event, Request):
                    n = event.prompt_tokens()[0]
                    log.write(f"{n}\n")
                    streaming = bool((event.sampling_params or {}).get(STREAM_KEY))
                    end = now + 1.5 + (n % 7) / 4
                    active[event.server_rid] = [n, end, streaming, 0, now + PARTIAL_EVERY]
                elif isinstance(event, Abort) and event.server_rid in active:
                    active[event.server_rid][1] = now
            partials, finals = [], []
            for rid, state in list(active.items()):
                n, end, streaming, count, next_partial = state
                if now >= end:
                    finals.append((rid, {"n": n, "partials": count}))
                    del active[rid]
                elif streaming and now >= next_partial:
                    partials.append((rid, {"n": n, "i": count}))
                    state[3], state[4] = count + 1, next_partial + PARTIAL_EVERY
            engine.reply_partial(partials)
            engine.reply(finals)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
