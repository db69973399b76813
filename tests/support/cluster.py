"""A running coordinator of either implementation, with raw peers around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import zmq

from coordkit import Coordinator
from tests.support.peers import (
    MainClient,
    MainEngine,
    Peer,
    RawClient,
    RawEngine,
    SingleFrameClient,
    SingleFrameEngine,
    wait_for,
)


def bind_address(transport: str, directory: Path, name: str = "coord") -> str:
    """An ipc socket in ``directory``, or any free port on tcp://127.0.0.1."""
    if transport == "ipc":
        return f"ipc://{directory}/{name}.sock"
    if transport == "tcp":
        return "tcp://127.0.0.1:0"
    raise ValueError(f"transport must be 'ipc' or 'tcp', not {transport!r}")


class Cluster:
    """A running coordinator with raw engines and clients, closed on exit."""

    def __init__(self, impl: Any, address: str, n_engines: int = 0, **options: Any):
        self.ctx = zmq.Context()
        self.closed = False
        if address.startswith("inproc://"):  # its peers reach it only in its context
            options.setdefault("context", self.ctx)
        self.coord = Coordinator(address, implementation=impl.name, **options)
        self.coord.start()
        self.engines: list[RawEngine | SingleFrameEngine | MainEngine] = []
        self.peers: list[Peer] = []
        for _ in range(n_engines):
            self.add_engine()

    def add_engine(self, identity: bytes | None = None) -> RawEngine:
        engine = RawEngine(self.ctx, self.coord.address, identity or self._engine_id())
        return self._registered(engine.register())

    def add_coordkit_engine(self, identity: bytes | None = None, batch: bool = False) -> RawEngine:
        """A multipart engine that says so: registration, then ENGINE_HELLO (asking
        for batches with ``batch``), handled."""
        engine = self.add_engine(identity)
        messages = self.coord.stats()["messages"]
        engine.hello(**({"batch": 1} if batch else {}))
        wait_for(lambda: self.coord.stats()["messages"] > messages)
        return engine

    def add_single_frame_engine(self, identity: bytes | None = None) -> SingleFrameEngine:
        """A Megatron-Core 0.19 engine rank (one frame per message)."""
        engine = SingleFrameEngine(self.ctx, self.coord.address, identity or self._engine_id())
        return self._registered(engine.register())

    def add_main_engine(self, identity: bytes | None = None) -> MainEngine:
        """A Megatron main engine rank (one frame per message, main's layouts)."""
        engine = MainEngine(self.ctx, self.coord.address, identity or self._engine_id())
        return self._registered(engine.register())

    def _engine_id(self) -> bytes:
        return f"engine-{len(self.engines)}".encode()

    def _registered(self, engine: Any) -> Any:
        rank = len(self.engines)
        self.engines.append(engine)
        self.peers.append(engine)
        wait_for(lambda: len(self.coord.stats()["engines"]) > rank)
        return engine

    def client(
        self, coordkit: bool = False, identity: bytes | None = None, batch: bool = False
    ) -> RawClient:
        client = RawClient(self.ctx, self.coord.address, identity)
        self.peers.append(client)
        return client.connect(coordkit, batch)

    def single_frame_client(self, identity: bytes | None = None) -> SingleFrameClient:
        """A Megatron-Core 0.19 client (one frame per message), connected."""
        client = SingleFrameClient(self.ctx, self.coord.address, identity)
        self.peers.append(client)
        return client.connect()

    def main_client(self, identity: bytes | None = None) -> MainClient:
        """A Megatron main client (one frame per message, main's layouts), connected."""
        client = MainClient(self.ctx, self.coord.address, identity)
        self.peers.append(client)
        return client.connect()

    def close(self) -> None:
        if self.closed:  # by its with block, then by the fixture that made it
            return
        self.closed = True
        self.coord.stop()
        for peer in self.peers:
            peer.close()
        self.ctx.term()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
