# cython: language_level=3
"""Declarations of libzmq.h: the libzmq functions bound at import, under libzmq's own names,
and what every user of the binding needs: the binding itself, a growable array of
messages, a receive of every frame of a message into one."""

from libc.errno cimport EAGAIN
from libc.stdlib cimport free, malloc

cdef extern from "includes/libzmq.h" nogil:
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
        ZMQ_SRCFD
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
    int zmq_msg_get "ck_msg_get"(const zmq_msg_t* msg, int property)
    int zmq_poll "ck_poll"(zmq_pollitem_t* items, int nitems, long timeout)
    int zmq_errno "ck_errno"()
    const char* zmq_strerror "ck_strerror"(int errnum)
    int zmq_getsockopt "ck_getsockopt"(void* socket, int option, void* value, size_t* size)


cdef inline list libzmq_candidates():
    """Paths that may hold pyzmq's libzmq symbols, most likely first.

    A pyzmq wheel bundles ``libzmq-<hash>.so`` and loads it with its backend:
    the libzmq paths mapped into this process come first. A pyzmq built
    against a static libzmq exports the symbols from the backend module
    itself, which is the last resort. Nothing here imports coordkit, so a
    module of any package (a vendored copy, a host's own) binds the same way.
    """
    import os

    import zmq.backend.cython._zmq as backend  # loads libzmq as a side effect

    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                name = os.path.basename(path)
                if name.startswith("libzmq") and ".so" in name and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates.append(backend.__file__)
    return candidates


cdef inline int bind_libzmq() except -1:
    """Bind this module's function table to the libzmq pyzmq loaded: each module that
    cimports this header has a table of its own, and calls this once at import."""
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


cdef inline bint reserve_msgs(zmq_msg_t** msgs, Py_ssize_t* capacity, Py_ssize_t first,
                              Py_ssize_t used, Py_ssize_t needed) noexcept nogil:
    """Grow ``msgs[0]``, an array of ``capacity[0]`` messages of which ``[first, used)``
    are live, to hold at least ``needed``, at least doubling it: the live ones are moved
    with zmq_msg_move (a zmq_msg_t is libzmq's to move, never copied by hand, so this
    is ``reserve`` for messages). False when memory is short (the array is as it was)."""
    cdef Py_ssize_t i, grown_capacity = 2 * capacity[0]
    cdef zmq_msg_t* grown
    if needed <= capacity[0]:
        return True
    if grown_capacity < needed:
        grown_capacity = needed
    grown = <zmq_msg_t*>malloc(grown_capacity * sizeof(zmq_msg_t))
    if grown == NULL:
        return False
    for i in range(first, used):
        zmq_msg_init(&grown[i])
        zmq_msg_move(&grown[i], &msgs[0][i])
    free(msgs[0])
    msgs[0] = grown
    capacity[0] = grown_capacity
    return True


cdef inline int recv_parts(void* sock, zmq_msg_t** parts, Py_ssize_t* n_parts,
                           Py_ssize_t* capacity) except -2:
    """Every frame of the next message into ``parts[0]``, an array of ``capacity``
    that grows as needed (reserve_msgs): 1, 0 when none waits, -1 on error."""
    cdef Py_ssize_t n
    zmq_msg_init(&parts[0][0])
    if zmq_msg_recv(&parts[0][0], sock, ZMQ_DONTWAIT) < 0:
        zmq_msg_close(&parts[0][0])
        return 0 if zmq_errno() == EAGAIN else -1
    n = 1
    while zmq_msg_more(&parts[0][n - 1]):
        if not reserve_msgs(parts, capacity, 0, n, n + 1):
            n_parts[0] = n  # closed by the caller
            raise MemoryError()
        zmq_msg_init(&parts[0][n])
        zmq_msg_recv(&parts[0][n], sock, 0)  # the rest is there
        n += 1
    n_parts[0] = n
    return 1
