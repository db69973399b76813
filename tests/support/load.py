"""A steady client load on a running coordinator, from a thread of the test's process.

:func:`client_load` runs a :class:`coordkit.Client` on a thread of its own: a
few requests at a time, half of them streamed (partials, then a final), each
with its block hashes (the prefix policy routes by them), until the block
exits. The engines are the test's (fake engine processes, say).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from coordkit.client import Client

JOIN_TIMEOUT = 10.0  # seconds the load's thread gets to end its requests in flight


@dataclass
class Load:
    """What the load has done so far (read from the test's thread)."""

    completed: int = 0
    failures: list[BaseException] = field(default_factory=list)


@contextlib.contextmanager
def client_load(
    address: str, engines: int, concurrency: int = 4, pause: float = 0.01
) -> Iterator[Load]:
    """Requests to ``address`` from ``concurrency`` tasks (the third and fourth of
    every four stream theirs), each pausing ``pause`` seconds between its requests
    (bounded: a test's few cores are shared), once ``engines`` engines are alive,
    until the block exits."""
    load = Load()
    stop = threading.Event()

    async def run() -> None:
        async with await Client.connect(address) as client:
            await client.wait_for_engines(engines, timeout=30.0)

            async def task(n: int) -> None:
                prompt = [n % 2] * 32 + list(range(16))  # two prefixes of two blocks each
                while not stop.is_set():
                    if n % 4 >= 2:
                        async for _ in client.stream(prompt, {"stream": True}, block_size=16):
                            pass
                    else:
                        await client.submit(prompt, block_size=16)
                    load.completed += 1
                    await asyncio.sleep(pause)

            await asyncio.gather(*(task(n) for n in range(concurrency)))

    def main() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # the test asserts there were none
            load.failures.append(exc)

    thread = threading.Thread(target=main, name="client-load", daemon=True)
    thread.start()
    try:
        yield load
    finally:
        stop.set()
        thread.join(JOIN_TIMEOUT)
