# cython: language_level=3, embedsignature=True
"""The engine core in Cython: the twin of :mod:`coordkit._engine_py`, over raw libzmq.

Same API, same events, same frames on the wire (the twin's docstring says
what each does). Here :meth:`EngineCore.poll` waits in ``zmq_poll`` without
the GIL, receives into ``zmq_msg_t``\\ s and reads every metadata frame with
the C codec; an ENGINE_SUBMIT_BATCH's entries are read in place, each one's
sampling params decoded from its bytes in the frame (``{}`` without a call),
and its :class:`~coordkit.engine.Request` is built without going through the
dataclass's ``__init__`` (its slots are set directly; checked at import).
:meth:`EngineCore.reply` writes the batch's metadata in C and sends each body
as it is -- copied below ``COPY_BELOW`` bytes, pinned until sent above it
(includes/pins.h).

A prompt is handed out as a ``zmq.Frame``, as pyzmq's own receive gives it:
below pyzmq's copy threshold the frame holds a copy of the bytes; above it,
the received message itself, without a copy (kept alive by the frame).
Sampling params that are a map of scalars are remembered with their bytes:
the next request with the same bytes (in a batch, most of them) gets a copy
of the map instead of a decoding.

The rare messages (SUBMIT_REQUEST_WITH_KV, SEND_KV, the control signals, an
ERROR or an ENGINE_ACK from the coordinator) are parsed with the message specs, as
the twin does.
"""

cimport cython
from cpython.buffer cimport PyBUF_READ
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.exc cimport PyErr_CheckSignals
from cpython.list cimport PyList_Append
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_Check
from cpython.memoryview cimport PyMemoryView_FromMemory
from libc.errno cimport EINTR
from libc.stdint cimport int64_t, uint8_t, uint32_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcmp, memcpy

from ._codec_c cimport (
    CK_BATCH_HEAD_MAX,
    CK_INT_MAX,
    CK_OK,
    ck_batch_entry,
    ck_read_batch_into,
    ck_read_header,
    ck_read_header_int,
    ck_read_int,
    ck_read_rids,
    ck_read_submit,
    ck_strstatus,
    ck_submit,
    ck_write_batch_head,
    ck_write_int,
)
from ._constants cimport *
from .includes.bytebuf cimport Buf, buf_reserve
from .includes.cursor cimport ck_cursor
from .includes.libzmq cimport (
    ZMQ_POLLIN,
    ZMQ_SNDMORE,
    bind_libzmq,
    recv_parts,
    reserve_msgs,
    zmq_errno,
    zmq_msg_close,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_init_size,
    zmq_msg_move,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
    zmq_poll,
    zmq_pollitem_t,
)
from .includes.pins cimport ck_msg_from_object, ck_pins_sweep
from .includes.slots cimport ck_alloc, ck_set_slot

import dataclasses
import types

import msgpack
import zmq

from . import protocol
from ._events import Abort, Control, ReleaseKV, Request, SendKV, log, refused, take_traceparent
from ._held import trailed
from ._shared import check_constants
from .protocol import Header, ProtocolError, packb
from .tracing import TRACEPARENT

bind_libzmq()
check_constants(generated_constants())

__all__ = ["EngineCore", "MAX_DRAIN"]

cdef enum:
    _MAX_DRAIN = 4096
    FIRST_PARTS = 64  # frames of a received message before the buffer grows
    FIRST_ENTRIES = 64  # entries of a batch before the buffer grows

#: Messages taken per poll, so that a flood cannot starve the step loop.
MAX_DRAIN = _MAX_DRAIN

BYTES_LIKE = (bytes, bytearray, memoryview, zmq.Frame)

cdef object _Frame = zmq.Frame
cdef object _unpackb = msgpack.unpackb
cdef str _TRACEPARENT = TRACEPARENT
cdef Py_ssize_t FRAME_COPY_BELOW = zmq.COPY_THRESHOLD


def _request_slots():
    """Request's slot descriptors in field order, when it is the frozen, slotted
    dataclass this module knows how to fill; None otherwise (then __init__ is used)."""
    names = ("server_rid", "sampling_params", "prompt", "kv_meta", "src_block_ids", "traceparent")
    if not dataclasses.is_dataclass(Request):
        return None
    if tuple(f.name for f in dataclasses.fields(Request)) != names:
        return None
    descriptors = tuple(Request.__dict__.get(name) for name in names)
    if not all(type(d) is types.MemberDescriptorType for d in descriptors):
        return None
    return descriptors


cdef tuple SLOTS = _request_slots()


cdef object new_request(object rid, object params, object prompt):
    """Request(rid, params, prompt), its slots set as its frozen __init__ would set them;
    a traceparent in the params is taken out of them into its own (take_traceparent)."""
    traceparent = None
    if type(params) is dict and _TRACEPARENT in <dict>params:  # a traced request: rarely
        traceparent = take_traceparent(params)
    if SLOTS is None:
        return Request(rid, params, prompt, traceparent=traceparent)
    request = ck_alloc(Request)
    ck_set_slot(SLOTS[0], request, rid)
    ck_set_slot(SLOTS[1], request, params)
    ck_set_slot(SLOTS[2], request, prompt)
    ck_set_slot(SLOTS[3], request, None)
    ck_set_slot(SLOTS[4], request, None)
    ck_set_slot(SLOTS[5], request, traceparent)
    return request


@cython.final
cdef class _Received:
    """A received message's bytes, kept alive for a zmq.Frame that shares them."""

    cdef zmq_msg_t msg

    def __cinit__(self):
        zmq_msg_init(&self.msg)

    def __dealloc__(self):
        zmq_msg_close(&self.msg)

    def __getbuffer__(self, Py_buffer* buffer, int flags):
        buffer.buf = zmq_msg_data(&self.msg)
        buffer.len = zmq_msg_size(&self.msg)
        buffer.obj = self
        buffer.readonly = 0  # as a zmq.Frame's: the message is nobody else's
        buffer.format = b"B"
        buffer.ndim = 1
        buffer.shape = &buffer.len
        buffer.strides = NULL
        buffer.suboffsets = NULL
        buffer.itemsize = 1
        buffer.internal = NULL


cdef object frame_of(zmq_msg_t* msg):
    """A zmq.Frame of the message: a copy when small, the message itself when large."""
    cdef char* data = <char*>zmq_msg_data(msg)
    cdef Py_ssize_t size = zmq_msg_size(msg)
    cdef _Received received
    if size < FRAME_COPY_BELOW:
        view = PyMemoryView_FromMemory(data, size, PyBUF_READ)
        try:
            return _Frame(view, False, True)  # (data, track, copy): a copy
        finally:
            view.release()
    received = _Received()
    zmq_msg_move(&received.msg, msg)
    return _Frame(received, False, False)  # the message itself


cdef object _SAMPLING = protocol.SUBMIT_REQUEST.metadata_fields[1]
cdef tuple _SCALARS = (int, float, str, bool, type(None), bytes)


cdef object decode_params(const uint8_t* data, size_t size, str name):
    """Sampling params from their msgpack bytes (``{}`` without a call), checked as
    the message spec checks them (which refuses a bool or an int beyond int64)."""
    if size == 1 and data[0] == 0x80:
        return {}
    view = PyMemoryView_FromMemory(<char*>data, size, PyBUF_READ)
    try:
        params = _unpackb(view, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"{name}: sampling params do not decode ({exc!r})") from None
    finally:
        view.release()
    if type(params) is not dict:
        _SAMPLING.check(name, params)
    return params


cdef bint flat(dict params):
    """Whether a copy of ``params`` shares nothing mutable with it."""
    for value in params.values():
        if type(value) not in _SCALARS:
            return False
    return True


cdef int64_t rid_of(str name, object rid) except? -1:
    """An entry's request id, checked as the message spec checks it."""
    cdef int overflow
    cdef long long value
    if not PyLong_Check(rid) or rid is True or rid is False:
        raise ProtocolError(f"{name}: field 'rid' must be int, got {type(rid).__name__}")
    value = PyLong_AsLongLongAndOverflow(rid, &overflow)
    if overflow:
        raise ProtocolError(f"{name}: field 'rid' does not fit int64")
    return value


@cython.final
cdef class EngineCore:
    """What arrives, as events, and the replies of a step, as one message each.

    ``socket`` is the engine's registered DEALER. ``pending`` counts the
    requests received and not yet answered with a final reply. ``on_ack``
    takes the map of each ENGINE_ACK.
    """

    cdef readonly object socket
    cdef public long long pending
    cdef public object held  # a coordkit._held.Held, or None (see the twin)
    cdef void* sock
    cdef object _on_ack

    # The last sampling params decoded, when they are a map of scalars: the
    # requests of a batch (and of a run of submissions) mostly share theirs, so
    # the same bytes again give a copy of it without decoding them again.
    cdef bytes last_params_bytes
    cdef dict last_params

    # The message being received, and a batch's entries.
    cdef zmq_msg_t* parts
    cdef Py_ssize_t n_parts, parts_capacity
    cdef ck_batch_entry* entries
    cdef uint32_t entries_capacity

    # A reply being built: its metadata, and its bodies from index 1 on.
    cdef Buf meta
    cdef zmq_msg_t* bodies
    cdef Py_ssize_t n_bodies, bodies_capacity

    implementation = "c"

    def __cinit__(self):
        self.parts = NULL
        self.entries = NULL
        self.bodies = NULL
        self.meta.data = NULL
        self.meta.len = self.meta.cap = 0

    def __init__(self, socket, on_ack, held=None):
        self.socket = socket
        self._on_ack = on_ack
        self.held = held
        self.sock = <void*><size_t>socket.underlying
        self.parts_capacity = FIRST_PARTS
        self.parts = <zmq_msg_t*>malloc(FIRST_PARTS * sizeof(zmq_msg_t))
        self.entries_capacity = FIRST_ENTRIES
        self.entries = <ck_batch_entry*>malloc(FIRST_ENTRIES * sizeof(ck_batch_entry))
        self.bodies_capacity = FIRST_ENTRIES + 1
        self.bodies = <zmq_msg_t*>malloc(self.bodies_capacity * sizeof(zmq_msg_t))
        if self.parts == NULL or self.entries == NULL or self.bodies == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.parts)
        free(self.entries)
        free(self.bodies)
        free(self.meta.data)

    # -- receiving -----------------------------------------------------------------------------

    def poll(self, int wait_ms):
        """Wait up to ``wait_ms`` for a message (0: do not wait), then take what is queued."""
        cdef zmq_pollitem_t item
        cdef int rc, status
        cdef Py_ssize_t i
        ck_pins_sweep()
        if wait_ms > 0:
            item.socket = self.sock
            item.fd = 0
            item.events = ZMQ_POLLIN
            item.revents = 0
            with nogil:
                rc = zmq_poll(&item, 1, wait_ms)
            if rc < 0:
                if zmq_errno() == EINTR:
                    PyErr_CheckSignals()
                    return []
                raise zmq.ZMQError(zmq_errno())
            if rc == 0:
                return []
        events = []
        for _ in range(_MAX_DRAIN):
            status = self._receive()
            if status == 0:
                break
            if status < 0:
                raise zmq.ZMQError(zmq_errno())
            try:
                self._parse(events)
            except ProtocolError as exc:
                log.warning("coordkit engine: dropped a malformed message: %s", exc)
            finally:
                for i in range(self.n_parts):
                    zmq_msg_close(&self.parts[i])
                self.n_parts = 0
        return events

    cdef int _receive(self) except -2:
        """Every frame of the next message into ``parts``: 1, 0 when none waits, -1 on error."""
        return recv_parts(self.sock, &self.parts, &self.n_parts, &self.parts_capacity)

    cdef int _parse(self, list events) except -1:
        cdef const uint8_t* data = <const uint8_t*>zmq_msg_data(&self.parts[0])
        cdef size_t size = zmq_msg_size(&self.parts[0]), end, first
        cdef int64_t header, rid
        cdef uint32_t length, count, i, _i
        cdef ck_submit submit
        cdef ck_cursor cursor
        cdef int status = ck_read_header(data, size, &header, &length, &end)
        cdef list layout = None
        held = self.held if self.held is not None and self.held.granted else None
        if status != CK_OK:
            raise ProtocolError(f"malformed metadata frame: {ck_strstatus(status).decode()}")
        if header == HEADER_SUBMIT_BATCH:
            status = ck_read_batch_into(
                data, size, HEADER_SUBMIT_BATCH, 2, &self.entries, &self.entries_capacity, &count
            )
            if status != CK_OK:
                raise ProtocolError(f"ENGINE_SUBMIT_BATCH: {ck_strstatus(status).decode()}")
            if held is not None:
                layout = trailed("ENGINE_SUBMIT_BATCH", self.n_parts, self._bytes_of)
            if count != <uint32_t>(self.n_parts - 1 if layout is None else len(layout)):
                raise ProtocolError(
                    f"ENGINE_SUBMIT_BATCH: {count} entries but {self.n_parts - 1} payload frames"
                )
            # Decoded first, so that a bad entry drops the whole batch, as the spec's parse does.
            params = [
                self._params(
                    data + self.entries[i].params_offset,
                    self.entries[i].params_size,
                    "ENGINE_SUBMIT_BATCH",
                )
                for i in range(count)
            ]
            for i in range(count):
                PyList_Append(events, new_request(
                    self.entries[i].rid,
                    params[i],
                    frame_of(&self.parts[1 + i if layout is None else layout[i][0]]),
                ))
                if layout is not None:
                    held.track(self.entries[i].rid, layout[i][1], layout[i][2])
            self.pending += count
        elif header == HEADER_SUBMIT_REQUEST:
            status = ck_read_submit(data, size, &submit)
            if status != CK_OK:
                raise ProtocolError(f"SUBMIT_REQUEST: {ck_strstatus(status).decode()}")
            if submit.length != 3 or not 2 <= self.n_parts <= (3 if held is None else 4):
                raise ProtocolError("SUBMIT_REQUEST: bad layout")
            if held is not None and self.n_parts < 3:
                raise ProtocolError("SUBMIT_REQUEST: no trailer")
            if held is not None:
                layout = trailed("SUBMIT_REQUEST", self.n_parts, self._bytes_of)
            sampling_params = self._params(
                data + submit.offset, size - submit.offset, "SUBMIT_REQUEST"
            )
            PyList_Append(events, new_request(
                submit.rid, sampling_params, frame_of(&self.parts[1])
            ))
            if layout is not None:
                held.track(submit.rid, layout[0][1], layout[0][2])
            self.pending += 1
        elif header == HEADER_ABORT_REQUEST:
            status = ck_read_header_int(data, size, &header, &rid)
            if status != CK_OK or self.n_parts != 1:
                raise ProtocolError("ABORT_REQUEST: bad layout")
            PyList_Append(events, Abort(rid))
            if self.held is not None:
                self.held.aborted(rid)
        elif header == HEADER_RELEASE_KV:  # one request's, or several
            status = ck_read_rids(data, size, &header, &count, &first)
            if status != CK_OK or self.n_parts != 1:
                raise ProtocolError("RELEASE_KV: bad layout")
            cursor.p = data + first
            cursor.end = data + size
            for _i in range(count):
                ck_read_int(&cursor, &rid)
                PyList_Append(events, ReleaseKV(rid))
                if self.held is not None:
                    self.held.released(rid)
        else:
            self._parse_rarely(header, events)
        return 0

    cdef object _params(self, const uint8_t* data, size_t size, str name):
        cdef bytes last = self.last_params_bytes
        if (
            last is not None
            and <size_t>PyBytes_GET_SIZE(last) == size
            and memcmp(PyBytes_AS_STRING(last), data, size) == 0
        ):
            return self.last_params.copy()
        params = decode_params(data, size, name)
        if type(params) is dict and len(<dict>params) and flat(params):
            self.last_params_bytes = PyBytes_FromStringAndSize(<char*>data, size)
            self.last_params = params.copy()
        return params

    cdef _parse_rarely(self, int64_t header, list events):
        cdef Py_ssize_t i
        frames = [
            _Frame(PyBytes_FromStringAndSize(
                <char*>zmq_msg_data(&self.parts[i]), zmq_msg_size(&self.parts[i])
            ))
            for i in range(self.n_parts)
        ]
        if header == HEADER_SUBMIT_REQUEST_WITH_KV:
            submit = protocol.SUBMIT_REQUEST_WITH_KV.parse(frames)
            traceparent = take_traceparent(submit.sampling_params)
            events.append(
                Request(
                    submit.rid,
                    submit.sampling_params,
                    submit.prompt,
                    submit.kv_meta,
                    submit.src_block_ids,
                    traceparent,
                )
            )
            self.pending += 1
        elif header == HEADER_SEND_KV:
            send = protocol.SEND_KV.parse(frames)
            events.append(SendKV(send.rid, send.decode_meta, send.cached_prefix_blocks or 0))
        elif header in protocol.CONTROL:
            message = protocol.CONTROL[header].parse(frames)
            events.append(Control(Header(header), getattr(message, "epoch", None)))
        elif header == HEADER_ERROR:
            refused(protocol.ERROR.parse(frames))
        elif header == HEADER_ENGINE_ACK:
            self._on_ack(protocol.ENGINE_ACK.parse(frames).granted)
        elif self.held is None or not self.held.on_message(header, frames):
            raise ProtocolError(f"unexpected header {header!r}")

    def _bytes_of(self, Py_ssize_t i):
        """Frame ``i`` of the message being parsed, as bytes (a trailer, block hashes)."""
        return PyBytes_FromStringAndSize(
            <char*>zmq_msg_data(&self.parts[i]), zmq_msg_size(&self.parts[i])
        )

    # -- replying ------------------------------------------------------------------------------

    def reply(self, finished):
        """Send the final replies of one step as ONE batched ENGINE_REPLY."""
        cdef Py_ssize_t n = self._build(finished, HEADER_ENGINE_REPLY)
        if n:
            self.pending = max(self.pending - n, 0)

    def reply_partial(self, partial):
        """Send the partial replies of one step as ONE batched ENGINE_REPLY_PARTIAL."""
        self._build(partial, HEADER_ENGINE_REPLY_PARTIAL)

    cdef Py_ssize_t _build(self, object entries, int header) except -1:
        """Write the batch's metadata and take its bodies, then send it; the entry count."""
        cdef Buf* b = &self.meta
        cdef Py_ssize_t i, n = 0
        cdef bint final = header == HEADER_ENGINE_REPLY
        cdef str name = "ENGINE_REPLY" if final else "ENGINE_REPLY_PARTIAL"
        cdef int64_t rid
        cdef uint8_t head[CK_BATCH_HEAD_MAX]
        cdef size_t head_size
        cdef bint has_meta = False, detokenize
        cdef list sent = None if self.held is None else []
        ck_pins_sweep()
        b.len = 0
        self.n_bodies = 1
        try:
            for entry in entries:
                detokenize = False
                if not final:
                    rid_, body = entry
                elif type(entry) is tuple and 2 <= len(<tuple>entry) <= 3:
                    rid_ = (<tuple>entry)[0]
                    body = (<tuple>entry)[1]
                    detokenize = len(<tuple>entry) == 3 and (<tuple>entry)[2]
                else:
                    rid_, body, *rest = entry
                    detokenize = bool(rest and rest[0])
                rid = rid_of(name, rid_)
                buf_reserve(b, 2 + CK_INT_MAX)
                if final:
                    b.data[b.len] = 0x92
                    b.len += 1
                b.len += ck_write_int(b.data + b.len, rid)
                if final:
                    b.data[b.len] = 0xc3 if detokenize else 0xc2
                    b.len += 1
                body = body if isinstance(body, BYTES_LIKE) else packb(body)
                self._take_body(body)
                if sent is not None:
                    sent.append((rid, body))
                n += 1
            if n == 0:
                return 0
            head_size = ck_write_batch_head(head, header, <uint32_t>n)
            if zmq_msg_init_size(&self.bodies[0], head_size + b.len) != 0:
                raise MemoryError()
            has_meta = True
            memcpy(zmq_msg_data(&self.bodies[0]), head, head_size)
            memcpy(<uint8_t*>zmq_msg_data(&self.bodies[0]) + head_size, b.data, b.len)
            # The engine's socket has no high-water mark: a send never blocks.
            for i in range(n + 1):
                if zmq_msg_send(&self.bodies[i], self.sock, ZMQ_SNDMORE if i < n else 0) < 0:
                    raise zmq.ZMQError(zmq_errno())
            if sent is not None:
                self.held.sent(final, sent)
            return n
        finally:
            # Sent messages are empty now: closing them is harmless.
            for i in range(0 if has_meta else 1, self.n_bodies):
                zmq_msg_close(&self.bodies[i])
            self.n_bodies = 1

    cdef int _take_body(self, object body) except -1:
        if not reserve_msgs(
            &self.bodies, &self.bodies_capacity, 1, self.n_bodies, self.n_bodies + 1
        ):
            raise MemoryError()
        ck_msg_from_object(&self.bodies[self.n_bodies], body, COPY_BELOW)
        self.n_bodies += 1
        return 0
