"""A scripted coordinator for the client tests: a bare ROUTER on the test's event loop.

The test plays the coordinator's side frame by frame (it may grant batches in
its CONNECT_ACK); ``run`` runs an async test body under ``asyncio.run``,
bounded in time (no pytest-asyncio); every receive has its own timeout too.
``same_frames`` is the client tests' differential: both cores' clients make the
same calls, and the Script must get the same frames from each.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from coordkit import Client
from tests.support.peers import CONNECT, CONNECT_ACK

TIMEOUT = 5.0


def run(coroutine: Any, timeout: float = 60.0) -> Any:
    """Run an async test body, bounded in time."""
    return asyncio.run(asyncio.wait_for(coroutine, timeout))


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


class Script:
    """A bare ROUTER standing in for the coordinator, on the test's event loop."""

    def __init__(self, tmp_path: Path):
        self.socket = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.address = f"ipc://{tmp_path}/script.sock"
        self.socket.bind(self.address)
        self.identity = b""

    async def recv(self, timeout: float = TIMEOUT) -> list[bytes]:
        identity, *frames = await asyncio.wait_for(self.socket.recv_multipart(), timeout)
        self.identity = identity
        return frames

    async def send(self, *frames: bytes) -> None:
        await self.socket.send_multipart([self.identity, *frames])

    async def drain(self, quiet: float = 0.1) -> list[list[bytes]]:
        """Every message that arrives until ``quiet`` seconds pass with none."""
        received = []
        while True:
            try:
                received.append(await self.recv(timeout=quiet))
            except asyncio.TimeoutError:
                return received

    async def silent(self, timeout: float = 0.2) -> None:
        """Nothing arrives within ``timeout``."""
        with contextlib.suppress(asyncio.TimeoutError):
            frames = await self.recv(timeout)
            raise AssertionError(f"unexpected message {frames!r}")

    async def connect(
        self, impl: Any, grant: bool = False, qos: bool = False, **kwargs: Any
    ) -> Client:
        """A client of ``impl`` connected to this script; ``grant`` grants it batches,
        ``qos`` priorities and deadlines."""
        connecting = asyncio.ensure_future(
            Client.connect(self.address, timeout=TIMEOUT, implementation=impl.name, **kwargs)
        )
        hello = {"coordkit": 1, "qos": 1}
        if kwargs.get("tenant") is not None:
            hello["tenant"] = kwargs["tenant"]
        if kwargs.get("batch") is not False:
            hello["batch"] = 1
        failover = kwargs.get("failover_timeout", 30.0)
        if failover > 0:
            # Not granted here: the client then fails what is pending.
            hello.update({"rebuild": 1, "hold_ms": round(failover * 1000)})
        assert await self.recv() == [packb([CONNECT, hello])]
        features = {**({"batch": 1} if grant else {}), **({"qos": 1} if qos else {})}
        await self.send(packb([CONNECT_ACK, features]) if features else packb([CONNECT_ACK]))
        client = await connecting
        assert client.implementation == impl.name
        assert client.batch is grant
        assert client.qos is qos
        return client

    def close(self) -> None:
        self.socket.close()


@contextlib.asynccontextmanager
async def scripted(
    tmp_path: Path, impl: Any, **kwargs: Any
) -> AsyncIterator[tuple[Script, Client]]:
    """A Script and a client connected to it (``grant=True``: with batches, ``qos=True``:
    priorities and deadlines)."""
    script = Script(tmp_path)
    try:
        async with await script.connect(impl, **kwargs) as client:
            yield script, client
    finally:
        script.close()


def same_frames(
    c_impl: Any,
    py_impl: Any,
    tmp_path_factory: Any,
    play: Callable[[Client], Awaitable[None]],
    **kwargs: Any,
) -> None:
    """The differential: a client of each core, connected to a Script (``kwargs`` as
    :func:`scripted` takes them), does ``play``; the frames the Script gets until it
    is quiet are the same."""

    async def frames_of(impl: Any) -> list[list[bytes]]:
        async with scripted(tmp_path_factory.mktemp("frames"), impl, **kwargs) as (script, client):
            await play(client)
            return await script.drain()

    frames = [run(frames_of(impl)) for impl in (c_impl, py_impl)]
    assert frames[0] == frames[1]
