# cython: language_level=3, embedsignature=True
"""A tiny user of the raw libzmq binding, for the tests that prove it works.

It drives pyzmq's own sockets through the function table bound at import
(see _libzmq.h): ``forward`` moves every frame of one message from one socket
to another as the same ``zmq_msg_t``, never copying it, which is what the
Cython coordinator does on its hot path.
"""

import errno

import zmq

from libc.stdint cimport uintptr_t
from libc.string cimport memcpy

from cpython.bytes cimport PyBytes_FromStringAndSize

from coordkit._libzmq cimport (
    ZMQ_DONTWAIT,
    ZMQ_POLLIN,
    ZMQ_SNDMORE,
    bind_libzmq,
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

bind_libzmq()

__all__ = ["forward", "send", "recv"]


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
