"""What both coordinators share off the hot path: options, counters, texts, logging.

The two loops differ in how they move frames, never in what they decide; the
decisions that are data (control transitions, error texts, counter names,
option checks) live here once.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from enum import IntEnum
from typing import Any

import zmq

from .protocol import Buffer, ErrorCode, Header, packb, unpackb

logger = logging.getLogger("coordkit")


#: A kept prompt below this many bytes is copied: sharing it would pin the whole
#: receive buffer libzmq decoded it from (pyzmq's copy-below-a-threshold rule).
COPY_BELOW = 8192

#: Frames in one message beyond which it is dropped as malformed (a batch of
#: that many replies is far beyond any engine step).
MAX_PARTS = 1 << 16


class Counter(IntEnum):
    """Event counters; the C loop keeps the same order in a C array."""

    SUBMITTED = 0
    REPLIES = 1
    PARTIALS = 2
    ABORTS = 3
    RELEASE_KV = 4
    CONTROL = 5
    ERRORS_SENT = 6
    MALFORMED = 7
    UNKNOWN_HEADER = 8
    NOT_CONNECTED = 9
    UNKNOWN_REQUEST = 10
    DUPLICATE_REQUEST = 11
    BUSY = 12
    NO_ENGINES = 13
    INVALID_CONTROL = 14
    DUPLICATE_CONNECT = 15
    DUPLICATE_REGISTER = 16
    TABLE_FULL = 17
    REROUTED = 18
    ENGINE_FAILED = 19
    ENGINE_FAILURES = 20
    CLIENT_GONE = 21
    DETOKENIZED = 22
    DETOKENIZE_ERRORS = 23


class ControlState(IntEnum):
    RUNNING = 0
    PAUSED = 1
    SUSPENDED = 2


#: (state, signal) -> state after it; a signal absent for a state is dropped.
#: SET_GENERATION_EPOCH and the profiler signals are allowed in every state.
CONTROL_TRANSITIONS: dict[tuple[int, int], int] = {
    (ControlState.RUNNING, Header.PAUSE): ControlState.PAUSED,
    (ControlState.PAUSED, Header.UNPAUSE): ControlState.RUNNING,
    (ControlState.PAUSED, Header.SUSPEND): ControlState.SUSPENDED,
    (ControlState.SUSPENDED, Header.RESUME): ControlState.PAUSED,
    (ControlState.PAUSED, Header.STOP): ControlState.RUNNING,
    (ControlState.SUSPENDED, Header.STOP): ControlState.RUNNING,
}
for _state in ControlState:
    for _signal in (
        Header.SET_GENERATION_EPOCH,
        Header.START_CUDA_PROFILER,
        Header.STOP_CUDA_PROFILER,
    ):
        CONTROL_TRANSITIONS[(_state, _signal)] = _state

_ERROR_TEXT = {
    ErrorCode.MALFORMED: "malformed message",
    ErrorCode.UNKNOWN_HEADER: "header not accepted from a client",
    ErrorCode.NOT_CONNECTED: "send CONNECT first",
    ErrorCode.BUSY: "coordinator at capacity",
    ErrorCode.ENGINE_FAILED: "the engine serving the request failed",
    ErrorCode.NO_ENGINES: "no engine is available",
    ErrorCode.UNKNOWN_REQUEST: "no such request in flight",
    ErrorCode.DUPLICATE_REQUEST: "request id already in flight",
    ErrorCode.INVALID_STATE: "signal not allowed in the current control state",
    ErrorCode.SHUTTING_DOWN: "coordinator shut down",
}


def header_name(header: int) -> str:
    if header < 0:  # the header itself did not parse
        return "message"
    try:
        return Header(header).name
    except ValueError:
        return f"header {header}"


def error_text(code: int, header: int) -> str:
    """The ERROR message text: the same in both implementations, byte for byte."""
    return f"{header_name(header)}: {_ERROR_TEXT[ErrorCode(code)]}"


def read_connect(frames: int, frame: Buffer, length: int, end: int) -> bool | None:
    """Whether a CONNECT comes from a coordkit client; None when it is malformed.

    ``length`` and ``end`` are what the codec's ``read_header`` gave for ``frame``.
    """
    if frames != 1 or length > 2 or (length == 1 and end != len(frame)):
        return None
    if length == 1:
        return False  # Megatron's [0]
    try:
        hello = unpackb(frame)[1]
    except Exception:  # msgpack raises several unrelated types
        return None
    if not isinstance(hello, dict):
        return None
    version = hello.get("coordkit")
    return isinstance(version, int) and not isinstance(version, bool) and version >= 1


def valid_heartbeat(frames: int, metadata: Any) -> bool:
    """Whether a decoded HEARTBEAT is ``[91, pending, capacity]`` in one frame."""
    return (
        frames == 1
        and isinstance(metadata, list)
        and len(metadata) == 3
        and all(type(v) is int for v in metadata)
    )


def error_frame(rid: int | None, code: int, header: int) -> bytes:
    """The metadata frame of an ERROR message."""
    return packb([Header.ERROR, rid, code, error_text(code, header)])


def detokenize(detokenizer: Callable[[list[int]], str], body: Buffer) -> bytes:
    """A reply body with ``generated_text`` set from ``generated_tokens``.

    Raises whatever a bad body or a failing detokenizer raises; the caller
    then forwards the body untouched.
    """
    reply = unpackb(body)
    reply["generated_text"] = detokenizer(reply["generated_tokens"])
    return packb(reply)


_wake_ids = itertools.count()


class LoopSockets:
    """A coordinator's ROUTER, and the inproc pair through which stop() wakes its loop."""

    LINGER_MS = 500  # lets the final ERRORs of a shutdown reach their clients

    def __init__(self, bind: str, max_message_size: int, context: zmq.Context | None):
        self.context = context or zmq.Context.instance()
        self.router = self.context.socket(zmq.ROUTER)
        # A send to a peer that is gone fails (EHOSTUNREACH) instead of vanishing.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, 0)  # memory is bounded by max_inflight instead
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        self.router.setsockopt(zmq.LINGER, self.LINGER_MS)
        self.router.bind(bind)
        self.address: str = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        # A fresh name each time: libzmq frees an inproc name only a little after close.
        wake = f"inproc://coordkit-wake-{next(_wake_ids)}"
        self.wake_recv = self.context.socket(zmq.PAIR)
        self.wake_recv.bind(wake)
        self._wake_send = self.context.socket(zmq.PAIR)
        self._wake_send.connect(wake)
        self._lock = threading.Lock()
        self.closed = False

    def wake(self) -> None:
        """Ask the loop to stop; safe from any thread, a no-op once closed."""
        with self._lock:
            if not self.closed:
                self._wake_send.send(b"")

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self.router.close()
            self.wake_recv.close()
            self._wake_send.close(linger=0)


class RateLimitedLog:
    """At most one warning per kind per interval, with the count of those skipped."""

    def __init__(self, interval: float = 1.0):
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last.get(kind, -self.interval) < self.interval:
            self._skipped[kind] = self._skipped.get(kind, 0) + 1
            return
        skipped = self._skipped.pop(kind, 0)
        self._last[kind] = now
        suffix = f" ({skipped} more since the last report)" if skipped else ""
        logger.warning("%s%s", message, suffix)


def check_options(
    *,
    max_inflight: int,
    max_inflight_per_engine: int,
    heartbeat_timeout: float,
    drain_timeout: float,
    max_message_size: int,
    max_clients: int,
    max_engines: int,
) -> None:
    if not 1 <= max_inflight <= 1 << 30:
        raise ValueError("max_inflight must be between 1 and 2**30")
    if max_inflight_per_engine < 0:
        raise ValueError("max_inflight_per_engine must be >= 0 (0: no cap)")
    if heartbeat_timeout < 0 or drain_timeout < 0:
        raise ValueError("timeouts must be >= 0 (0 disables heartbeat expiry)")
    if max_message_size < -1 or max_message_size == 0:
        raise ValueError("max_message_size must be positive, or -1 for no limit")
    if not 1 <= max_clients <= 1 << 24 or not 1 <= max_engines <= 1 << 16:
        raise ValueError("max_clients must be in 1..2**24 and max_engines in 1..65536")


def table_size(max_inflight: int) -> int:
    """Slots in the request table: the power of two at or above max_inflight."""
    return 1 << (max_inflight - 1).bit_length()


def engine_state_name(state: int) -> str:
    return ("alive", "draining", "gone")[state]


def identity_text(identity: bytes) -> str:
    try:
        text = identity.decode()
    except UnicodeDecodeError:
        return identity.hex()
    return text if text.isprintable() else identity.hex()


def build_stats(
    *,
    implementation: str,
    policy: str,
    messages: int,
    inflight: int,
    clients: int,
    control_state: int,
    counters: list[int],
    engines: list[tuple[int, bytes, int, int]],
) -> dict[str, Any]:
    """The STATS_REPLY map; ``engines`` is (rank, identity, state, pending)."""
    return {
        "implementation": implementation,
        "policy": policy,
        "messages": messages,
        "inflight": inflight,
        "clients": clients,
        "control_state": ControlState(control_state).name.lower(),
        "counters": {c.name.lower(): counters[c] for c in Counter},
        "engines": [
            {
                "rank": rank,
                "identity": identity_text(identity),
                "state": engine_state_name(state),
                "pending": pending,
            }
            for rank, identity, state, pending in engines
        ],
    }
