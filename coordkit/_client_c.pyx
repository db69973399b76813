# cython: language_level=3, embedsignature=True
"""The client core in Cython: the twin of :mod:`coordkit._client_py`, over raw libzmq.

Same API, same frames on the wire, same futures resolved with the same values
(the module docstring of the twin says how the core works). Here the frames
are built in ``zmq_msg_t``\\ s with the C codec and sent with the libzmq that
pyzmq loaded (see includes/libzmq.h), the metadata of every reply is read in C, and a
reply's body goes from its message straight into ``msgpack.unpackb`` (or a
``bytes``). Token-id prompts are packed in C: a list of ints without a call
per token, and any object exporting an integer buffer (``array.array``, numpy
arrays) from the buffer itself, without a Python int per token.

Frames given as Python objects (a bytes-like prompt, block hashes) are copied
below ``COPY_BELOW`` bytes and sent without a copy above it, the buffer pinned
until libzmq's I/O thread is done with it and released by the next call that
holds the GIL (includes/pins.h).

The rare paths -- a message libzmq refused for now (the outbox), control
messages, ERROR and STATS_REPLY -- use pyzmq and the message specs, as the
twin does.
"""

cimport cython
from cpython.buffer cimport (
    PyBUF_FORMAT,
    PyBUF_READ,
    PyBUF_STRIDES,
    PyBuffer_Release,
    PyObject_CheckBuffer,
    PyObject_GetBuffer,
)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem
from cpython.exc cimport PyErr_Clear
from cpython.list cimport PyList_CheckExact, PyList_New, PyList_SET_ITEM
from cpython.object cimport PyObject, PyObject_Call
from cpython.memoryview cimport PyMemoryView_FromMemory
from cpython.ref cimport Py_DECREF, Py_INCREF, Py_XDECREF
from cpython.tuple cimport PyTuple_CheckExact
from cpython.unicode cimport PyUnicode_AsUTF8String, PyUnicode_Check
from libc.errno cimport EAGAIN
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy

from ._codec_c cimport (
    CK_ARRAY_MAX,
    CK_BATCH_HEAD_MAX,
    CK_INT_MAX,
    CK_OK,
    ck_batch_entry,
    ck_read_batch_into,
    ck_read_header,
    ck_read_header_int,
    ck_strstatus,
    ck_write_array,
    ck_write_batch_head,
    ck_write_int,
)
from ._constants cimport *
from .includes.bytebuf cimport Buf, buf_put, buf_reserve
from .includes.libzmq cimport (
    ZMQ_DONTWAIT,
    ZMQ_EVENTS,
    ZMQ_POLLIN,
    ZMQ_POLLOUT,
    ZMQ_SNDMORE,
    bind_libzmq,
    recv_parts,
    reserve_msgs,
    zmq_errno,
    zmq_getsockopt,
    zmq_msg_close,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_init_size,
    zmq_msg_move,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
    zmq_strerror,
)
from .includes.pins cimport ck_msg_from_object, ck_pins_sweep
from .includes.slots cimport ck_set_slot
from .includes.sysdep cimport BIG_ENDIAN

import asyncio

import msgpack
import zmq

from . import protocol
from ._checks import BYTES_LIKE, pack_params, token_ids
from ._shared import check_constants, logger, never_ran
from .protocol import ErrorCode, ProtocolError, packb, unpackb

bind_libzmq()
check_constants(generated_constants())

cdef extern from *:
    """
    /* 1 when item i of a list or tuple is a plain int in [0, 2**32), a token id, put
       in *v; 0 for anything else. A borrowed look, no reference taken. */
    static inline int ck_token(PyObject *seq, Py_ssize_t i, long long *v)
    {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        int overflow;
        if (!PyLong_CheckExact(item))
            return 0;
        *v = PyLong_AsLongLongAndOverflow(item, &overflow);
        return !overflow && (unsigned long long)*v <= 0xffffffffULL;
    }
    """
    int ck_token(object seq, Py_ssize_t i, long long* v) noexcept

__all__ = [
    "ClientCore",
    "MAX_BATCH_ENTRIES",
    "MAX_BATCH_BYTES",
    "MAX_DRAIN",
    "encode_prompt",
    "pack_tokens",
]

log = logger.getChild("client")

cdef enum:
    _MAX_BATCH_ENTRIES = 1024
    _MAX_BATCH_BYTES = 4 << 20
    _MAX_DRAIN = 4096
    FIRST_PARTS = 64  # frames of a received message before the buffer grows

#: Requests in one SUBMIT_BATCH at most; a longer burst goes as several.
MAX_BATCH_ENTRIES = _MAX_BATCH_ENTRIES
#: Payload bytes (prompts and block hashes) in one SUBMIT_BATCH before it is sent.
MAX_BATCH_BYTES = _MAX_BATCH_BYTES
#: Messages the reader takes in one callback before it lets other callbacks run.
MAX_DRAIN = _MAX_DRAIN

cdef bytes EMPTY_PARAMS = packb({})
cdef object _set_result = asyncio.Future.set_result
cdef object _future_done = asyncio.Future.done
cdef object InvalidStateError = asyncio.InvalidStateError
cdef object _unpackb = msgpack.unpackb


# -- packing prompts -----------------------------------------------------------------------

cdef int pack_sequence(Buf* b, object seq) except -1:
    """A list or tuple of token ids into ``b``, as msgpack.packb packs it; 0 (nothing
    written) at the first item that is not a plain int in [0, 2**32), for the check
    in _checks to convert or to name."""
    cdef Py_ssize_t i, n = len(seq)
    cdef long long v
    cdef uint8_t* out
    buf_reserve(b, CK_ARRAY_MAX + <size_t>n * CK_INT_MAX)
    out = b.data + b.len
    out += ck_write_array(out, <uint32_t>n)
    for i in range(n):
        if not ck_token(seq, i, &v):
            return 0
        out += ck_write_int(out, v)
    b.len = out - b.data
    return 1


cdef int integer_format(const char* fmt) noexcept:
    """1 for a native signed integer format, 2 for an unsigned one, 0 for anything else."""
    if fmt == NULL:
        return 0
    if fmt[0] == b"@" or fmt[0] == b"=":
        fmt += 1
    elif fmt[0] == b"<":
        if BIG_ENDIAN:
            return 0
        fmt += 1
    elif fmt[0] == b">" or fmt[0] == b"!":
        if not BIG_ENDIAN:
            return 0
        fmt += 1
    if fmt[0] == 0 or fmt[1] != 0:
        return 0
    if fmt[0] in b"bhilqn":
        return 1
    if fmt[0] in b"BHILQN":
        return 2
    return 0


cdef int pack_buffer(Buf* b, object obj) except -1:
    """A 1-d buffer of native integers into ``b``, strided or not; 0 (nothing written)
    for any other buffer, for the generic path."""
    cdef Py_buffer view
    cdef Py_ssize_t i, n, stride
    cdef int kind
    cdef const char* p
    cdef int8_t i8
    cdef int16_t i16
    cdef int32_t i32
    cdef int64_t i64
    cdef uint8_t u8
    cdef uint16_t u16
    cdef uint32_t u32
    cdef uint64_t u64
    cdef uint8_t* out
    if PyObject_GetBuffer(obj, &view, PyBUF_FORMAT | PyBUF_STRIDES) != 0:
        PyErr_Clear()
        return 0
    try:
        kind = integer_format(view.format)
        if (
            view.ndim != 1
            or kind == 0
            or not (view.itemsize == 1 or view.itemsize == 2
                    or view.itemsize == 4 or view.itemsize == 8)
        ):
            return 0
        n = view.shape[0]
        stride = view.strides[0]
        buf_reserve(b, CK_ARRAY_MAX + <size_t>n * CK_INT_MAX)
        out = b.data + b.len
        out += ck_write_array(out, <uint32_t>n)
        for i in range(n):
            p = <const char*>view.buf + i * stride
            if kind == 1:
                if view.itemsize == 1:
                    memcpy(&i8, p, 1)
                    i64 = i8
                elif view.itemsize == 2:
                    memcpy(&i16, p, 2)
                    i64 = i16
                elif view.itemsize == 4:
                    memcpy(&i32, p, 4)
                    i64 = i32
                else:
                    memcpy(&i64, p, 8)
                u64 = <uint64_t>i64  # a negative one is beyond any u32 now
            else:
                if view.itemsize == 1:
                    memcpy(&u8, p, 1)
                    u64 = u8
                elif view.itemsize == 2:
                    memcpy(&u16, p, 2)
                    u64 = u16
                elif view.itemsize == 4:
                    memcpy(&u32, p, 4)
                    u64 = u32
                else:
                    memcpy(&u64, p, 8)
            if u64 > 0xffffffffULL:  # not a token id: _checks names it
                return 0
            out += ck_write_int(out, <int64_t>u64)
        b.len = out - b.data
        return 1
    finally:
        PyBuffer_Release(&view)


cdef int pack_tokens_into(Buf* b, object tokens, Py_ssize_t prompt_index) except -1:
    """Token ids into ``b`` as msgpack.packb of them as plain ints (see pack_tokens);
    ``prompt_index`` is the prompt's place in a submit_many call (-1: none)."""
    if PyList_CheckExact(tokens) or PyTuple_CheckExact(tokens):
        if pack_sequence(b, tokens):
            return 0
    elif PyObject_CheckBuffer(tokens) and pack_buffer(b, tokens):
        return 0
    # What the fast paths left: converted to plain ints, or refused naming the token.
    tokens = token_ids(tokens, None if prompt_index < 0 else prompt_index)
    if not pack_sequence(b, tokens):
        raise AssertionError("token_ids() gave what pack_sequence does not take")
    return 0


cdef int pack_str(Buf* b, object text) except -1:
    """``msgpack.packb(text)`` (a str, use_bin_type=True) into ``b``."""
    cdef bytes utf8 = PyUnicode_AsUTF8String(text)
    cdef size_t n = PyBytes_GET_SIZE(utf8)
    buf_reserve(b, n + 5)
    if n < 32:
        b.data[b.len] = 0xa0 | n
        b.len += 1
    elif n <= 0xff:
        b.data[b.len] = 0xd9
        b.data[b.len + 1] = <uint8_t>n
        b.len += 2
    elif n <= 0xffff:
        b.data[b.len] = 0xda
        b.data[b.len + 1] = <uint8_t>(n >> 8)
        b.data[b.len + 2] = <uint8_t>n
        b.len += 3
    else:
        b.data[b.len] = 0xdb
        b.data[b.len + 1] = <uint8_t>(n >> 24)
        b.data[b.len + 2] = <uint8_t>(n >> 16)
        b.data[b.len + 3] = <uint8_t>(n >> 8)
        b.data[b.len + 4] = <uint8_t>n
        b.len += 5
    buf_put(b, PyBytes_AS_STRING(utf8), n)
    return 0


cdef inline bint is_bytes_like(object prompt):
    return isinstance(prompt, BYTES_LIKE)


cdef int prompt_msg(zmq_msg_t* msg, Buf* scratch, object prompt, Py_ssize_t prompt_index) except -1:
    """The prompt's frame into ``msg`` (initialised by this call, also on error)."""
    if not PyList_CheckExact(prompt) and is_bytes_like(prompt):
        return ck_msg_from_object(msg, prompt, COPY_BELOW)
    scratch.len = 0
    try:
        if PyUnicode_Check(prompt):
            pack_str(scratch, prompt)
        else:
            pack_tokens_into(scratch, prompt, prompt_index)
    except BaseException:
        zmq_msg_init(msg)
        raise
    if zmq_msg_init_size(msg, scratch.len) != 0:
        zmq_msg_init(msg)
        raise MemoryError()
    memcpy(zmq_msg_data(msg), scratch.data, scratch.len)
    return 0


def pack_tokens(tokens, prompt_index=None) -> bytes:
    """``msgpack.packb`` of the token ids as plain ints.

    A list or tuple of token ids (ints in [0, 2**32)) is packed in C; an object
    exporting a 1-d buffer of native integers (``array.array``, numpy arrays,
    strided or not) is packed from its buffer; anything else goes through the
    check of ``_checks.token_ids``, which raises TypeError or ValueError naming
    the first bad token. The bytes and the errors are those of the twin's
    ``pack_tokens``.
    """
    cdef Buf b
    b.data = NULL
    b.len = b.cap = 0
    try:
        pack_tokens_into(&b, tokens, -1 if prompt_index is None else prompt_index)
        return PyBytes_FromStringAndSize(<char*>b.data, b.len)
    finally:
        free(b.data)


def encode_prompt(prompt, prompt_index=None) -> object:
    """A prompt's frame: bytes-like as it is, a str or token ids msgpack-packed;
    TypeError or ValueError, before anything is sent, for anything else."""
    cdef Buf b
    if is_bytes_like(prompt):
        return prompt
    b.data = NULL
    b.len = b.cap = 0
    try:
        if PyUnicode_Check(prompt):
            pack_str(&b, prompt)
        else:
            pack_tokens_into(&b, prompt, -1 if prompt_index is None else prompt_index)
        return PyBytes_FromStringAndSize(<char*>b.data, b.len)
    finally:
        free(b.data)


cdef object hashes_of(object prompt, object block_size):
    if block_size is None:
        return None
    if PyUnicode_Check(prompt) or is_bytes_like(prompt):
        raise ValueError("block hashes need a prompt of token ids")
    return protocol.block_hashes(prompt, block_size)


cdef inline bytes params_of(object sampling_params):
    """The params packed: a dict here, anything else by the check in _checks."""
    if sampling_params is None:
        return EMPTY_PARAMS
    if type(sampling_params) is dict:
        try:
            return packb(sampling_params)
        except Exception:
            pass  # pack_params says what is wrong with them
    return pack_params(sampling_params)


cdef inline void close_msgs(zmq_msg_t* msgs, Py_ssize_t n) noexcept:
    cdef Py_ssize_t i
    for i in range(n):
        zmq_msg_close(&msgs[i])


# -- the pending requests ------------------------------------------------------------------

cdef struct Pending:
    int64_t rid
    PyObject* target  # a strong reference; NULL: the cell is empty


cdef struct Table:
    # A ring indexed by rid & mask, at most half full: a client's ids are
    # consecutive, so its requests in flight each have a cell of their own, and
    # taking one out just empties its cell. The rare request whose cell is
    # held (by one that stays in flight for a whole turn of the ring) waits in
    # an overflow dict instead.
    Pending* cells
    uint64_t mask
    Py_ssize_t count  # in the cells and the overflow


cdef int table_init(Table* t, uint64_t capacity) except -1:
    t.cells = <Pending*>calloc(capacity, sizeof(Pending))
    if t.cells == NULL:
        raise MemoryError()
    t.mask = capacity - 1
    t.count = 0
    return 0


# -- the core ------------------------------------------------------------------------------


def _first(entry):
    return entry[0]


@cython.final
cdef class ClientCore:
    """The socket, the pending requests and the frames of one :class:`coordkit.Client`.

    ``socket`` is a connected, acknowledged DEALER (a plain ``zmq.Socket``);
    ``batch`` says whether the coordinator granted batches (the client sets it
    again after a reconnection). The callbacks take
    an ERROR's ``(rid or None, code, message)``, a STATS_REPLY's body, and the
    exception of a socket that failed.
    """

    cdef readonly object socket, loop
    cdef object __weakref__  # the client's future classes refer to their core weakly
    cdef public bint batch  # set again when a reconnection is acknowledged
    cdef public bint closed
    cdef public bint held  # no coordinator for now: submissions dropped, the rest kept
    cdef readonly int64_t next_rid
    cdef Table pending
    cdef dict overflow  # pending requests whose cell was held (see Table)
    cdef object _future_type, _raw_type, _rid_slot, _stream_type
    cdef dict _on_loop  # a future's keyword arguments
    cdef object _on_error, _on_stats, _on_failure, _on_resend, _outbox
    cdef object _later  # while held: the messages other than submissions, for release()
    # The pending requests never handed to libzmq since the loss: at no engine, so
    # the REJOIN leaves them out and release() sends them again at once.
    cdef readonly set unsent
    cdef object _flush_callback, _check_callback, _readable_callback
    cdef void* sock
    cdef bint flush_scheduled, check_scheduled

    # The submissions coalescing into one SUBMIT_BATCH: their entries' bytes,
    # `[rid, params, hashed]` each, and their frames from index 1 on (0 is for
    # the metadata when the batch is sent).
    cdef Buf open_entries
    cdef uint32_t n_open
    cdef size_t open_bytes
    cdef zmq_msg_t* frames
    cdef Py_ssize_t n_frames, frames_capacity

    # The message being received, and a REPLY_BATCH's entries.
    cdef zmq_msg_t* parts
    cdef Py_ssize_t n_parts, parts_capacity
    cdef ck_batch_entry* replies
    cdef uint32_t replies_capacity

    cdef Buf scratch  # a prompt being packed

    implementation = "c"

    def __cinit__(self):
        self.pending.cells = NULL
        self.frames = NULL
        self.parts = NULL
        self.replies = NULL
        self.open_entries.data = NULL
        self.open_entries.len = self.open_entries.cap = 0
        self.scratch.data = NULL
        self.scratch.len = self.scratch.cap = 0

    def __init__(
        self,
        socket,
        *,
        loop,
        bint batch,
        future_types,
        stream_type,
        on_error,
        on_stats,
        on_failure,
        on_resend=None,
    ):
        from collections import deque

        self.socket = socket
        self.sock = <void*><size_t>socket.underlying
        self.loop = loop
        # Given its loop, a future does not look it up (a getpid() system call each time).
        self._on_loop = {"loop": loop}
        self.batch = batch
        table_init(&self.pending, 1024)
        self.overflow = {}
        self._future_type, self._raw_type = future_types
        # The one per-future attribute, set through its slot (the class holds the rest).
        self._rid_slot = self._future_type.__mro__[1].__dict__["request_id"]
        self._stream_type = stream_type
        self._on_error = on_error
        self._on_stats = on_stats
        self._on_failure = on_failure
        self._on_resend = on_resend
        self._outbox = deque()
        self._later = deque()
        self.unsent = set()
        self._flush_callback = self.flush
        self._check_callback = self._check
        self._readable_callback = self.on_readable
        self.frames_capacity = 64
        self.frames = <zmq_msg_t*>malloc(self.frames_capacity * sizeof(zmq_msg_t))
        self.parts_capacity = FIRST_PARTS
        self.parts = <zmq_msg_t*>malloc(FIRST_PARTS * sizeof(zmq_msg_t))
        self.replies_capacity = 64
        self.replies = <ck_batch_entry*>malloc(64 * sizeof(ck_batch_entry))
        if self.frames == NULL or self.parts == NULL or self.replies == NULL:
            raise MemoryError()
        self.n_frames = 1

    def __dealloc__(self):
        cdef Py_ssize_t i
        cdef uint64_t cell
        if self.pending.cells != NULL:
            for cell in range(self.pending.mask + 1):
                Py_XDECREF(self.pending.cells[cell].target)
            free(self.pending.cells)
        if self.frames != NULL:
            for i in range(1, self.n_frames):
                zmq_msg_close(&self.frames[i])
        free(self.frames)
        free(self.parts)
        free(self.replies)
        free(self.open_entries.data)
        free(self.scratch.data)

    @property
    def queued(self):
        """Messages libzmq refused for now, waiting in the outbox for POLLOUT."""
        return len(self._outbox)

    @property
    def count(self):
        """Requests sent (or coalescing) and not yet ended."""
        return self.pending.count

    def pop(self, int64_t rid):
        """The pending request ``rid``, taken out of the table; None when it is not pending."""
        return self._take(rid)

    def get(self, int64_t rid):
        """The pending request ``rid``, left in the table; None when it is not pending."""
        cdef PyObject* found = self._find(rid)
        return None if found == NULL else <object>found

    def targets(self):
        """The pending requests, by id."""
        cdef uint64_t i
        entries = list(self.overflow.items())
        for i in range(self.pending.mask + 1):
            if self.pending.cells[i].target != NULL:
                entries.append((self.pending.cells[i].rid, <object>self.pending.cells[i].target))
        entries.sort(key=_first)
        return [target for _, target in entries]

    # -- the table of pending requests -------------------------------------------------------

    cdef inline PyObject* _find(self, int64_t rid) noexcept:
        """The pending request ``rid`` (a borrowed reference), or NULL."""
        cdef Pending* cell = &self.pending.cells[<uint64_t>rid & self.pending.mask]
        cdef PyObject* found
        if cell.target != NULL and cell.rid == rid:
            return cell.target
        if not self.overflow:
            return NULL
        found = PyDict_GetItem(self.overflow, rid)
        return found

    cdef object _take(self, int64_t rid):
        """The pending request ``rid`` taken out of the table, or None."""
        cdef Pending* cell = &self.pending.cells[<uint64_t>rid & self.pending.mask]
        if cell.target != NULL and cell.rid == rid:
            target = <object>cell.target
            Py_DECREF(target)  # the table's reference; `target` holds one of its own
            cell.target = NULL
            self.pending.count -= 1
            return target
        if self.overflow:
            target = self.overflow.pop(rid, None)
            if target is not None:
                self.pending.count -= 1
            return target
        return None

    cdef int _insert(self, int64_t rid, object target) except -1:
        cdef Pending* cell
        if 2 * (self.pending.count + 1) > <Py_ssize_t>(self.pending.mask + 1):
            self._grow()
        cell = &self.pending.cells[<uint64_t>rid & self.pending.mask]
        if cell.target == NULL:
            Py_INCREF(target)
            cell.rid = rid
            cell.target = <PyObject*>target
        else:
            self.overflow[rid] = target
        self.pending.count += 1
        return 0

    cdef int _grow(self) except -1:
        """Twice the cells; every request back in (the overflow too, where it fits)."""
        cdef Table old = self.pending
        cdef uint64_t i
        cdef Pending* cell
        table_init(&self.pending, 2 * (old.mask + 1))
        self.pending.count = old.count
        overflow, self.overflow = self.overflow, {}
        for i in range(old.mask + 1):
            if old.cells[i].target != NULL:
                cell = &self.pending.cells[<uint64_t>old.cells[i].rid & self.pending.mask]
                cell[0] = old.cells[i]  # the reference moves with it
        free(old.cells)
        for rid, target in overflow.items():
            cell = &self.pending.cells[<uint64_t>rid & self.pending.mask]
            if cell.target == NULL:
                Py_INCREF(target)
                cell.rid = rid
                cell.target = <PyObject*>target
            else:
                self.overflow[rid] = target
        return 0

    cdef list _clear(self):
        """Empty the table; its requests, by id."""
        cdef uint64_t i
        entries = list(self.overflow.items())
        self.overflow = {}
        for i in range(self.pending.mask + 1):
            if self.pending.cells[i].target != NULL:
                entries.append((self.pending.cells[i].rid, <object>self.pending.cells[i].target))
                Py_DECREF(<object>self.pending.cells[i].target)
                self.pending.cells[i].target = NULL
        self.pending.count = 0
        entries.sort(key=_first)
        return [target for _, target in entries]

    # -- requests --------------------------------------------------------------------------

    def submit(self, prompt, sampling_params, block_size, bint raw, block_hashes=None,
               bytes qos=b""):
        return self._one(False, prompt, sampling_params, block_size, raw, block_hashes, qos)

    def stream(self, prompt, sampling_params, block_size, bint raw, block_hashes=None,
               bytes qos=b""):
        return self._one(True, prompt, sampling_params, block_size, raw, block_hashes, qos)

    cdef object _one(self, bint streaming, prompt, sampling_params, block_size, bint raw,
                     block_hashes, bytes qos):
        """One request, answered to a future, or to a stream when ``streaming``; ``qos``
        its QoS fields packed (_checks.qos_fields), or empty."""
        cdef zmq_msg_t msgs[2]
        cdef Py_ssize_t n
        self._check_open()
        params = params_of(sampling_params)
        n = self._frames_of(prompt, block_size, block_hashes, msgs)
        if streaming:
            target = self._stream_type(self.next_rid, raw)
        else:
            target = self._future(self.next_rid, raw)
        self._request(target, params, msgs, n, True, qos)
        return target

    def resend(self, int64_t rid, prompt, sampling_params, block_size, block_hashes=None,
               bytes qos=b""):
        """Send the pending request ``rid`` again, under its id (RESEND, a rejoin)."""
        cdef zmq_msg_t msgs[2]
        cdef Py_ssize_t n
        self._check_open()
        params = params_of(sampling_params)
        n = self._frames_of(prompt, block_size, block_hashes, msgs)
        self._send_request(rid, params, msgs, n, True, qos)

    cdef Py_ssize_t _frames_of(self, prompt, block_size, block_hashes, zmq_msg_t* msgs) except -1:
        """A request's prompt (and its block hashes) into ``msgs``; how many."""
        prompt_msg(&msgs[0], &self.scratch, prompt, -1)
        try:
            hashes = hashes_of(prompt, block_size) if block_size is not None else block_hashes
            if hashes is None:
                return 1
            ck_msg_from_object(&msgs[1], hashes, COPY_BELOW)
        except BaseException:
            zmq_msg_close(&msgs[0])
            raise
        return 2

    def submit_many(self, prompts, sampling_params, block_size, bint raw, bytes qos=b"",
                    own_params=None):
        """One future per prompt, all with the same ``qos``; everything is encoded before
        anything is sent. ``own_params`` (by the prompt's index) replace
        ``sampling_params`` for some prompts: the traced ones, whose params carry their
        traceparent."""
        cdef Py_ssize_t i, n, made = 0, first = 0
        cdef zmq_msg_t* msgs
        cdef bint* hashed
        cdef dict own = None
        self._check_open()
        params = params_of(sampling_params)
        if own_params:
            own = {index: params_of(p) for index, p in own_params.items()}
        prompts = prompts if PyList_CheckExact(prompts) else list(prompts)
        n = len(prompts)
        msgs = <zmq_msg_t*>malloc((2 * n + 1) * sizeof(zmq_msg_t))
        hashed = <bint*>malloc((n + 1) * sizeof(bint))
        try:
            if msgs == NULL or hashed == NULL:
                raise MemoryError()
            for i in range(n):
                prompt = prompts[i]
                prompt_msg(&msgs[2 * i], &self.scratch, prompt, i)
                made = 2 * i + 1
                hashes = hashes_of(prompt, block_size)
                hashed[i] = hashes is not None
                if hashed[i]:
                    ck_msg_from_object(&msgs[2 * i + 1], hashes, COPY_BELOW)
                    made = 2 * i + 2
            self.flush()  # what this iteration coalesced so far goes first
            futures = PyList_New(n)
            for i in range(n):
                future = self._future(self.next_rid, raw)
                Py_INCREF(future)
                PyList_SET_ITEM(futures, i, future)
                first = 2 * i + 2  # _request takes request i's messages whatever happens
                self._request(
                    future,
                    params if own is None else own.get(i, params),
                    &msgs[2 * i],
                    2 if hashed[i] else 1,
                    False,
                    qos,
                )
            self.flush()
            return futures
        finally:
            for i in range(first, made):
                if i % 2 == 0 or hashed[i // 2]:
                    zmq_msg_close(&msgs[i])
            free(msgs)
            free(hashed)

    cdef object _future(self, int64_t rid, bint raw):
        future = PyObject_Call(self._raw_type if raw else self._future_type, (), self._on_loop)
        ck_set_slot(self._rid_slot, future, rid)
        return future

    cdef int _request(
        self, object target, bytes params, zmq_msg_t* msgs, Py_ssize_t n, bint scheduled,
        bytes qos,
    ) except -1:
        """Register ``target`` under the next id and send (or coalesce) its frames;
        ``msgs`` (the prompt, and its hashes) are taken whatever happens."""
        cdef int64_t rid = self.next_rid
        self.next_rid += 1
        self._insert(rid, target)
        return self._send_request(rid, params, msgs, n, scheduled, qos)

    cdef int _send_request(
        self, int64_t rid, bytes params, zmq_msg_t* msgs, Py_ssize_t n, bint scheduled,
        bytes qos,
    ) except -1:
        cdef zmq_msg_t parts[3]
        cdef uint8_t head[2 + CK_INT_MAX]
        cdef Py_ssize_t i, size = PyBytes_GET_SIZE(params), qos_size = PyBytes_GET_SIZE(qos)
        cdef size_t head_size
        cdef uint8_t* out
        if self.held:
            self.unsent.add(rid)
            close_msgs(msgs, n)
            return 0
        if not self.batch:  # [20, rid, params], or [20, rid, priority, deadline_ms, params]
            head[0] = 0x95 if qos_size else 0x93
            head[1] = HEADER_SUBMIT_REQUEST
            head_size = 2 + ck_write_int(head + 2, rid)
            if zmq_msg_init_size(&parts[0], head_size + qos_size + size) != 0:
                close_msgs(msgs, n)
                raise MemoryError()
            out = <uint8_t*>zmq_msg_data(&parts[0])
            memcpy(out, head, head_size)
            memcpy(out + head_size, PyBytes_AS_STRING(qos), qos_size)
            memcpy(out + head_size + qos_size, PyBytes_AS_STRING(params), size)
            for i in range(n):
                zmq_msg_init(&parts[1 + i])
                zmq_msg_move(&parts[1 + i], &msgs[i])
            self._send_parts(parts, 1 + n)
            return 0
        self._open_entry(rid, params, n == 2, qos)
        self._take_frames(msgs, n)
        if self.n_open >= _MAX_BATCH_ENTRIES or self.open_bytes >= _MAX_BATCH_BYTES:
            self.flush()
        elif scheduled and not self.flush_scheduled:
            self.flush_scheduled = True
            self.loop.call_soon(self._flush_callback)
        return 0

    cdef int _open_entry(self, int64_t rid, bytes params, bint hashed, bytes qos) except -1:
        """``[rid, params, hashed]``, or ``[rid, priority, deadline_ms, params, hashed]``."""
        cdef Buf* b = &self.open_entries
        cdef Py_ssize_t size = PyBytes_GET_SIZE(params), qos_size = PyBytes_GET_SIZE(qos)
        buf_reserve(b, 2 + CK_INT_MAX + qos_size + size)
        b.data[b.len] = 0x95 if qos_size else 0x93
        b.len += 1
        b.len += ck_write_int(b.data + b.len, rid)
        buf_put(b, PyBytes_AS_STRING(qos), qos_size)
        buf_put(b, PyBytes_AS_STRING(params), size)
        b.data[b.len] = 0xc3 if hashed else 0xc2
        b.len += 1
        self.n_open += 1
        return 0

    cdef int _take_frames(self, zmq_msg_t* msgs, Py_ssize_t n) except -1:
        cdef Py_ssize_t i
        if not reserve_msgs(
            &self.frames, &self.frames_capacity, 1, self.n_frames, self.n_frames + n
        ):
            close_msgs(msgs, n)
            raise MemoryError()
        for i in range(n):
            self.open_bytes += zmq_msg_size(&msgs[i])
            zmq_msg_init(&self.frames[self.n_frames])
            zmq_msg_move(&self.frames[self.n_frames], &msgs[i])
            self.n_frames += 1
        return 0

    cdef list _drop_open(self):
        """Drop the submissions coalesced so far, unsent; their ids."""
        cdef Py_ssize_t i
        cdef Buf* b = &self.open_entries
        entries = msgpack.Unpacker()
        entries.feed(PyBytes_FromStringAndSize(<char*>b.data, b.len))
        for i in range(1, self.n_frames):
            zmq_msg_close(&self.frames[i])
        self.n_frames = 1
        self.n_open = 0
        self.open_bytes = 0
        b.len = 0
        return [entry[0] for entry in entries]

    def flush(self):
        """Send the submissions coalesced so far: one SUBMIT_BATCH, or a SUBMIT for one."""
        cdef Buf* b = &self.open_entries
        cdef uint8_t head[CK_BATCH_HEAD_MAX]
        cdef uint8_t* out
        cdef size_t n
        self.flush_scheduled = False
        if self.n_open == 0:
            return
        if self.n_open == 1:  # [rid, (qos,) params, hashed] -> [20, rid, (qos,) params]
            if zmq_msg_init_size(&self.frames[0], b.len) != 0:
                raise MemoryError()
            out = <uint8_t*>zmq_msg_data(&self.frames[0])
            out[0] = b.data[0]  # as many fields: the header in, the hashed flag out
            out[1] = HEADER_SUBMIT_REQUEST
            memcpy(out + 2, b.data + 1, b.len - 2)
        else:  # [95, [entry, ...]]
            n = ck_write_batch_head(head, HEADER_SUBMIT_BATCH, self.n_open)
            if zmq_msg_init_size(&self.frames[0], n + b.len) != 0:
                raise MemoryError()
            out = <uint8_t*>zmq_msg_data(&self.frames[0])
            memcpy(out, head, n)
            memcpy(out + n, b.data, b.len)
        n = self.n_frames
        self.n_open = 0
        self.open_bytes = 0
        self.n_frames = 1
        b.len = 0
        self._send_parts(self.frames, n)

    def hold(self):
        """No coordinator for now: until release(), submissions are not sent (nor those
        coalesced or waiting in the outbox): their ids are kept in ``unsent``, and
        every other message is kept, in order, for the coordinator that accepts the
        client again."""
        self.held = True
        self.unsent.update(self._drop_open())
        kept, rids = protocol.rejoin_covers(self._outbox)
        self._later.extend(kept)
        self.unsent.update(rids)
        self._outbox.clear()

    def release(self, first):
        """A coordinator accepted the client again: ``first`` (its REJOIN), the requests
        never sent since the loss (as on RESEND), then what was kept while held, in the
        order it was issued."""
        self.held = False
        later = list(self._later)
        self._later.clear()
        unsent = sorted(self.unsent)
        self.unsent = set()
        if first is not None:
            self.send(first)
        if unsent and self._on_resend is not None:
            self._on_resend(unsent)
            self.flush()
        for frames in later:
            self.send(frames)

    def abort(self, int64_t rid):
        """Send ABORT for a pending request; False (nothing sent) when it is not pending."""
        if self.closed or self._find(rid) == NULL:
            return False
        if rid in self.unsent:  # never sent: it ends here, there is nothing to abort
            self.unsent.discard(rid)
            self._on_error(rid, ErrorCode.UNKNOWN_REQUEST, never_ran(rid))
            return True
        self.send(protocol.ABORT_REQUEST.pack(rid))
        return True

    def cancelled(self, int64_t rid):
        """A ReplyFuture was cancelled: abort its request at the engine."""
        self.abort(rid)

    # -- sending -----------------------------------------------------------------------------

    def send(self, list frames):
        """Send one message after the coalesced submissions (control, ABORT, STATS)."""
        self._check_open()
        self.flush()
        if self.held:
            self._later.append(frames)
            return
        self._send_frames(frames)

    cdef int _send_parts(self, zmq_msg_t* parts, Py_ssize_t n) except -1:
        """Send a whole message (taking its parts), or keep it in the outbox."""
        cdef Py_ssize_t i
        cdef int err, flags
        ck_pins_sweep()
        if self._outbox:
            self._queue(parts, n)
            return 0
        if zmq_msg_send(&parts[0], self.sock, ZMQ_DONTWAIT | (ZMQ_SNDMORE if n > 1 else 0)) < 0:
            err = zmq_errno()
            if err == EAGAIN:
                self._queue(parts, n)
                return 0
            close_msgs(parts, n)
            self._failed(err)
            return 0
        # Only the first frame can be refused: the rest of a message always follows it.
        for i in range(1, n):
            flags = ZMQ_DONTWAIT | (ZMQ_SNDMORE if i + 1 < n else 0)
            if zmq_msg_send(&parts[i], self.sock, flags) < 0:
                close_msgs(&parts[i], n - i)
                self._failed(zmq_errno())
                return 0
        self._sent()
        return 0

    cdef int _queue(self, zmq_msg_t* parts, Py_ssize_t n) except -1:
        """Keep a message libzmq refused for now as bytes in the outbox (rare: the
        high-water mark was reached)."""
        cdef Py_ssize_t i
        frames = []
        for i in range(n):
            frames.append(PyBytes_FromStringAndSize(
                <char*>zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])
            ))
        close_msgs(parts, n)
        self._outbox.append(frames)
        self._flush_outbox()
        return 0

    cdef _send_frames(self, list frames):
        if not self._outbox:
            try:
                self.socket.send_multipart(frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass
            except zmq.ZMQError as exc:
                self._failed(exc.errno)
                return
            else:
                self._sent()
                return
        self._outbox.append(frames)
        self._flush_outbox()

    cdef _flush_outbox(self):
        """Send what libzmq refused, in order, for as long as it takes it."""
        cdef int events
        while self._outbox:
            try:
                self.socket.send_multipart(self._outbox[0], zmq.NOBLOCK, copy=False)
            except zmq.Again:
                events = self._events()
                if events < 0 or not events & ZMQ_POLLOUT:
                    return  # the reader tries again when the FD says the socket changed
                continue
            except zmq.ZMQError as exc:
                self._failed(exc.errno)
                return
            self._outbox.popleft()
        self._sent()

    cdef int _sent(self) except -1:
        """After sends made outside the reader: look at the socket once this iteration."""
        if not self.check_scheduled:
            self.check_scheduled = True
            self.loop.call_soon(self._check_callback)
        return 0

    def _check(self):
        self.check_scheduled = False
        self.on_readable()

    # -- receiving ---------------------------------------------------------------------------

    def on_readable(self):
        """The reader callback: drain what is ready, resolve it, send what waited."""
        cdef int events, status
        cdef Py_ssize_t received = 0, before
        ck_pins_sweep()
        while not self.closed:
            events = self._events()
            if events < 0:
                return
            if self._outbox and events & ZMQ_POLLOUT:
                self._flush_outbox()
            if not events & ZMQ_POLLIN:
                return
            before = received
            while not self.closed and received < _MAX_DRAIN:
                status = self._receive()
                if status == 0:
                    break
                if status < 0:
                    self._failed(zmq_errno())
                    return
                received += 1
                try:
                    self._dispatch()
                finally:
                    close_msgs(self.parts, self.n_parts)
                    self.n_parts = 0
            if received >= _MAX_DRAIN:
                self.loop.call_soon(self._readable_callback)  # more may wait: others first
                return
            if received == before:
                return

    cdef int _events(self) except -2:
        """The socket's ZMQ_EVENTS (which re-arms its FD); -1 after a failure."""
        cdef int events = 0
        cdef size_t size = sizeof(events)
        if zmq_getsockopt(self.sock, ZMQ_EVENTS, &events, &size) != 0:
            self._failed(zmq_errno())
            return -1
        return events

    cdef int _receive(self) except -2:
        """Every frame of the next message into ``parts``: 1, 0 when none waits, -1 on error."""
        return recv_parts(self.sock, &self.parts, &self.n_parts, &self.parts_capacity)

    cdef int _dispatch(self) except -1:
        cdef const uint8_t* data = <const uint8_t*>zmq_msg_data(&self.parts[0])
        cdef size_t size = zmq_msg_size(&self.parts[0]), end
        cdef int64_t header, rid
        cdef uint32_t length, count, i
        cdef int status = ck_read_header(data, size, &header, &length, &end)
        if status != CK_OK:
            self._malformed(f"malformed metadata frame: {ck_strstatus(status).decode()}")
            return 0
        if header == HEADER_ENGINE_REPLY or header == HEADER_ENGINE_REPLY_PARTIAL:
            status = ck_read_header_int(data, size, &header, &rid)
            if status != CK_OK or self.n_parts != 2:
                self._malformed(f"bad {protocol.header_name(header)} layout")
                return 0
            self._deliver(rid, &self.parts[1], header == HEADER_ENGINE_REPLY)
        elif header == HEADER_REPLY_BATCH:
            status = ck_read_batch_into(
                data, size, HEADER_REPLY_BATCH, 2, &self.replies, &self.replies_capacity, &count
            )
            if status != CK_OK:
                self._fail_named(
                    count, f"malformed REPLY_BATCH: {ck_strstatus(status).decode()}"
                )
                return 0
            if count != <uint32_t>(self.n_parts - 1):
                self._fail_named(
                    count, f"REPLY_BATCH: {count} entries but {self.n_parts - 1} payload frames"
                )
                return 0
            for i in range(count):
                self._deliver(self.replies[i].rid, &self.parts[1 + i], self.replies[i].flag)
        else:
            self._dispatch_rarely(header)
        return 0

    cdef int _deliver(self, int64_t rid, zmq_msg_t* body, bint final) except -1:
        cdef PyObject* found = self._find(rid)
        cdef object kind
        cdef char* data
        cdef Py_ssize_t size
        if found == NULL:
            log.debug("coordkit client: reply for request %s, which is not pending", rid)
            return 0
        target = <object>found
        kind = type(target)
        if kind is self._stream_type:
            if final:
                self._take(rid)
            raw = target.raw
        elif not final:
            return 0  # partials are for streams only
        else:
            self._take(rid)
            raw = kind is self._raw_type
        data = <char*>zmq_msg_data(body)
        size = zmq_msg_size(body)
        if raw:
            value = PyBytes_FromStringAndSize(data, size)
        else:
            view = PyMemoryView_FromMemory(data, size, PyBUF_READ)
            try:
                value = _unpackb(view, raw=False, strict_map_key=False)
            except Exception as exc:  # msgpack raises several unrelated types
                self.pop(rid)
                self._fail(target, ProtocolError(f"reply body is not msgpack ({exc})", rid))
                return 0
            finally:
                view.release()  # nothing may read the message once it is closed
        if kind is self._stream_type:
            target._put(final, value)
        else:
            try:
                _set_result(target, value)
            except InvalidStateError:
                pass  # cancelled: its final reply is not wanted
        return 0

    cdef _fail_named(self, uint32_t count, str text):
        """A REPLY_BATCH that does not read whole, or whose bodies do not match its
        entries: the requests it names fail, rather than wait for replies that
        will not come."""
        cdef uint32_t i
        log.warning("coordkit client: %s", text)
        for i in range(count):
            rid = self.replies[i].rid
            target = self.pop(rid)
            if target is not None:
                self._fail(target, ProtocolError(text, rid))

    cdef _dispatch_rarely(self, int64_t header):
        cdef Py_ssize_t i
        frames = [
            PyBytes_FromStringAndSize(
                <char*>zmq_msg_data(&self.parts[i]), zmq_msg_size(&self.parts[i])
            )
            for i in range(self.n_parts)
        ]
        try:
            if header == HEADER_ERROR:
                error = protocol.ERROR.parse(frames)
                self._on_error(error.rid, error.code, error.message)
            elif header == HEADER_STATS_REPLY:
                self._on_stats(unpackb(protocol.STATS_REPLY.parse(frames).stats))
            elif header == HEADER_RESEND and self._on_resend is not None:
                self._on_resend(protocol.RESEND.parse(frames)[0])
            elif header == HEADER_REPLAYED:
                entries = protocol.CLIENT_REPLAYED.parse(frames)[0]
                for i in range(len(entries)):
                    rid, index, final = entries[i]
                    if final or index >= getattr(self.get(rid), "partials", index):
                        self._deliver(rid, &self.parts[1 + i], final)
            elif header != HEADER_CONNECT_ACK:  # a repeated ACK is harmless
                raise ProtocolError(f"unexpected header {header!r}")
        except ProtocolError as exc:
            self._malformed(str(exc))

    cdef _malformed(self, str detail):
        log.warning("coordkit client: dropped a malformed message: %s", detail)

    # -- failures and the end ------------------------------------------------------------------

    cdef _failed(self, int err):
        """The socket failed: nothing more will arrive."""
        if self.closed:
            return
        text = zmq_strerror(err).decode(errors="replace")
        log.error("coordkit client: socket failed: %s", text)
        self.closed = True
        self._on_failure(ConnectionError(f"coordkit client: socket failed: {text}"))

    def fail_all(self, exc):
        """Fail every pending request with ``exc``; drop what was not sent yet (the
        coalesced requests, the outbox, what was held), lest it reach a coordinator that
        never knew them."""
        self._outbox.clear()
        self._later.clear()
        self.unsent.clear()
        self._drop_open()
        for target in self._clear():
            self._fail(target, exc)

    cdef _fail(self, target, exc):
        if type(target) is self._stream_type:
            target._fail(exc)
        elif not _future_done(target):
            target.set_exception(exc)

    def close(self, exc):
        """No more sends; what libzmq refused gets one more try; pending requests fail."""
        if self._outbox and not self.closed:
            self._flush_outbox()
        self.closed = True
        self._outbox.clear()
        self.fail_all(exc)
        ck_pins_sweep()

    cdef _check_open(self):
        if self.closed:
            raise ConnectionError("coordkit client is closed")
