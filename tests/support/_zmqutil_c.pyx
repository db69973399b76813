# cython: language_level=3, embedsignature=True
"""A host's own Cython code on coordkit's public surface, for the tests that prove it works.

It cimports nothing of coordkit but its public ``__init__.pxd``, as a host
stack's engine loop would, and drives pyzmq's own sockets through the
function table bound at import (``bind_libzmq``):

* ``forward`` moves every frame of one message from one socket to another as
  the same ``zmq_msg_t``, never copying it, which is what the Cython
  coordinator does on its hot path; ``send`` and ``recv`` move bytes;
* ``send_submit``, ``recv_submit``, ``send_replies`` and ``recv_reply_batch``
  write and read coordkit's frames with the header codec (``ck_write_submit``,
  ``ck_read_submit``, ``ck_write_batch_head``, ``ck_read_batch_into``) and the
  frame helpers (``recv_parts``, ``ck_msg_from_object``, ``ck_pins_sweep``).
"""

import errno

import zmq

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint8_t, uint32_t, uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

from coordkit cimport (
    CK_BATCH_HEAD_MAX,
    CK_INT_MAX,
    CK_OK,
    COPY_BELOW,
    HEADER_ENGINE_REPLY,
    HEADER_ENGINE_REPLY_PARTIAL,
    HEADER_REPLY_BATCH,
    HEADER_SUBMIT_REQUEST,
    ZMQ_DONTWAIT,
    ZMQ_POLLIN,
    ZMQ_SNDMORE,
    bind_libzmq,
    ck_batch_entry,
    ck_msg_from_object,
    ck_pins_sweep,
    ck_read_batch_into,
    ck_read_submit,
    ck_strstatus,
    ck_submit,
    ck_submit_size,
    ck_write_batch_head,
    ck_write_int,
    ck_write_submit,
    libzmq_candidates as _libzmq_candidates,
    recv_parts,
    zmq_errno,
    zmq_msg_close,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_init_size,
    zmq_msg_more,
    zmq_msg_recv,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
    zmq_poll,
    zmq_pollitem_t,
)

from coordkit.protocol import ProtocolError

bind_libzmq()

__all__ = [
    "forward",
    "send",
    "recv",
    "libzmq_candidates",
    "send_submit",
    "recv_submit",
    "send_replies",
    "recv_reply_batch",
]


def libzmq_candidates() -> list[str]:
    """The paths bind_libzmq tries, most likely first."""
    return _libzmq_candidates()


cdef void* _handle(object sock) except NULL:
    if sock.closed:
        raise zmq.ZMQError(errno.ENOTSOCK)
    return <void*><uintptr_t>sock.underlying


cdef int _poll_in(void* sock, long timeout_ms) except -1:
    """1 when a message is waiting on sock, 0 on timeout."""
    cdef zmq_pollitem_t item
    item.socket = sock
    item.fd = 0
    item.events = ZMQ_POLLIN
    item.revents = 0
    cdef int rc
    with nogil:
        rc = zmq_poll(&item, 1, timeout_ms)
    if rc < 0:
        raise zmq.ZMQError(zmq_errno())
    return rc


def forward(src: zmq.Socket, dst: zmq.Socket, timeout_ms: int = 1000) -> int:
    """Move one multipart message from src to dst, frame by frame, uncopied.

    Waits up to timeout_ms for it; returns the number of frames moved, 0 on
    timeout. A send that fails midway raises, leaving the rest on src.
    """
    cdef void* s = _handle(src)
    cdef void* d = _handle(dst)
    cdef zmq_msg_t msg
    cdef int parts = 0
    cdef int more = 1
    cdef int err = 0
    if not _poll_in(s, timeout_ms):
        return 0
    with nogil:
        while more:
            zmq_msg_init(&msg)
            # the parts of a message arrive together: none of these can block
            if zmq_msg_recv(&msg, s, ZMQ_DONTWAIT) < 0:
                err = zmq_errno()
                zmq_msg_close(&msg)
                break
            more = zmq_msg_more(&msg)
            # a sent message belongs to libzmq; only a failed one is ours to close
            if zmq_msg_send(&msg, d, ZMQ_SNDMORE if more else 0) < 0:
                err = zmq_errno()
                zmq_msg_close(&msg)
                break
            parts += 1
    if err:
        raise zmq.ZMQError(err)
    return parts


def send(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send frames as one multipart message."""
    if not frames:
        raise ValueError("a message has at least one frame")
    cdef void* s = _handle(sock)
    cdef zmq_msg_t msg
    cdef const unsigned char[::1] view
    cdef Py_ssize_t i, last = len(frames) - 1
    cdef int rc, flags
    for i in range(last + 1):
        view = frames[i]
        if zmq_msg_init_size(&msg, view.shape[0]) < 0:
            raise zmq.ZMQError(zmq_errno())
        if view.shape[0]:
            memcpy(zmq_msg_data(&msg), &view[0], view.shape[0])
        flags = ZMQ_SNDMORE if i < last else 0
        with nogil:
            rc = zmq_msg_send(&msg, s, flags)
        if rc < 0:
            rc = zmq_errno()
            zmq_msg_close(&msg)
            raise zmq.ZMQError(rc)


def recv(sock: zmq.Socket, timeout_ms: int = 1000) -> list[bytes]:
    """Receive one multipart message; zmq.Again if none comes within timeout_ms."""
    cdef void* s = _handle(sock)
    cdef zmq_msg_t msg
    cdef int rc
    cdef bint more = True
    if not _poll_in(s, timeout_ms):
        raise zmq.Again(errno.EAGAIN)
    frames = []
    while more:
        zmq_msg_init(&msg)
        with nogil:
            rc = zmq_msg_recv(&msg, s, ZMQ_DONTWAIT)
        if rc < 0:
            rc = zmq_errno()
            zmq_msg_close(&msg)
            raise zmq.ZMQError(rc)
        try:
            frames.append(PyBytes_FromStringAndSize(<char*>zmq_msg_data(&msg), zmq_msg_size(&msg)))
            more = zmq_msg_more(&msg)
        finally:
            zmq_msg_close(&msg)
    return frames


# -- coordkit's frames, written and read with the header codec -------------------------

cdef int _send_all(void* s, zmq_msg_t* msgs, Py_ssize_t n) except -1:
    """Send n messages as one (libzmq takes each sent one; the rest are closed on error)."""
    cdef Py_ssize_t i, j
    cdef int err
    for i in range(n):
        if zmq_msg_send(&msgs[i], s, ZMQ_SNDMORE if i + 1 < n else 0) < 0:
            err = zmq_errno()
            for j in range(i, n):
                zmq_msg_close(&msgs[j])
            raise zmq.ZMQError(err)
    return 0


def send_submit(sock: zmq.Socket, rid: int, params: bytes, prompt) -> None:
    """SUBMIT_REQUEST ``[20, rid, <params>]`` and ``prompt`` (any buffer: copied below
    COPY_BELOW bytes, pinned above it), as a coordkit client sends it."""
    cdef void* s = _handle(sock)
    cdef ck_submit head
    cdef zmq_msg_t msgs[2]
    cdef size_t size = PyBytes_GET_SIZE(params)
    cdef int64_t r = rid
    head.header = HEADER_SUBMIT_REQUEST
    head.length = 3
    ck_pins_sweep()
    if zmq_msg_init_size(&msgs[0], ck_submit_size(&head, r, size)) != 0:
        raise MemoryError()
    ck_write_submit(
        <uint8_t*>zmq_msg_data(&msgs[0]), &head, r, <const uint8_t*>PyBytes_AS_STRING(params),
        size,
    )
    try:
        ck_msg_from_object(&msgs[1], prompt, COPY_BELOW)
    except BaseException:
        zmq_msg_close(&msgs[0])
        raise
    _send_all(s, msgs, 2)


cdef class _Message:
    """The frames of one received message, in a growable array (recv_parts)."""

    cdef zmq_msg_t* parts
    cdef Py_ssize_t n, capacity

    def __cinit__(self):
        self.capacity = 4
        self.n = 0
        self.parts = <zmq_msg_t*>malloc(self.capacity * sizeof(zmq_msg_t))
        if self.parts == NULL:
            raise MemoryError()

    def __dealloc__(self):
        cdef Py_ssize_t i
        for i in range(self.n):
            zmq_msg_close(&self.parts[i])
        free(self.parts)

    cdef int receive(self, object sock, long timeout_ms) except -1:
        cdef void* s = _handle(sock)
        if not _poll_in(s, timeout_ms):
            raise zmq.Again(errno.EAGAIN)
        if recv_parts(s, &self.parts, &self.n, &self.capacity) != 1:
            raise zmq.ZMQError(zmq_errno())
        return 0

    cdef bytes frame(self, Py_ssize_t i):
        return PyBytes_FromStringAndSize(
            <char*>zmq_msg_data(&self.parts[i]), zmq_msg_size(&self.parts[i])
        )


def recv_submit(sock: zmq.Socket, timeout_ms: int = 1000) -> tuple[int, int, bytes, list[bytes]]:
    """``(header, rid, rest, payload)`` of a SUBMIT: ``rest`` the bytes after the rid (the
    sampling params, verbatim), ``payload`` the frames after the metadata."""
    cdef _Message message = _Message()
    cdef ck_submit submit
    cdef Py_ssize_t i
    message.receive(sock, timeout_ms)
    cdef const uint8_t* data = <const uint8_t*>zmq_msg_data(&message.parts[0])
    cdef size_t size = zmq_msg_size(&message.parts[0])
    cdef int status = ck_read_submit(data, size, &submit)
    if status != CK_OK:
        raise ProtocolError(f"malformed SUBMIT: {ck_strstatus(status).decode()}")
    rest = PyBytes_FromStringAndSize(<const char*>data + submit.offset, size - submit.offset)
    return submit.header, submit.rid, rest, [message.frame(i) for i in range(1, message.n)]


def send_replies(sock: zmq.Socket, replies: list, final: bool = True) -> None:
    """An engine's batch of replies, ``[21, [[rid, False], ...]]`` (``final``) or
    ``[22, [rid, ...]]``, then one body per entry (any buffer, copied or pinned)."""
    cdef void* s = _handle(sock)
    cdef Py_ssize_t i, n = len(replies), initialised = 0
    cdef size_t room = CK_BATCH_HEAD_MAX + n * (2 + CK_INT_MAX)
    cdef uint8_t* meta = <uint8_t*>malloc(room)
    cdef zmq_msg_t* msgs = <zmq_msg_t*>malloc((n + 1) * sizeof(zmq_msg_t))
    cdef size_t length
    try:
        if meta == NULL or msgs == NULL:
            raise MemoryError()
        ck_pins_sweep()
        length = ck_write_batch_head(
            meta, HEADER_ENGINE_REPLY if final else HEADER_ENGINE_REPLY_PARTIAL, <uint32_t>n
        )
        for i in range(n):
            if final:
                meta[length] = 0x92  # [rid, needs_detokenize]
                length += 1
            length += ck_write_int(meta + length, replies[i][0])
            if final:
                meta[length] = 0xc2
                length += 1
        if zmq_msg_init_size(&msgs[0], length) != 0:
            raise MemoryError()
        initialised = 1
        memcpy(zmq_msg_data(&msgs[0]), meta, length)
        for i in range(n):
            initialised += 1  # ck_msg_from_object initialises it, also when it fails
            ck_msg_from_object(&msgs[1 + i], replies[i][1], COPY_BELOW)
        initialised = 0  # _send_all takes them all, sent or closed
        _send_all(s, msgs, n + 1)
    finally:
        for i in range(initialised):
            zmq_msg_close(&msgs[i])
        free(meta)
        free(msgs)


def recv_reply_batch(sock: zmq.Socket, timeout_ms: int = 1000) -> list[tuple[int, bool, bytes]]:
    """``[(rid, final, body), ...]`` of a REPLY_BATCH ``[96, [[rid, final], ...]]`` and its
    bodies, read with ck_read_batch_into into an array it grows."""
    cdef _Message message = _Message()
    cdef uint32_t capacity = 1, count, i  # 1: every larger batch grows the array
    cdef ck_batch_entry* entries = <ck_batch_entry*>malloc(sizeof(ck_batch_entry))
    cdef int status
    if entries == NULL:
        raise MemoryError()
    try:
        message.receive(sock, timeout_ms)
        status = ck_read_batch_into(
            <const uint8_t*>zmq_msg_data(&message.parts[0]), zmq_msg_size(&message.parts[0]),
            HEADER_REPLY_BATCH, 2, &entries, &capacity, &count,
        )
        if status != CK_OK:
            raise ProtocolError(f"malformed REPLY_BATCH: {ck_strstatus(status).decode()}")
        if count != message.n - 1:
            raise ProtocolError(f"REPLY_BATCH: {count} entries, {message.n - 1} bodies")
        return [(entries[i].rid, entries[i].flag, message.frame(1 + i)) for i in range(count)]
    finally:
        free(entries)
