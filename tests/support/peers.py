"""Raw protocol peers for the coordinator tests: plain pyzmq DEALERs.

They know nothing of coordkit beyond the published frame layouts, so they
stand for Megatron-LM's own client and engines (and for any other peer that
speaks the wire format).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

WAIT = 5.0  # seconds any single expected message may take

# The published header values, spelled out rather than imported: these peers
# stand for implementations that share the wire format, not coordkit's code.
CONNECT = 0
CONNECT_ACK = 1
SUBMIT = 20
REPLY = 21
PARTIAL = 22
ABORT = 23
SUBMIT_KV = 24
RELEASE_KV = 25
PAUSE = 40
UNPAUSE = 41
SUSPEND = 42
RESUME = 43
SET_GENERATION_EPOCH = 44
STOP = 45
START_CUDA_PROFILER = 46
STOP_CUDA_PROFILER = 47
DISCONNECT = 60
SHUTDOWN = 61
# coordkit's own messages
ERROR = 90
HEARTBEAT = 91
STATS = 92
STATS_REPLY = 93
ENGINE_HELLO = 94
SUBMIT_BATCH = 95
REPLY_BATCH = 96


def m(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def um(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Peer:
    """A DEALER connected to the coordinator."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes | None = None):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(address)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = WAIT) -> list[bytes]:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no message arrived")
        return self.sock.recv_multipart()

    def recv_all(self, timeout: float = 0.3) -> list[list[bytes]]:
        """Every message that arrives until ``timeout`` passes with none."""
        messages = []
        while self.sock.poll(int(timeout * 1000)):
            messages.append(self.sock.recv_multipart())
        return messages

    def assert_silent(self, timeout: float = 0.2) -> None:
        assert not self.sock.poll(int(timeout * 1000)), self.sock.recv_multipart()

    def close(self) -> None:
        self.sock.close(linger=0)


class RawClient(Peer):
    def connect(self, coordkit: bool = False) -> RawClient:
        self.send(m([CONNECT, {"coordkit": 1}]) if coordkit else m([CONNECT]))
        assert self.recv() == [m([CONNECT_ACK])]
        return self


class RawEngine(Peer):
    def register(self) -> RawEngine:
        self.send(b"")
        return self


def wait_for(condition: Callable[[], bool], timeout: float = WAIT) -> None:
    """Wait until ``condition()`` holds (the coordinator runs on another thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)
