# cython: language_level=3
"""Declarations of the libzmq functions bound at import (see _libzmq.h)."""

cdef extern from "_libzmq.h" nogil:
    ctypedef struct zmq_msg_t:
        pass

    ctypedef struct zmq_pollitem_t:
        void* socket
        int fd
        short events
        short revents

    ctypedef void zmq_free_fn(void* data, void* hint)

    enum:
        ZMQ_DONTWAIT
        ZMQ_SNDMORE
        ZMQ_POLLIN
        ZMQ_POLLOUT
        ZMQ_EVENTS
        CK_ETERM

    int ck_zmq_bind(const char* path, char* err, size_t errlen)

    int zmq_msg_init "ck_msg_init"(zmq_msg_t* msg)
    int zmq_msg_init_size "ck_msg_init_size"(zmq_msg_t* msg, size_t size)
    int zmq_msg_init_data "ck_msg_init_data"(
        zmq_msg_t* msg, void* data, size_t size, zmq_free_fn* ffn, void* hint
    )
    int zmq_msg_recv "ck_msg_recv"(zmq_msg_t* msg, void* socket, int flags)
    int zmq_msg_send "ck_msg_send"(zmq_msg_t* msg, void* socket, int flags)
    int zmq_msg_close "ck_msg_close"(zmq_msg_t* msg)
    int zmq_msg_copy "ck_msg_copy"(zmq_msg_t* dest, zmq_msg_t* src)
    int zmq_msg_move "ck_msg_move"(zmq_msg_t* dest, zmq_msg_t* src)
    void* zmq_msg_data "ck_msg_data"(zmq_msg_t* msg)
    size_t zmq_msg_size "ck_msg_size"(const zmq_msg_t* msg)
    int zmq_msg_more "ck_msg_more"(const zmq_msg_t* msg)
    int zmq_poll "ck_poll"(zmq_pollitem_t* items, int nitems, long timeout)
    int zmq_errno "ck_errno"()
    const char* zmq_strerror "ck_strerror"(int errnum)
    int zmq_getsockopt "ck_getsockopt"(void* socket, int option, void* value, size_t* size)


cdef inline int bind_libzmq() except -1:
    """Bind this module's function table to the libzmq pyzmq loaded."""
    from coordkit._libzmq_path import libzmq_candidates

    cdef char err[512]
    reasons = []
    for path in libzmq_candidates():
        encoded = path.encode()
        if ck_zmq_bind(encoded, err, sizeof(err)) == 0:
            return 0
        reasons.append(err.decode(errors="replace"))
    raise ImportError(
        "coordkit: cannot bind to the libzmq loaded by pyzmq: "
        + ("; ".join(reasons) or "no candidate library found")
    )
