"""Raw protocol peers for the coordinator tests: plain pyzmq DEALERs.

They know nothing of coordkit beyond the published frame layouts, so they
stand for Megatron-LM's own client and engines (and for any other peer that
speaks the wire format).

``RawClient`` and ``RawEngine`` speak the multipart layouts (Megatron-LM's
PR #6497, and coordkit's own endpoints); ``SingleFrameClient`` and
``SingleFrameEngine`` speak Megatron-Core 0.19's, one msgpack frame per
message; ``MainClient`` and ``MainEngine`` Megatron main's (d98e8a6,
megatron-core 0.20), which adds the five-field SUBMIT, partial replies, ABORT
and the KV handoff. ``parse_019_engine``, ``parse_main_engine`` and
``parse_main_client`` do to a frame what those peers' receive loops do, and fail
where they would raise. Run as a script, this module is a single-frame engine
process (``python -m tests.support.peers --help``), for the tests that SIGKILL one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgpack
import zmq

if TYPE_CHECKING:
    from typing_extensions import Self

WAIT = 5.0  # seconds any single expected message may take

# The published header values, spelled out rather than imported: these peers
# stand for implementations that share the wire format, not coordkit's code.
CONNECT = 0
CONNECT_ACK = 1
REGISTER_ROLE_ACK = 2  # PR #6675's disaggregated prefill/decode (P/D)
SUBMIT = 20
REPLY = 21
PARTIAL = 22
ABORT = 23
SUBMIT_KV = 24
RELEASE_KV = 25
SEND_KV = 26
REGISTER_ROLE = 27
KV_READ_DONE = 28
REQUEST_ERROR = 29
KV_TRANSFER_READY = 30
REQUEST_ABORTED = 31
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
HANDOFF = 104


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

    def connect(self) -> Self:
        self.send(m([CONNECT]))
        assert um(self.recv_frame())[0] == CONNECT_ACK  # all Megatron's client reads of it
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

    def register(self) -> Self:
        self.send(b"")
        return self

    def recv_submit(self, timeout: float = WAIT) -> tuple[int, bytes, bytes]:
        """The next SUBMIT: ``(server_rid, prompt bytes, params bytes)``, spans of the frame."""
        return submit_parts(self.recv_frame(timeout))

    def reply(self, *finished: Any) -> bytes:
        """One ENGINE_REPLY with these finished requests (maps, or their bytes as they are)."""
        return self._send_batch(REPLY, finished)

    def _send_batch(self, header: int, entries: Sequence[Any]) -> bytes:
        body = b"".join(_raw(entry).data for entry in entries)
        frame = splice(header, Raw(array_header(len(entries)) + body))
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


# -- Megatron main (d98e8a6, megatron-core 0.20): 0.19's frames, and ----------------
#
#   SUBMIT_REQUEST          client -> coord      m([20, client_rid, prompt, sampling_params,
#                                                   multi_modal_data]) (None for text)
#                           coord -> engine      the same with the server id (an engine takes
#                                                0.19's four fields too)
#   ENGINE_REPLY_PARTIAL    engine -> coord      m([22, [partial, ...]]), each a map whose
#                                                "request_id" is the server id
#                           coord -> client      m([22, client_rid, partial])
#   ABORT_REQUEST           client -> coord      m([23, client_rid])
#                           coord -> its engine  m([23, server_rid])
#   SUBMIT_REQUEST_WITH_KV  client -> coord      m([24, client_rid, prompt, sampling_params,
#                                                   kv_meta, src_block_ids])
#                           coord -> engine      the same with the server id
#   RELEASE_KV              client -> coord -> every engine: m([25, request_id]), unchanged
#   SEND_KV                 an engine's (26): main's coordinator has no handler for it
#
# A main client always sends the five-field SUBMIT; its finals come as 0.19's do,
# the maps carrying main's fields too ("uid", "disaggregated_params", ...).

#: The headers each release's Headers(value) decodes; any other raises UnknownHeaderError.
HEADERS_019 = frozenset({0, 1, 20, 21, *range(40, 48), 60, 61, 80})
HEADERS_MAIN = HEADERS_019 | {22, 23, 24, 25, 26, 81}


def parse_019_engine(frame: bytes) -> list[Any]:
    """What 0.19's engine does to a frame from the coordinator (schedule_requests): the
    header decoded, a SUBMIT unpacked into exactly three fields; AssertionError where
    it would raise."""
    data = um(frame)
    assert data[0] in HEADERS_019, f"0.19's engine raises UnknownHeaderError on {data[0]}"
    assert data[0] not in (CONNECT_ACK, REPLY), f"not an engine's: {data!r}"
    if data[0] == SUBMIT:
        assert len(data) == 4, f"0.19's engine unpacks three fields, not {len(data) - 1}"
        assert isinstance(data[2], (str, list)) and isinstance(data[3], dict)
    return data


def parse_main_engine(frame: bytes) -> list[Any]:
    """What main's engine does to a frame from the coordinator (schedule_requests)."""
    data = um(frame)
    assert data[0] in HEADERS_MAIN, f"main's engine raises UnknownHeaderError on {data[0]}"
    if data[0] == SUBMIT:  # [request_id, prompt, sampling_params(, multi_modal_data)]
        assert len(data) in (4, 5), f"main's engine unpacks 3 or 4 fields, not {len(data) - 1}"
        assert isinstance(data[3], dict)
    elif data[0] == SUBMIT_KV:
        assert len(data) == 6, f"main's engine unpacks five fields, not {len(data) - 1}"
    elif data[0] in (ABORT, RELEASE_KV):
        assert len(data) >= 2 and isinstance(data[1], int)
    return data


def parse_main_client(frame: bytes) -> tuple[int, int, Any]:
    """What main's client does to a frame (_recv_task): ``(header, client_rid, map)`` of
    a final ``[21, rid, reply]`` (its latency is set: a map) or a partial ``[22, rid,
    partial]``."""
    data = um(frame)
    assert data[0] in HEADERS_MAIN, f"main's client raises UnknownHeaderError on {data[0]}"
    assert data[0] in (REPLY, PARTIAL), f"main's client has no use for {data!r}"
    header, rid, body = data  # request_id, reply = data[1:]
    assert isinstance(body, dict), "main's client sets reply['latency']: a map"
    return header, rid, body


class MainClient(SingleFrameClient):
    """Megatron main's ``InferenceClient`` on the wire: 0.19's, and main's layouts."""

    def submit(  # main's client sends five fields, always
        self, rid: int, prompt: Any, sampling_params: Any, multi_modal_data: Any = None
    ) -> bytes:
        """add_request (add_request_streaming sets "streaming" in the params): the frame
        sent. Bytes given for a field go in as they are."""
        frame = splice(SUBMIT, rid, _raw(prompt), _raw(sampling_params), _raw(multi_modal_data))
        self.send(frame)
        return frame

    def submit_with_kv(
        self, rid: int, prompt: Any, sampling_params: Any, kv_meta: Any, src_block_ids: Any
    ) -> bytes:
        """add_request_with_kv_handoff: the frame sent."""
        parts = (prompt, sampling_params, kv_meta, src_block_ids)
        frame = splice(SUBMIT_KV, rid, *(_raw(part) for part in parts))
        self.send(frame)
        return frame

    def abort(self, rid: int) -> None:
        self.send(m([ABORT, rid]))

    def release_handoff(self, request_id: int) -> None:
        self.send(m([RELEASE_KV, request_id]))

    def recv_message(self, timeout: float = WAIT) -> tuple[int, int, bytes]:
        """The next message: ``(header, client_rid, body bytes as they came)``, which main's
        client must parse."""
        frame = self.recv_frame(timeout)
        header, rid, _ = parse_main_client(frame)
        head = array_header(3) + m(header) + m(rid)
        assert frame.startswith(head)
        return header, rid, frame[len(head) :]


class MainEngine(SingleFrameEngine):
    """A Megatron main engine rank (its ``mp-coord-N`` socket) on the wire: 0.19's, and
    main's partial replies."""

    def recv_parsed(self, timeout: float = WAIT) -> tuple[list[Any], bytes]:
        """The next message, parsed as main's engine parses it, and its frame."""
        frame = self.recv_frame(timeout)
        return parse_main_engine(frame), frame

    def partial(self, *partials: Any) -> bytes:
        """One ENGINE_REPLY_PARTIAL with these partials (maps, or their bytes)."""
        return self._send_batch(PARTIAL, partials)


def main_partial(server_rid: int, new_tokens: list[int]) -> dict[str, Any]:
    """A partial reply as main's engine builds one (_try_send_streaming_partials)."""
    return {"request_id": server_rid, "new_tokens": new_tokens}


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


def serve_single_frame_engine(
    address: str, identity: bytes, hold: bool, batch: int = 4, main: bool = False
) -> None:
    """Register, then answer each SUBMIT with a finished request echoing its prompt
    (``batch`` of them per ENGINE_REPLY, or fewer when no more are waiting) — or,
    with ``hold``, keep every request and answer none, until killed. ``main``: a
    Megatron main engine, which takes main's five-field SUBMIT too."""
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
        rid, prompt = parse_main_engine(frame)[1:3] if main else parse_019_engine(frame)[1:3]
        waiting.append(m(finished_request(rid, prompt)))
        if len(waiting) >= batch:
            engine.reply(*waiting)
            waiting.clear()


def _main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="a Megatron-Core 0.19 engine rank, on the wire")
    parser.add_argument("--address", required=True)
    parser.add_argument("--identity", required=True)
    parser.add_argument("--hold", action="store_true", help="keep every request, answer none")
    parser.add_argument("--main", action="store_true", help="Megatron main's (five-field SUBMIT)")
    args = parser.parse_args(argv)
    serve_single_frame_engine(args.address, args.identity.encode(), args.hold, main=args.main)


if __name__ == "__main__":
    _main()

#: What a coordkit Engine adds to its ENGINE_HELLO by default: it takes part in the
#: rebuild, its reply messages numbered from 1.
REBUILD_HELLO = {"rebuild": 1, "base": 1}


def engine_hello(frame: bytes) -> dict[str, Any]:
    """A coordkit Engine's ENGINE_HELLO map, its process's token (``session``, drawn at
    random) checked and left out, so that the rest compares as it is."""
    header, hello = um(frame)
    assert header == ENGINE_HELLO
    session = hello.pop("session")
    assert type(session) is int and 0 < session < 1 << 63
    return hello
