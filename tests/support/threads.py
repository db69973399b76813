"""FakeEngines running on threads of the test's own process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from coordkit.tools.fake_engine import FakeEngine

JOIN_TIMEOUT = 5.0  # seconds an engine's thread gets to finish its step


@contextlib.contextmanager
def fake_engines(
    address: str, count: int, first: int = 0, **options: Any
) -> Iterator[list[FakeEngine]]:
    """``count`` FakeEngines (ranks ``first`` on, no heartbeats) running on threads."""
    stop = threading.Event()
    engines = [
        FakeEngine(address, rank, heartbeat_interval=None, **options)
        for rank in range(first, first + count)
    ]
    threads = [threading.Thread(target=e.run, args=(stop,), daemon=True) for e in engines]
    for thread in threads:
        thread.start()
    try:
        yield engines
    finally:
        stop.set()
        for thread, engine in zip(threads, engines, strict=True):
            thread.join(JOIN_TIMEOUT)
            engine.close()
