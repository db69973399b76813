"""The wire protocol: header values, error codes and one declaration per message.

Every message is ZeroMQ multipart: frame 0 is a small msgpack *metadata*
frame ``[header, *fields]``; the frames after it are opaque *payload* the
coordinator forwards without decoding. Headers 0-61 and their layouts are
those of Megatron-LM's data-parallel coordinator after its multipart split;
coordkit's own messages use 90 and up and go only to clients that said
``{"coordkit": 1}`` in CONNECT.

Each message is declared once, as a :class:`MessageSpec` (or a
:class:`BatchedMessageSpec` for the per-entry batches engines send);
``pack`` and ``parse`` are derived from the declaration, and ``parse``
validates: a wrong frame count, field count or field type raises
:class:`ProtocolError` naming the message and what was wrong.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import namedtuple
from collections.abc import Iterable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple, cast

import msgpack
import zmq

__all__ = [
    "Header",
    "ErrorCode",
    "ProtocolError",
    "Field",
    "MessageSpec",
    "BatchedMessageSpec",
    "ControlState",
    "CONTROL_HEADERS",
    "CONTROL_TRANSITIONS",
    "COORDKIT_HELLO",
    "BLOCK_HASH_SIZE",
    "MAX_PARTS",
    "STREAM_KEY",
    "RESUMABLE_KEY",
    "BUDGET_KEYS",
    "error_text",
    "header_name",
    "parse_connect",
    "parse_engine_hello",
    "engine_ack",
    "role_name",
    "Hello",
    "EngineRole",
    "ROLE_NAMES",
    "ROLE_KEY",
    "CAPACITY_KEY",
    "DOMAIN_KEY",
    "TRANSFER_KEY",
    "HANDOFF_KEY",
    "BATCH_FEATURE",
    "ACK_FEATURE",
    "REBUILD_FEATURE",
    "EPOCH_KEY",
    "HOLD_KEY",
    "MAX_HOLD_MS",
    "QOS_FEATURE",
    "METRICS_FEATURE",
    "asks_metrics",
    "TENANT_KEY",
    "MAX_TENANT_BYTES",
    "CAPACITY_KEY",
    "MAX_CAPACITY",
    "PRIORITY_MIN",
    "PRIORITY_MAX",
    "valid_tenant",
    "rejoin_covers",
    "Trailer",
    "pack_trailer",
    "rids_message",
    "parse_trailer",
    "block_hashes",
    "packb",
    "unpackb",
]

Buffer = bytes | bytearray | memoryview
#: A frame as specs parse it: bytes-like, or a zmq.Frame (which exports its buffer).
Frame = Buffer | zmq.Frame

#: The map a coordkit client sends in CONNECT so the coordinator may answer
#: it with coordkit's own messages (ERROR, STATS_REPLY).
COORDKIT_HELLO = {"coordkit": 1}

#: The key of a CONNECT or ENGINE_HELLO map that asks for batched messages
#: (SUBMIT_BATCH, REPLY_BATCH); a coordinator that grants it to a client says
#: so in its CONNECT_ACK.
BATCH_FEATURE = "batch"

#: The key of an ENGINE_HELLO map by which a coordkit engine says it reads
#: ENGINE_ACK: only such an engine is sent one (an engine of coordkit 0.1,
#: which does not, would log it as an unknown header; Megatron's engines send
#: no ENGINE_HELLO at all).
ACK_FEATURE = "ack"

#: The key of a CONNECT or ENGINE_HELLO map by which a coordkit peer says it takes
#: part in the rebuild after a coordinator's loss (a client keeps its requests and
#: REJOINs; an engine keeps what it sent and reports what it holds); a coordinator
#: that grants it says so in its answer, with its epoch under EPOCH_KEY.
REBUILD_FEATURE = "rebuild"
EPOCH_KEY = "epoch"
#: The key of a rebuild client's CONNECT map: how long (ms, its failover_timeout) it
#: rides through a lost connection; the coordinator keeps its requests that long
#: after the connection ends, at most MAX_HOLD_MS (0 or absent: aborted at once).
HOLD_KEY = "hold_ms"
MAX_HOLD_MS = 60_000
#: The key of a rebuild engine's ENGINE_HELLO map: the number its next reply message
#: has (see HANDLED).
BASE_KEY = "base"
#: The key of an ENGINE_ACK map granting the rebuild by which the coordinator asks the
#: engine to list in HELD every request it holds, a client's that did not ask for the
#: rebuild too (its client id nil): an engine back on a new connection then says what
#: it never got (the connection broke with it on the way), which is sent again.
HELD_ALL_KEY = "held_all"

#: The key of a coordkit engine's ENGINE_HELLO map: a token of its process (an int64
#: above 0, drawn once per Engine), the same in every hello it sends. A registration
#: under an engine's identity whose hello names another token is another process: the
#: old one's requests are handled as its death.
SESSION_KEY = "session"

#: The key of a CONNECT map by which a coordkit client says it may send a request's
#: priority and deadline (its QoS fields, right after the request id: see
#: SUBMIT_REQUEST_QOS); a coordinator that queues grants it in its CONNECT_ACK, and
#: only then does the client send them (a coordinator that does not queue has nothing
#: a priority or a deadline could change).
QOS_FEATURE = "qos"
#: The key of a STATS map by which a coordkit client asks for metrics() too (the
#: histograms ``coordkit top`` shows): ``m([92, {"metrics": 1}])``, answered with
#: stats() and metrics() under "metrics" in one STATS_REPLY; a bare ``m([92])`` is
#: answered with stats() alone, as ever.
METRICS_FEATURE = "metrics"
#: The key of a CONNECT map naming the client's tenant: the clients that name the same
#: one share its place in the coordinator's queue (docs/queueing.md). A client that
#: names none is a tenant of its own.
TENANT_KEY = "tenant"
#: A tenant's name is a str of 1 to this many bytes in UTF-8 (a CONNECT naming anything
#: else is taken as naming none).
MAX_TENANT_BYTES = 128
#: The key of a coordkit engine's ENGINE_HELLO map: the requests it runs at once (an
#: int in 1..MAX_CAPACITY); past them, requests wait at the coordinator.
CAPACITY_KEY = "capacity"
MAX_CAPACITY = (1 << 31) - 1
#: A request's priority: an int in [PRIORITY_MIN, PRIORITY_MAX], lower served first
#: (vLLM's convention), 0 by default.
PRIORITY_MIN, PRIORITY_MAX = -128, 127
#: The keys of a coordkit engine's ENGINE_HELLO map by which it takes part in
#: disaggregated prefill/decode (docs/pd.md): its role (a name of ROLE_NAMES; absent:
#: an aggregated engine, whole requests only), the requests it holds at most (a
#: prefill's pinned ones counted: required with a role), the transfer domain it moves
#: KV within (a str; absent: the one domain of every engine that says none), and what
#: a prefill is sent of it in SEND_KV when it pushes (any msgpack; absent: nil). The
#: coordinator grants the role by naming it under ROLE_KEY in its ENGINE_ACK.
ROLE_KEY = "role"
DOMAIN_KEY = "domain"
TRANSFER_KEY = "transfer"
#: The keys of a coordkit engine's ENGINE_HELLO map that announce its KV-cache events'
#: publisher (vLLM's wire format: a PUB endpoint, and optionally its replay ROUTER's),
#: which a coordinator reading events subscribes to (docs/routing.md).
KV_EVENTS_KEY = "kv_events"
KV_EVENTS_REPLAY_KEY = "kv_events_replay"
ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")

#: The sampling-params key that makes a SUBMIT the prefill hop of a P/D request: the
#: engine computes the prompt's KV, pins it and hands it off instead of generating
#: (PR #6675's name; the coordinator appends it to the params the client sent).
HANDOFF_KEY = "do_kv_handoff"

#: Bytes per entry of the optional block-hash frame (little-endian u64).
BLOCK_HASH_SIZE = 8

#: Frames in one message beyond which it is malformed (a batch of that many
#: replies is far beyond any engine step).
MAX_PARTS = 1 << 16

#: Every int on the wire (request ids, epochs, counts) is an int64.
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1

#: The sampling-params key that asks an engine for partial replies
#: (:class:`~coordkit.tools.fake_engine.FakeEngine` honours it); ``Client.stream`` sets it.
STREAM_KEY = "stream"

#: The sampling-params key by which a request says it cannot go on at another engine
#: from the tokens it streamed, when its own engine dies (its generation must replay
#: exactly: seeded sampling, guided decoding): ``{"resumable": False}``; it then ends
#: with ERROR(ENGINE_FAILED), as any started request did before.
RESUMABLE_KEY = "resumable"
#: The sampling-params keys of a request's budget of tokens, reduced by the tokens it
#: streamed when it goes on at another engine: Megatron's, and coordkit FakeEngine's.
BUDGET_KEYS = ("num_tokens_to_generate", "output_tokens")


class Header(IntEnum):
    CONNECT = 0
    CONNECT_ACK = 1
    REGISTER_ROLE_ACK = 2  # Megatron-LM PR #6675's disaggregated prefill/decode (P/D)
    SUBMIT_REQUEST = 20
    ENGINE_REPLY = 21
    ENGINE_REPLY_PARTIAL = 22
    ABORT_REQUEST = 23
    SUBMIT_REQUEST_WITH_KV = 24
    RELEASE_KV = 25
    SEND_KV = 26
    # PR #6675's P/D: a role at registration, and the two hops' handshakes
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
    # coordkit's own extensions
    ERROR = 90
    HEARTBEAT = 91
    STATS = 92
    STATS_REPLY = 93
    ENGINE_HELLO = 94
    SUBMIT_BATCH = 95
    REPLY_BATCH = 96
    ENGINE_ACK = 97
    # the rebuild after a coordinator's loss (docs/design.md, "Failover")
    REJOIN = 98
    RESEND = 99
    HELD = 100
    HANDLED = 101
    REPLAY = 102
    REPLAYED = 103
    # a coordkit prefill engine's handoffs (docs/pd.md)
    HANDOFF = 104


#: Control signals a client sends and the coordinator broadcasts to engines.
CONTROL_HEADERS = frozenset(range(Header.PAUSE, Header.STOP_CUDA_PROFILER + 1))


class ControlState(IntEnum):
    """Where the coordinator's control state machine stands."""

    RUNNING = 0
    PAUSED = 1
    SUSPENDED = 2


#: (state, signal) -> state after it; a signal absent for a state is refused.
#: SET_GENERATION_EPOCH and the profiler signals are allowed in every state.
CONTROL_TRANSITIONS: dict[tuple[int, int], int] = {
    (ControlState.RUNNING, Header.PAUSE): ControlState.PAUSED,
    (ControlState.PAUSED, Header.UNPAUSE): ControlState.RUNNING,
    (ControlState.PAUSED, Header.SUSPEND): ControlState.SUSPENDED,
    (ControlState.SUSPENDED, Header.RESUME): ControlState.PAUSED,
    (ControlState.PAUSED, Header.STOP): ControlState.RUNNING,
    (ControlState.SUSPENDED, Header.STOP): ControlState.RUNNING,
    **{
        (state, signal): state
        for state in ControlState
        for signal in (
            Header.SET_GENERATION_EPOCH,
            Header.START_CUDA_PROFILER,
            Header.STOP_CUDA_PROFILER,
        )
    },
}


class EngineRole(IntEnum):
    """What an engine takes in disaggregated prefill/decode, as bits: PREFILL takes
    prefill hops, DECODE decode hops (and whole requests: a short prompt prefilled
    where it decodes), BOTH either; AGGREGATED (no role said) whole requests only."""

    AGGREGATED = 0
    PREFILL = 1
    DECODE = 2
    BOTH = 3


#: A role's name on the wire (ENGINE_HELLO's ROLE_KEY; REGISTER_ROLE's first field).
ROLE_NAMES = {"prefill": EngineRole.PREFILL, "decode": EngineRole.DECODE, "both": EngineRole.BOTH}


class ErrorCode(IntEnum):
    """The ``code`` of an ERROR message."""

    MALFORMED = 1  # the message does not parse
    UNKNOWN_HEADER = 2  # a header this peer may not send
    NOT_CONNECTED = 3  # the sender never sent CONNECT
    BUSY = 4  # max_inflight (or the per-engine cap) reached
    ENGINE_FAILED = 5  # the owning engine died after the request produced output
    NO_ENGINES = 6  # no engine is registered and accepting work
    UNKNOWN_REQUEST = 7  # abort of a request id that is not in flight
    DUPLICATE_REQUEST = 8  # a request id already in flight for this client
    INVALID_STATE = 9  # a control signal the state machine does not allow now
    SHUTTING_DOWN = 10  # the coordinator stopped with the request in flight
    TIMED_OUT = 11  # in flight longer than the coordinator's request_timeout
    ABORTED = 12  # aborted by its client before an engine answered it (a P/D hop's end)


class ProtocolError(ValueError):
    """A message that does not match its declaration.

    ``rid`` is the request id when it could be read before the fault, so the
    coordinator can fail that one request rather than drop the message;
    ``rids``, of a batch, the ids of every entry whose id could be read.
    """

    def __init__(self, message: str, rid: int | None = None, rids: tuple[int, ...] = ()):
        super().__init__(message)
        self.rid = rid
        self.rids = rids


_ERROR_TEXTS = {
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
    ErrorCode.TIMED_OUT: "request timed out",
    ErrorCode.ABORTED: "request aborted",
}


def header_name(header: int) -> str:
    """``header``'s name, for texts and logs; a negative header is one that did not parse."""
    if header < 0:
        return "message"
    try:
        return Header(header).name
    except ValueError:
        return f"header {header}"


def error_text(code: int, header: int) -> str:
    """An ERROR's message: ``"<HEADER>: <reason>"``, a fixed table, so every
    implementation puts the same bytes on the wire."""
    return f"{header_name(header)}: {_ERROR_TEXTS[ErrorCode(code)]}"


_packers = threading.local()


def packb(obj: Any) -> bytes:
    """``msgpack.packb(obj, use_bin_type=True)``, on a Packer kept per thread:
    making one costs as much as packing a small map."""
    try:
        pack = _packers.pack
    except AttributeError:
        pack = _packers.pack = msgpack.Packer(use_bin_type=True).pack
    return cast(bytes, pack(obj))


def unpackb(data: Frame) -> Any:
    """One msgpack object; ProtocolError when ``data`` is not one (msgpack raises
    several unrelated types: ValueError's, and TypeError for an unhashable map key)."""
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ProtocolError(f"not msgpack ({exc})") from None


_SUBMITS_ONE = (Header.SUBMIT_REQUEST, Header.SUBMIT_REQUEST_WITH_KV)


def rejoin_covers(messages: Iterable[Sequence[Frame]]) -> tuple[list[Any], list[int]]:
    """What the next REJOIN makes of a coordkit client's messages left unsent at a
    coordinator's loss: those it does not cover (kept, and sent after it), and the ids
    of the requests the submissions name (sent again, under their ids, after it); an
    older REJOIN is superseded."""
    kept: list[Any] = []
    rids: list[int] = []
    for frames in messages:
        message = unpackb(frames[0])
        if message[0] in _SUBMITS_ONE:
            rids.append(message[1])
        elif message[0] == Header.SUBMIT_BATCH:
            rids.extend(entry[0] for entry in message[1])
        elif message[0] != Header.REJOIN:
            kept.append(frames)
    return kept, rids


def block_hashes(tokens: Sequence[int], block_size: int) -> bytes:
    """The chained hashes of the full blocks of ``tokens``, as one LE u64 frame.

    A request's prefix is described by one u64 per *full* block of
    ``block_size`` tokens, chained so that hash ``i`` covers blocks ``0 .. i``:
    ``h[-1] = 0`` and ``h[i]`` is the little-endian value of
    ``blake2b(h[i-1] as 8 bytes LE + block i's tokens as u32 LE, digest_size=8)``.
    A trailing partial block has no hash. On the wire the hashes are one frame
    of little-endian u64s (:data:`BLOCK_HASH_SIZE` bytes each), sent after a
    SUBMIT's payload frames, that the coordinator reads in place and consumes.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be positive, not {block_size}")
    block = struct.Struct(f"<{block_size}I")
    out = bytearray()
    prev = bytes(8)  # h[-1] = 0
    for start in range(0, len(tokens) - block_size + 1, block_size):
        data = prev + block.pack(*tokens[start : start + block_size])
        prev = hashlib.blake2b(data, digest_size=8).digest()
        out += prev
    return bytes(out)


class Field:
    """One metadata field: a name and the Python types it may decode to.

    An int field takes int64 values only (every int on the wire is one).
    """

    __slots__ = ("name", "types", "nullable")

    def __init__(self, name: str, types: type | tuple[type, ...] = object, nullable: bool = False):
        self.name = name
        self.types = types if isinstance(types, tuple) else (types,)
        self.nullable = nullable

    def check(self, message: str, value: Any) -> None:
        if value is None and self.nullable:
            return
        # bool is an int in Python, never on the wire: keep them apart.
        if isinstance(value, bool) and bool not in self.types:
            ok = False
        else:
            ok = object in self.types or isinstance(value, self.types)
        if ok and type(value) is int and not INT64_MIN <= value <= INT64_MAX:
            raise ProtocolError(f"{message}: field {self.name!r} does not fit int64")
        if not ok:
            expected = " or ".join(t.__name__ for t in self.types)
            raise ProtocolError(
                f"{message}: field {self.name!r} must be {expected}, got {type(value).__name__}"
            )

    def __repr__(self) -> str:
        return f"Field({self.name!r})"


def _decode_metadata(message: str, header: Header, frame: Frame) -> list[Any]:
    try:
        metadata = unpackb(frame)
    except ProtocolError as exc:
        raise ProtocolError(f"{message}: metadata frame is {exc}") from None
    if not isinstance(metadata, list) or not metadata:
        raise ProtocolError(f"{message}: metadata frame must be a non-empty array")
    if metadata[0] != header or isinstance(metadata[0], bool):
        raise ProtocolError(f"{message}: header must be {int(header)}, got {metadata[0]!r}")
    return metadata


class MessageSpec:
    """A message: its header, metadata fields and payload frames, in wire order.

    ``optional_frames`` may follow ``payload_frames`` (the block-hash frame of a
    SUBMIT); ``parse`` gives ``None`` for an optional frame that is absent.
    ``optional_fields`` may end the metadata of a message without payload frames
    (SEND_KV's ``cached_prefix_blocks``, which main's layout has not); ``parse``
    gives ``None`` for each one absent, and ``pack`` leaves out trailing ``None`` values.
    """

    def __init__(
        self,
        name: str,
        header: Header,
        metadata_fields: Sequence[Field] = (),
        payload_frames: Sequence[str] = (),
        optional_frames: Sequence[str] = (),
        optional_fields: Sequence[Field] = (),
    ):
        if optional_fields and (payload_frames or optional_frames):
            raise ValueError(f"{name}: optional fields end a message without payload frames")
        self.name = name
        self.header = header
        self.metadata_fields = tuple(metadata_fields)
        self.optional_fields = tuple(optional_fields)
        self.payload_frames = tuple(payload_frames)
        self.optional_frames = tuple(optional_frames)
        #: Every metadata field, the optional ones last.
        self.fields = self.metadata_fields + self.optional_fields
        names = [f.name for f in self.fields] + [*self.payload_frames, *self.optional_frames]
        self.message_type = namedtuple(  # type: ignore[misc]
            name, names, defaults=[None] * (len(self.optional_fields) + len(self.optional_frames))
        )

    @property
    def min_frames(self) -> int:
        return 1 + len(self.payload_frames)

    @property
    def max_frames(self) -> int:
        return self.min_frames + len(self.optional_frames)

    def pack(self, *args: Any, **kwargs: Any) -> list[bytes | Any]:
        """Frames for one message; payload frames are passed through as given."""
        values = list(self.message_type(*args, **kwargs))
        n_fields = len(self.fields)
        fields = values[:n_fields]
        while len(fields) > len(self.metadata_fields) and fields[-1] is None:
            fields.pop()
        for spec, value in zip(self.fields, fields, strict=False):
            spec.check(self.name, value)
        frames: list[Any] = [packb([int(self.header), *fields])]
        frames += values[n_fields : n_fields + len(self.payload_frames)]
        frames += [f for f in values[n_fields + len(self.payload_frames) :] if f is not None]
        return frames

    def parse(self, frames: Sequence[Frame]) -> Any:
        """Decode and validate one message (without the ROUTER identity frame).

        A fault found after a valid leading ``rid`` field raises
        :class:`ProtocolError` with that ``rid``, so the request can be named.
        """
        if not frames:
            raise ProtocolError(f"{self.name}: empty message")
        metadata = _decode_metadata(self.name, self.header, frames[0])
        fields = metadata[1:]
        try:
            self._check(frames, fields)
        except ProtocolError as exc:
            exc.rid = self._leading_rid(fields)
            raise
        fields += [None] * (len(self.fields) - len(fields))
        optional: list[Frame | None] = list(frames[self.min_frames :])
        optional += [None] * (len(self.optional_frames) - len(optional))
        return self.message_type(*fields, *frames[1 : self.min_frames], *optional)

    def _check(self, frames: Sequence[Frame], fields: list[Any]) -> None:
        if not self.min_frames <= len(frames) <= self.max_frames:
            expected = (
                str(self.min_frames)
                if self.min_frames == self.max_frames
                else f"{self.min_frames}-{self.max_frames}"
            )
            raise ProtocolError(f"{self.name}: expected {expected} frames, got {len(frames)}")
        least, most = len(self.metadata_fields), len(self.fields)
        if not least <= len(fields) <= most:
            expected = str(least) if least == most else f"{least}-{most}"
            raise ProtocolError(
                f"{self.name}: expected {expected} metadata fields, got {len(fields)}"
            )
        for spec, value in zip(self.fields, fields, strict=False):
            spec.check(self.name, value)

    def _leading_rid(self, fields: list[Any]) -> int | None:
        if not self.metadata_fields or self.metadata_fields[0].name != "rid" or not fields:
            return None
        rid = fields[0]
        return rid if type(rid) is int and INT64_MIN <= rid <= INT64_MAX else None


class BatchedMessageSpec:
    """An engine's batch: ``[header, [entry, ...]]`` and one payload frame per entry
    (none with ``bodies=False``).

    ``entry_fields`` with one field gives bare values (``[rid, ...]``), with
    several an array per entry (``[[rid, flag], ...]``).
    """

    def __init__(
        self, name: str, header: Header, entry_fields: Sequence[Field], bodies: bool = True
    ):
        self.name = name
        self.header = header
        self.entry_fields = tuple(entry_fields)
        self.bodies = bodies

    def _check_entry(self, entry: Any) -> None:
        if len(self.entry_fields) == 1:
            self.entry_fields[0].check(self.name, entry)
            return
        if not isinstance(entry, (list, tuple)) or len(entry) != len(self.entry_fields):
            raise ProtocolError(
                f"{self.name}: each entry must be an array of {len(self.entry_fields)}"
            )
        for spec, value in zip(self.entry_fields, entry, strict=True):
            spec.check(self.name, value)

    def pack(self, entries: Sequence[Any], bodies: Sequence[Any] = ()) -> list[bytes | Any]:
        if len(bodies) != (len(entries) if self.bodies else 0):
            raise ProtocolError(
                f"{self.name}: {len(entries)} entries but {len(bodies)} payload frames"
            )
        entries = [list(e) if isinstance(e, tuple) else e for e in entries]
        for entry in entries:
            self._check_entry(entry)
        return [packb([int(self.header), entries]), *bodies]

    def parse(self, frames: Sequence[Frame]) -> tuple[list[Any], list[Frame]]:
        if not frames:
            raise ProtocolError(f"{self.name}: empty message")
        metadata = _decode_metadata(self.name, self.header, frames[0])
        if len(metadata) != 2 or not isinstance(metadata[1], list):
            raise ProtocolError(f"{self.name}: metadata must be [header, [entries]]")
        entries = metadata[1]
        for entry in entries:
            self._check_entry(entry)
        bodies = list(frames[1:])
        if len(bodies) != (len(entries) if self.bodies else 0):
            raise ProtocolError(
                f"{self.name}: {len(entries)} entries but {len(bodies)} payload frames"
            )
        return entries, bodies


class SubmitBatchSpec:
    """A client's SUBMIT_BATCH: ``[95, [[rid, sampling_params, hashed], ...]]``,
    then for each entry its prompt frame, and its block-hash frame when ``hashed``.
    An entry of a client granted QoS may carry them after its rid: ``[rid, priority,
    deadline_ms, sampling_params, hashed]`` (as SUBMIT_REQUEST_QOS)."""

    name = "SUBMIT_BATCH"
    header = Header.SUBMIT_BATCH
    entry_fields = (Field("rid", int), Field("sampling_params"), Field("hashed", bool))
    qos_fields = (Field("priority", int), Field("deadline_ms", int))

    def pack(self, requests: Sequence[Sequence[Any]]) -> list[bytes | Any]:
        """Frames for ``(rid, sampling_params, prompt, block_hashes or None)`` requests,
        or ``(..., priority, deadline_ms)`` for an entry with its QoS fields."""
        entries, frames = [], []
        for rid, params, prompt, hashes, *qos in requests:
            entry = [rid, params, hashes is not None]
            for spec, value in zip(self.entry_fields, entry, strict=True):
                spec.check(self.name, value)
            self._check_qos(qos)
            entries.append([rid, *qos, params, hashes is not None])
            frames.append(prompt)
            if hashes is not None:
                frames.append(hashes)
        return [packb([int(self.header), entries]), *frames]

    def parse(self, frames: Sequence[Frame]) -> list[SubmitEntry]:
        if not frames:
            raise ProtocolError(f"{self.name}: empty message")
        metadata = _decode_metadata(self.name, self.header, frames[0])
        if len(metadata) != 2 or not isinstance(metadata[1], list):
            raise ProtocolError(f"{self.name}: metadata must be [header, [entries]]")
        requests, next_frame = [], 1
        for entry in metadata[1]:
            if not isinstance(entry, list) or len(entry) not in (3, 5):
                raise ProtocolError(f"{self.name}: each entry must be an array of 3 or 5")
            rid, *qos, params, hashed = entry
            for spec, value in zip(self.entry_fields, (rid, params, hashed), strict=True):
                spec.check(self.name, value)
            self._check_qos(qos)
            if next_frame + hashed >= len(frames):
                raise ProtocolError(f"{self.name}: fewer payload frames than the entries need")
            hashes = frames[next_frame + 1] if hashed else None
            requests.append(SubmitEntry(rid, params, frames[next_frame], hashes, *qos))
            next_frame += 1 + hashed
        if next_frame != len(frames):
            raise ProtocolError(f"{self.name}: more payload frames than the entries need")
        return requests

    def _check_qos(self, qos: Sequence[Any]) -> None:
        """An entry's QoS fields: none, or a priority and a deadline_ms."""
        if qos and len(qos) != len(self.qos_fields):
            raise ProtocolError(f"{self.name}: QoS fields are a priority and a deadline_ms")
        for spec, value in zip(self.qos_fields, qos, strict=False):
            spec.check(self.name, value)


#: One request of a client's SUBMIT_BATCH (priority 0 and deadline_ms 0, none, when its
#: entry carries no QoS fields).
SubmitEntry = namedtuple(
    "SubmitEntry", "rid sampling_params prompt block_hashes priority deadline_ms", defaults=(0, 0)
)


class HeldSpec:
    """HELD, a rebuild engine's report after each registration: ``[100, [[server_rid,
    client_rid, client_id, partials, final], ...]]`` -- the requests it holds that a
    rebuild client sent (and, when its ENGINE_ACK said HELD_ALL_KEY, every other one
    it holds, client_id nil), how many partials it sent for each, whether it sent the
    final -- then one frame: the block hashes of the requests routed to it lately
    (little-endian u64s, each once, oldest first by its latest request; empty when
    none), so that the prefix policy's table outlives the coordinator."""

    name = "HELD"
    header = Header.HELD
    entry_fields = (
        Field("server_rid", int),
        Field("client_rid", int),
        Field("client_id", bytes, nullable=True),
        Field("partials", int),
        Field("final", bool),
    )

    def pack(self, entries: Sequence[Sequence[Any]], hashes: Buffer = b"") -> list[Any]:
        entries = [list(entry) for entry in entries]
        for entry in entries:
            _check_entry(self.name, self.entry_fields, entry)
        return [packb([int(self.header), entries]), hashes]

    def parse(self, frames: Sequence[Frame]) -> tuple[list[list[Any]], Frame]:
        if len(frames) != 2:
            raise ProtocolError(f"{self.name}: expected 2 frames, got {len(frames)}")
        metadata = _decode_metadata(self.name, self.header, frames[0])
        if len(metadata) != 2 or not isinstance(metadata[1], list):
            raise ProtocolError(f"{self.name}: metadata must be [header, [entries]]")
        for entry in metadata[1]:
            _check_entry(self.name, self.entry_fields, entry)
        hashes = frames[1]
        size = len(hashes.buffer if isinstance(hashes, zmq.Frame) else memoryview(hashes))
        if size % BLOCK_HASH_SIZE:
            raise ProtocolError(f"{self.name}: the block-hash frame is not whole hashes")
        return metadata[1], frames[1]


class ReplayedSpec:
    """REPLAYED from a rebuild engine, its answer to a REPLAY: ``[103, [[server_rid,
    first, count, final], ...]]`` and, entry after entry, ``count`` bodies each: the
    partials it sent from partial ``first`` on, then the final when ``final``.
    ``first`` is -1 for a request it does not hold."""

    name = "REPLAYED"
    header = Header.REPLAYED
    entry_fields = (
        Field("server_rid", int),
        Field("first", int),
        Field("count", int),
        Field("final", bool),
    )

    def pack(self, entries: Sequence[Sequence[Any]], bodies: Sequence[Any]) -> list[Any]:
        entries = [list(entry) for entry in entries]
        for entry in entries:
            _check_entry(self.name, self.entry_fields, entry)
        if sum(entry[2] for entry in entries) != len(bodies):
            raise ProtocolError(f"{self.name}: the counts do not add up to the bodies")
        return [packb([int(self.header), entries]), *bodies]

    def parse(self, frames: Sequence[Frame]) -> tuple[list[list[Any]], list[Frame]]:
        if not frames:
            raise ProtocolError(f"{self.name}: empty message")
        metadata = _decode_metadata(self.name, self.header, frames[0])
        if len(metadata) != 2 or not isinstance(metadata[1], list):
            raise ProtocolError(f"{self.name}: metadata must be [header, [entries]]")
        for entry in metadata[1]:
            _check_entry(self.name, self.entry_fields, entry)
            if entry[2] < 0 or entry[1] < -1:
                raise ProtocolError(f"{self.name}: a negative count or first")
        if sum(entry[2] for entry in metadata[1]) != len(frames) - 1:
            raise ProtocolError(f"{self.name}: the counts do not add up to the bodies")
        return metadata[1], list(frames[1:])


def _check_entry(name: str, fields: Sequence[Field], entry: Any) -> None:
    if not isinstance(entry, list) or len(entry) != len(fields):
        raise ProtocolError(f"{name}: each entry must be an array of {len(fields)}")
    for spec, value in zip(fields, entry, strict=True):
        spec.check(name, value)


class Trailer(NamedTuple):
    """What a rebuild engine is told of each request, in the frame after its payload
    (the *trailer*): ``[client_rid, client_id, hashed]``. ``client_id`` is the routing
    id of a rebuild client (None for any other: its request cannot outlive the
    coordinator); ``hashed`` says that the request's block-hash frame follows."""

    client_rid: int
    client_id: bytes | None
    hashed: bool


_TRAILER_FIELDS = (
    Field("client_rid", int),
    Field("client_id", bytes, nullable=True),
    Field("hashed", bool),
)


def pack_trailer(client_rid: int, client_id: bytes | None, hashed: bool) -> bytes:
    entry = [client_rid, client_id, hashed]
    _check_entry("trailer", _TRAILER_FIELDS, entry)
    return packb(entry)


def parse_trailer(frame: Frame) -> Trailer:
    try:
        entry = unpackb(frame)
    except ProtocolError as exc:
        raise ProtocolError(f"trailer: {exc}") from None
    _check_entry("trailer", _TRAILER_FIELDS, entry)
    return Trailer(*entry)


class Hello(NamedTuple):
    """What a peer said of itself in CONNECT or ENGINE_HELLO."""

    coordkit: bool  # a coordkit peer: may be sent ERROR and STATS_REPLY
    batch: bool  # asks for SUBMIT_BATCH / REPLY_BATCH
    ack: bool = False  # an engine that reads ENGINE_ACK
    rebuild: bool = False  # takes part in the rebuild after a coordinator's loss
    base: int = 0  # a rebuild engine: the number of its next reply message (HANDLED)
    hold: float = 0.0  # a rebuild client: seconds its requests are kept once it is gone
    session: int = 0  # a coordkit engine: its process's token (0: none said)
    qos: bool = False  # a coordkit client that may send priorities and deadlines
    tenant: str | None = None  # a coordkit client: the tenant it names (None: its own)
    capacity: int = 0  # a coordkit engine: the requests it runs at once (0: none said)
    role: EngineRole = EngineRole.AGGREGATED  # a coordkit engine's P/D role
    domain: str = ""  # with a role: the transfer domain it moves KV within
    transfer: Any = None  # with a role: what a pushing prefill is sent of it (SEND_KV)
    kv_events: str | None = None  # a coordkit engine: its KV events' publisher (PUB)
    kv_events_replay: str | None = None  # and that publisher's replay ROUTER


_rid = Field("rid", int)
_sampling = Field("sampling_params")

CONNECT = MessageSpec("CONNECT", Header.CONNECT)
#: CONNECT from a coordkit client: ``[0, {"coordkit": 1, ...}]``.
CONNECT_COORDKIT = MessageSpec("CONNECT_COORDKIT", Header.CONNECT, [Field("hello", dict)])
CONNECT_ACK = MessageSpec("CONNECT_ACK", Header.CONNECT_ACK)
#: CONNECT_ACK to a coordkit client that asked for batches: ``[1, {"batch": 1}]``.
CONNECT_ACK_BATCH = MessageSpec("CONNECT_ACK_BATCH", Header.CONNECT_ACK, [Field("features", dict)])
SUBMIT_REQUEST = MessageSpec(
    "SUBMIT_REQUEST",
    Header.SUBMIT_REQUEST,
    [_rid, _sampling],
    ["prompt"],
    ["block_hashes"],
)
SUBMIT_REQUEST_WITH_KV = MessageSpec(
    "SUBMIT_REQUEST_WITH_KV",
    Header.SUBMIT_REQUEST_WITH_KV,
    [_rid, _sampling, Field("kv_meta")],
    ["prompt", "src_block_ids"],
    ["block_hashes"],
)
_qos = [Field("priority", int), Field("deadline_ms", int)]
#: SUBMIT_REQUEST with its QoS fields right after the rid, from a client granted them:
#: ``[20, rid, priority, deadline_ms, sampling_params]`` (a priority in
#: [PRIORITY_MIN, PRIORITY_MAX]; deadline_ms > 0: how long it may wait at the
#: coordinator, 0: as long as it takes). Sent only when either is not its default. The
#: coordinator reads them and sends on ``[20, server_rid, sampling_params]``: its
#: params span starts after them, so engines never see them.
SUBMIT_REQUEST_QOS = MessageSpec(
    "SUBMIT_REQUEST_QOS",
    Header.SUBMIT_REQUEST,
    [_rid, *_qos, _sampling],
    ["prompt"],
    ["block_hashes"],
)
SUBMIT_REQUEST_WITH_KV_QOS = MessageSpec(
    "SUBMIT_REQUEST_WITH_KV_QOS",
    Header.SUBMIT_REQUEST_WITH_KV,
    [_rid, *_qos, _sampling, Field("kv_meta")],
    ["prompt", "src_block_ids"],
    ["block_hashes"],
)
ENGINE_REPLY = BatchedMessageSpec(
    "ENGINE_REPLY", Header.ENGINE_REPLY, [Field("rid", int), Field("needs_detokenize", bool)]
)
ENGINE_REPLY_PARTIAL = BatchedMessageSpec(
    "ENGINE_REPLY_PARTIAL", Header.ENGINE_REPLY_PARTIAL, [Field("rid", int)]
)
#: What a client receives for one entry of an engine's batch.
CLIENT_REPLY = MessageSpec("CLIENT_REPLY", Header.ENGINE_REPLY, [_rid], ["body"])
CLIENT_REPLY_PARTIAL = MessageSpec(
    "CLIENT_REPLY_PARTIAL", Header.ENGINE_REPLY_PARTIAL, [_rid], ["body"]
)
ABORT_REQUEST = MessageSpec("ABORT_REQUEST", Header.ABORT_REQUEST, [_rid])
#: A client's RELEASE_KV (Megatron main's); to a coordkit prefill the coordinator may
#: name several requests in one: rids_message.
RELEASE_KV = MessageSpec("RELEASE_KV", Header.RELEASE_KV, [_rid])
SET_GENERATION_EPOCH = MessageSpec(
    "SET_GENERATION_EPOCH", Header.SET_GENERATION_EPOCH, [Field("epoch", int)]
)
DISCONNECT = MessageSpec("DISCONNECT", Header.DISCONNECT)
SHUTDOWN = MessageSpec("SHUTDOWN", Header.SHUTDOWN)
ERROR = MessageSpec(
    "ERROR",
    Header.ERROR,
    [Field("rid", int, nullable=True), Field("code", int), Field("message", str)],
)
HEARTBEAT = MessageSpec(
    "HEARTBEAT", Header.HEARTBEAT, [Field("pending", int), Field("capacity", int)]
)
STATS = MessageSpec("STATS", Header.STATS, optional_fields=[Field("asked", dict)])
STATS_REPLY = MessageSpec("STATS_REPLY", Header.STATS_REPLY, [], ["stats"])
#: A coordkit engine's registration: ``[94, {"coordkit": 1, "ack": 1, "batch": 1}]``.
ENGINE_HELLO = MessageSpec("ENGINE_HELLO", Header.ENGINE_HELLO, [Field("hello", dict)])
#: coordkit's coordinator's answer to each ENGINE_HELLO it took: the engine is in the
#: pool, and ``granted`` says what it was granted (``{"batch": 1}``, or ``{}``).
ENGINE_ACK = MessageSpec("ENGINE_ACK", Header.ENGINE_ACK, [Field("granted", dict)])
SUBMIT_BATCH = SubmitBatchSpec()
#: SUBMIT_BATCH as the coordinator sends it to an engine that asked for batches.
ENGINE_SUBMIT_BATCH = BatchedMessageSpec(
    "ENGINE_SUBMIT_BATCH", Header.SUBMIT_BATCH, [_rid, _sampling]
)
#: Replies for one client, from one engine batch, to a client that asked for batches.
REPLY_BATCH = BatchedMessageSpec("REPLY_BATCH", Header.REPLY_BATCH, [_rid, Field("final", bool)])
#: The answer to an ENGINE_HELLO that asked for the rebuild: ``[97, {"rebuild": 1,
#: A rebuild client, once acknowledged again: the requests it still waits for, and
#: how many partials each one got.
REJOIN = BatchedMessageSpec("REJOIN", Header.REJOIN, [_rid, Field("partials", int)], bodies=False)
#: To a rebuild client: send these requests again (no engine holds them).
RESEND = BatchedMessageSpec("RESEND", Header.RESEND, [_rid], bodies=False)
HELD = HeldSpec()
#: To a rebuild engine, on the coordinator's timer: it handled the engine's reply
#: messages up to number ``count`` (counted from the ``base`` of its ENGINE_HELLO).
HANDLED = MessageSpec("HANDLED", Header.HANDLED, [Field("count", int)])
#: To a rebuild engine: send again what you sent for these requests, from partial
#: ``start`` on (-1: all you keep).
REPLAY = BatchedMessageSpec(
    "REPLAY", Header.REPLAY, [Field("server_rid", int), Field("start", int)], bodies=False
)
REPLAYED = ReplayedSpec()
#: REPLAYED to a rebuild client: each reply sent again with its place, ``index``
#: (the partials before it), so that the client drops what it has.
CLIENT_REPLAYED = BatchedMessageSpec(
    "CLIENT_REPLAYED",
    Header.REPLAYED,
    [_rid, Field("index", int), Field("final", bool)],
)

# Megatron-Core's single-frame dialect (up to release 0.19): each message is one
# frame, the prompt and the replies inside it.
SINGLE_SUBMIT_REQUEST = MessageSpec(
    "SINGLE_SUBMIT_REQUEST",
    Header.SUBMIT_REQUEST,
    [_rid, Field("prompt", (str, list)), _sampling],
)
#: An engine's finished requests: maps whose "request_id" is the server id.
SINGLE_ENGINE_REPLY = MessageSpec(
    "SINGLE_ENGINE_REPLY", Header.ENGINE_REPLY, [Field("finished_requests", list)]
)
#: One finished request to its client.
SINGLE_CLIENT_REPLY = MessageSpec(
    "SINGLE_CLIENT_REPLY", Header.ENGINE_REPLY, [_rid, Field("reply", dict)]
)


# Disaggregated prefill/decode (P/D, docs/pd.md): the messages of both hops. Those of
# PR #6675 (Megatron-LM, "Disaggregated Inference: End2End") are one frame each, as
# main's; a coordkit engine sends and takes the same metadata frames, and HANDOFF.

#: A coordkit prefill engine's handoffs, the prefill hops it ended: ``[104, [[rid,
#: kv_meta], ...]]`` and one ``src_block_ids`` frame per entry (a msgpack array of the
#: pinned blocks' ids). The coordinator puts ``kv_meta`` and the frame, as they came,
#: into the request's SUBMIT_REQUEST_WITH_KV to a decode engine.
HANDOFF = BatchedMessageSpec("HANDOFF", Header.HANDOFF, [_rid, Field("kv_meta")])
#: To a prefill engine whose decode pushes (NCCL): push request ``rid``'s pinned
#: blocks from ``cached_prefix_blocks`` on to the decode ``decode_meta`` describes
#: (a #6675 decode's REGISTER_ROLE metadata, a coordkit decode's TRANSFER_KEY).
#: Main's layout has no ``cached_prefix_blocks`` (a prefill then takes 0).
SEND_KV = MessageSpec(
    "SEND_KV",
    Header.SEND_KV,
    [_rid, Field("decode_meta")],
    optional_fields=[Field("cached_prefix_blocks", int)],
)
#: From a decode engine: it imported request ``rid``'s KV; the prefill's blocks may
#: be released. A coordkit decode may name several requests in one: rids_message.
KV_READ_DONE = MessageSpec("KV_READ_DONE", Header.KV_READ_DONE, [_rid])


def rids_message(header: int, *rids: int) -> bytes:
    """``[header, rid, ...]``: ABORT_REQUEST and RELEASE_KV to an engine, KV_READ_DONE
    from one. One rid is #6675's and main's layout; a coordkit prefill takes several in
    a RELEASE_KV and a coordkit decode sends several in a KV_READ_DONE, which the
    codec's read_rids reads."""
    return packb([header, *rids])


#: From a decode engine whose prefill pushes: its receives for ``rid`` are posted; its
#: leading ``cached_prefix_blocks`` need not be sent (the coordinator sends SEND_KV).
KV_TRANSFER_READY = MessageSpec(
    "KV_TRANSFER_READY", Header.KV_TRANSFER_READY, [_rid, Field("cached_prefix_blocks", int)]
)
#: A request failed at an engine (engine -> coordinator), or its terminal error (P/D
#: coordinator -> #6675 client, ``rid`` the client's): ``source_safe`` says whether
#: the prefill's blocks may be reused (False: a transfer may still read them).
REQUEST_ERROR = MessageSpec(
    "REQUEST_ERROR",
    Header.REQUEST_ERROR,
    [_rid, Field("reason", str), Field("source_safe", bool)],
)
#: An abort done (engine -> coordinator -> #6675 client), ``source_safe`` as above.
REQUEST_ABORTED = MessageSpec(
    "REQUEST_ABORTED", Header.REQUEST_ABORTED, [_rid, Field("source_safe", bool)]
)
#: A #6675 engine's registration, instead of the empty frame: ``[27, role, transport,
#: instance_meta]``. Any values: each is refused by its own text
#: (coordkit._pd.check_register_role), as #6675 refuses it, never by its type here.
REGISTER_ROLE = MessageSpec(
    "REGISTER_ROLE",
    Header.REGISTER_ROLE,
    [Field("role"), Field("transport"), Field("instance_meta")],
)
REGISTER_ROLE_ACK = MessageSpec("REGISTER_ROLE_ACK", Header.REGISTER_ROLE_ACK)
#: The refusal of a REGISTER_ROLE: ``[29, reason]``, REQUEST_ERROR's header with one field.
ROLE_REFUSED = MessageSpec("ROLE_REFUSED", Header.REQUEST_ERROR, [Field("reason", str)])
#: The decode hop to a #6675 engine: ``[24, rid, prompt, sampling_params, kv_meta,
#: src_block_ids]``, the client's prompt and params, the prefill's kv_meta and blocks
#: (the hop to its prefill is SINGLE_SUBMIT_REQUEST: #6675 has no multimodal field).
SINGLE_SUBMIT_REQUEST_WITH_KV = MessageSpec(
    "SINGLE_SUBMIT_REQUEST_WITH_KV",
    Header.SUBMIT_REQUEST_WITH_KV,
    [
        _rid,
        Field("prompt", (str, list)),
        _sampling,
        Field("kv_meta", dict),
        Field("src_block_ids", list),
    ],
)


def _feature(value: Any) -> bool:
    return type(value) is int and value >= 1


def asks_metrics(asked: dict[Any, Any] | None) -> bool:
    """Whether a STATS's map (``asked``, None: a bare STATS) asks for metrics() too."""
    return asked is not None and _feature(asked.get(METRICS_FEATURE))


def valid_tenant(name: Any) -> bool:
    """Whether ``name`` may name a tenant: a str of 1 to MAX_TENANT_BYTES in UTF-8."""
    if type(name) is not str or not name:
        return False
    try:
        return len(name.encode()) <= MAX_TENANT_BYTES
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 at all
        return False


def _hello(hello: dict[Any, Any]) -> Hello:
    coordkit = _feature(hello.get("coordkit"))
    base = hello.get(BASE_KEY, 1)
    if type(base) is not int or not 0 < base <= INT64_MAX:
        base = 0  # no numbering: the engine cannot be told what was handled
    rebuild = coordkit and _feature(hello.get(REBUILD_FEATURE)) and base > 0
    hold = hello.get(HOLD_KEY, 0)
    if type(hold) is not int or hold < 0 or not rebuild:
        hold = 0
    session = hello.get(SESSION_KEY, 0)
    if type(session) is not int or not 0 < session <= INT64_MAX or not coordkit:
        session = 0
    tenant = hello.get(TENANT_KEY)
    capacity = hello.get(CAPACITY_KEY, 0)
    if type(capacity) is not int or not 0 < capacity <= MAX_CAPACITY or not coordkit:
        capacity = 0
    kv_events, kv_replay = hello.get(KV_EVENTS_KEY), hello.get(KV_EVENTS_REPLAY_KEY)
    if not coordkit or not _endpoint(kv_events):
        kv_events = kv_replay = None  # none, or one no socket could connect to
    elif not _endpoint(kv_replay):
        kv_replay = None
    return Hello(
        coordkit,
        coordkit and _feature(hello.get(BATCH_FEATURE)),
        coordkit and _feature(hello.get(ACK_FEATURE)),
        rebuild,
        base if rebuild else 0,
        min(hold, MAX_HOLD_MS) / 1000,
        session,
        coordkit and _feature(hello.get(QOS_FEATURE)),
        tenant if coordkit and valid_tenant(tenant) else None,
        capacity,
        kv_events=kv_events,
        kv_events_replay=kv_replay,
    )


def _endpoint(value: object) -> bool:
    return isinstance(value, str) and value.startswith(ENDPOINT_SCHEMES) and len(value) < 1024


def parse_connect(frames: Sequence[Frame]) -> Hello:
    """Who sent a CONNECT: a coordkit client says ``[0, {"coordkit": n}]``
    with an int ``n >= 1`` (and ``"batch": 1`` to ask for batches, ``"qos": 1`` to
    send priorities and deadlines, ``"tenant": name`` to name its tenant); any other
    map, or Megatron's ``[0]``, is not one. ProtocolError for anything else."""
    try:
        hello = CONNECT_COORDKIT.parse(frames).hello
    except ProtocolError:
        CONNECT.parse(frames)
        return Hello(False, False)
    return _hello(hello)


def parse_engine_hello(frames: Sequence[Frame]) -> Hello:
    """What an ENGINE_HELLO says; ProtocolError when it is not one, or when a coordkit
    engine's P/D role is not one (an unknown role, no capacity of at least 1 with a
    role, a domain not a str): taken as aggregated, it would be sent what it cannot do."""
    fields = ENGINE_HELLO.parse(frames).hello
    hello = _hello(fields)
    name = fields.get(ROLE_KEY)
    if not hello.coordkit or name is None:
        return hello
    role = ROLE_NAMES.get(name) if isinstance(name, str) else None
    if role is None:
        raise ProtocolError(f"ENGINE_HELLO: unknown role {name!r}")
    capacity = fields.get(CAPACITY_KEY)
    if type(capacity) is not int or not 1 <= capacity <= MAX_CAPACITY:
        raise ProtocolError(f"ENGINE_HELLO: a {name} engine's capacity must be an int >= 1")
    domain = fields.get(DOMAIN_KEY, "")
    if not isinstance(domain, str):
        raise ProtocolError("ENGINE_HELLO: the transfer domain must be a str")
    return hello._replace(
        role=role, capacity=capacity, domain=domain, transfer=fields.get(TRANSFER_KEY)
    )


def role_name(role: int) -> str:
    """A P/D role's name on the wire (``"aggregated"`` for none)."""
    return EngineRole(role).name.lower()


def engine_ack(hello: Hello, epoch: int, roles: bool = False) -> list[bytes]:
    """The ENGINE_ACK answering the hello of an engine that reads it: what it was granted
    (the rebuild with the coordinator's ``epoch``, when asked; its P/D role, named, by a
    coordinator that runs P/D: ``roles``)."""
    granted: dict[str, Any] = {BATCH_FEATURE: 1} if hello.batch else {}
    if hello.rebuild:
        granted.update({REBUILD_FEATURE: 1, EPOCH_KEY: epoch, HELD_ALL_KEY: 1})
    if roles and hello.role:
        granted[ROLE_KEY] = role_name(hello.role)
    return ENGINE_ACK.pack(granted)


#: The bare control signals (all but SET_GENERATION_EPOCH, which carries an epoch).
CONTROL = {
    h: MessageSpec(Header(h).name, Header(h))
    for h in CONTROL_HEADERS
    if h != Header.SET_GENERATION_EPOCH
}
CONTROL[Header.SET_GENERATION_EPOCH] = SET_GENERATION_EPOCH
