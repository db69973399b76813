"""Raw protocol peers for the coordinator tests: plain pyzmq DEALERs.

They know nothing of coordkit beyond the published frame layouts, so they
stand for Megatron-LM's own client and engines (and for any other peer that
speaks the wire format).

``RawClient`` and ``RawEngine`` speak the multipart layouts (Megatron-LM's
PR #6497, and coordkit's own endpoints); ``SingleFrameClient`` and
``SingleFrameEngine`` speak Megatron-Core 0.19's, one msgpack frame per
message. Run as a script, this module is a single-frame engine process
(``python -m tests.support.peers --help``), for the tests that SIGKILL one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
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
ENGINE_ACK = 97
REJOIN = 98
RESEND = 99
HELD = 100
HANDLED = 101
REPLAY = 102
REPLAYED = 103


def m(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def um(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


class Peer:
    """A DEALER connected to the coordinator (or not yet, to set options first)."""

    def __init__(
        self, ctx: zmq.Context, address: str, identity: bytes | None = None, connect: bool = True
    ):
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        if connect:
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
    def connect(self, coordkit: bool = False, batch: bool = False) -> RawClient:
        """CONNECT; ``batch`` asks for batches (a coordkit client), and must be granted."""
        if batch:
            self.send(m([CONNECT, {"coordkit": 1, "batch": 1}]))
            assert self.recv() == [m([CONNECT_ACK, {"batch": 1}])]
            return self
        self.send(m([CONNECT, {"coordkit": 1}]) if coordkit else m([CONNECT]))
        assert self.recv() == [m([CONNECT_ACK])]
        return self


class RawEngine(Peer):
    def register(self) -> RawEngine:
        self.send(b"")
        return self

    def hello(self, **features: int) -> RawEngine:
        """ENGINE_HELLO: a coordkit engine registers (or says so once registered)."""
        self.send(m([ENGINE_HELLO, {"coordkit": 1, **features}]))
        return self


# -- Megatron-Core 0.19: one frame per message ---------------------------------------
#
#   CONNECT / CONNECT_ACK   client <-> coord     m([0]) / m([1])
#   SUBMIT_REQUEST          client -> coord      m([20, client_rid, prompt, sampling_params])
#                           coord -> engine      m([20, server_rid, prompt, sampling_params])
#   ENGINE_REPLY            engine -> coord      m([21, [finished_request, ...]]), each a map
#                                                whose "request_id" is the server id
#                           coord -> client      m([21, client_rid, finished_request])
#   control 40-47           client -> coord -> every engine: m([h]), m([44, epoch])
#   DISCONNECT / SHUTDOWN   engine -> coord / client -> coord: m([60]) / m([61])
#   registration            engine -> coord      one empty frame


def array_header(n: int) -> bytes:
    return msgpack.Packer().pack_array_header(n)


def splice(*parts: Any) -> bytes:
    """An array frame of ``parts``, each a value to pack or ``Raw`` bytes put in as
    they are: what a frame holding a span of another frame looks like."""
    return array_header(len(parts)) + b"".join(
        p.data if isinstance(p, Raw) else m(p) for p in parts
    )


class Raw:
    """Bytes that are already msgpack (a prompt, a map), for :func:`splice`."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = data


class SingleFramePeer(Peer):
    def recv_frame(self, timeout: float = WAIT) -> bytes:
        """The next message, which must be a single frame."""
        frames = self.recv(timeout)
        assert len(frames) == 1, f"a single-frame peer got {len(frames)} frames: {frames!r}"
        return frames[0]

    def recv_frames(self, timeout: float = 0.3) -> list[bytes]:
        """Every message that arrives until ``timeout`` passes with none, each a single frame."""
        messages = self.recv_all(timeout)
        assert all(len(frames) == 1 for frames in messages), messages
        return [frames[0] for frames in messages]


class SingleFrameClient(SingleFramePeer):
    """Megatron-Core 0.19's ``InferenceClient`` on the wire."""

    def connect(self) -> SingleFrameClient:
        self.send(m([CONNECT]))
        assert um(self.recv_frame())[0] == CONNECT_ACK  # all 0.19's client reads of it
        return self

    def submit(self, rid: int, prompt: Any, sampling_params: Any) -> bytes:
        """Send a request; the frame sent (bytes given for prompt or params go in as they are)."""
        frame = splice(SUBMIT, rid, _raw(prompt), _raw(sampling_params))
        self.send(frame)
        return frame

    def signal(self, header: int, *args: Any) -> None:
        self.send(m([header, *args]))

    def shutdown(self) -> None:
        self.signal(SHUTDOWN)

    def recv_reply(self, timeout: float = WAIT) -> tuple[int, bytes]:
        """The next reply: its client rid and the finished request's bytes, as they came."""
        frame = self.recv_frame(timeout)
        return reply_parts(frame)


def reply_parts(frame: bytes) -> tuple[int, bytes]:
    """``(client_rid, finished_request bytes)`` of a reply ``[21, client_rid, map]``."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(frame)
    assert unpacker.read_array_header() == 3
    assert unpacker.unpack() == REPLY
    rid = unpacker.unpack()
    start = unpacker.tell()
    assert isinstance(um(frame[start:]), dict)  # exactly one map, to the end
    return rid, frame[start:]


class SingleFrameEngine(SingleFramePeer):
    """A Megatron-Core 0.19 engine rank (its ``mp-coord-N`` socket) on the wire."""

    def register(self) -> SingleFrameEngine:
        self.send(b"")
        return self

    def recv_submit(self, timeout: float = WAIT) -> tuple[int, bytes, bytes]:
        """The next SUBMIT: ``(server_rid, prompt bytes, params bytes)``, spans of the frame."""
        return submit_parts(self.recv_frame(timeout))

    def reply(self, *finished: Any) -> bytes:
        """One ENGINE_REPLY with these finished requests (maps, or their bytes as they are)."""
        entries = b"".join(_raw(f).data for f in finished)
        frame = splice(REPLY, Raw(array_header(len(finished)) + entries))
        self.send(frame)
        return frame

    def disconnect(self) -> None:
        self.send(m([DISCONNECT]))


def submit_parts(frame: bytes) -> tuple[int, bytes, bytes]:
    """``(rid, prompt bytes, params bytes)`` of ``[20, rid, prompt, params]``."""
    unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
    unpacker.feed(frame)
    assert unpacker.read_array_header() == 4
    assert unpacker.unpack() == SUBMIT
    rid = unpacker.unpack()
    start = unpacker.tell()
    unpacker.skip()
    middle = unpacker.tell()
    unpacker.skip()
    assert unpacker.tell() == len(frame)
    return rid, frame[start:middle], frame[middle:]


def finished_request(server_rid: int, prompt: Any = None, **fields: Any) -> dict[str, Any]:
    """A finished request as 0.19's engine serializes one (a few of its fields)."""
    return {
        "request_id": server_rid,
        "prompt": prompt,
        "generated_tokens": [7, 8, 9],
        "generated_text": None,
        "status": "COMPLETED",
        **fields,
    }


def _raw(value: Any) -> Raw:
    if isinstance(value, Raw):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        return Raw(bytes(value))
    return Raw(m(value))


def wait_for(condition: Callable[[], bool], timeout: float = WAIT) -> None:
    """Wait until ``condition()`` holds (the coordinator runs on another thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.002)


# -- a single-frame engine process ---------------------------------------------------


def serve_single_frame_engine(address: str, identity: bytes, hold: bool, batch: int = 4) -> None:
    """Register, then answer each SUBMIT with a finished request echoing its prompt
    (``batch`` of them per ENGINE_REPLY, or fewer when no more are waiting) — or,
    with ``hold``, keep every request and answer none, until killed."""
    ctx = zmq.Context()
    engine = SingleFrameEngine(ctx, address, identity).register()
    waiting: list[bytes] = []
    while True:
        if not engine.sock.poll(50 if waiting else 1000):
            if waiting:
                engine.reply(*waiting)
                waiting.clear()
            continue
        frame = engine.recv_frame()
        if um(frame)[0] != SUBMIT or hold:
            continue
        rid, prompt, _ = submit_parts(frame)
        waiting.append(m(finished_request(rid, um(prompt))))
        if len(waiting) >= batch:
            engine.reply(*waiting)
            waiting.clear()


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a Megatron-Core 0.19 engine rank, on the wire")
    parser.add_argument("--address", required=True)
    parser.add_argument("--identity", required=True)
    parser.add_argument("--hold", action="store_true", help="keep every request, answer none")
    args = parser.parse_args(argv)
    serve_single_frame_engine(args.address, args.identity.encode(), args.hold)


if __name__ == "__main__":
    _main()

#: What a coordkit Engine adds to its ENGINE_HELLO by default: it takes part in the
#: rebuild, its reply messages numbered from 1.
REBUILD_HELLO = {"rebuild": 1, "base": 1}
