# cython: language_level=3
"""The loop's queue room in C (``coordkit/loop/queue.pyx``), alone, for the tests.

The loop includes its concepts into one extension; this includes the queue (and the
parts it is written on: the latency histograms, the dialect's Inbound) into one of
its own, as ``_loop_c.pyx`` does, so that its struct and functions are held against
the Python twin (``coordkit._loop_py.queue.Queue``) without a loop around them.
``Room`` is the C queue under the twin's method names. ``held_spans`` puts a request
read from real frames through queue_push and queue_inbound and gives back its spans.
No product code uses it. Compiled once per session (extension.py).
"""

from cpython.bytes cimport PyBytes_FromStringAndSize
from libc.math cimport INFINITY
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec
# What the included parts use, as _loop_c.pyx cimports and imports it for them.
from libc.stdint cimport *
from libc.stdlib cimport *
from libc.string cimport *

from coordkit._constants cimport *
from coordkit.includes.libzmq cimport *
from coordkit.includes.tables cimport *

from coordkit import _shared

DECISION_BUCKETS = _shared.DECISION_BUCKETS
LATENCY_BUCKETS = _shared.LATENCY_BUCKETS
OTHER_TENANTS = _shared.OTHER_TENANTS
QueueOutcome = _shared.QueueOutcome
tenant_stride = _shared.tenant_stride

bind_libzmq()

# What the latency histograms take from _loop_c.pyx: their sampling, and the clock.
cdef uint32_t DECISION_EVERY = _shared.DECISION_SAMPLE


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


include "coordkit/loop/latency.pxd"
include "coordkit/loop/dialect.pxd"
include "coordkit/loop/queue.pxd"
include "coordkit/loop/latency.pyx"
include "coordkit/loop/queue.pyx"

__all__ = ["Room", "held_spans"]


cdef class Room:
    """A C Queue, with the methods of the Python twin's Queue."""

    cdef Queue queue

    def __cinit__(self, uint32_t limit, uint32_t handles, int32_t tenants, weights=()):
        memset(&self.queue, 0, sizeof(Queue))
        queue_init(&self.queue, limit, handles, tenants, tuple(weights))

    def __dealloc__(self):
        queue_free(&self.queue)

    @property
    def depth(self):
        return self.queue.depth

    @property
    def tenants(self):
        return self.queue.n_tenants

    def tenant(self, name=None):
        cdef bytes data = b"" if name is None else name.encode()
        return queue_tenant(&self.queue, data, len(data))

    def leave(self, int32_t tenant):
        queue_leave(&self.queue, tenant)

    def holds(self, uint32_t handle):
        return queue_holds(&self.queue, handle)

    def push(self, uint32_t handle, int32_t tenant, int priority, double now,
             double deadline=INFINITY, bint head=False):
        return queue_push(&self.queue, handle, tenant, priority, now, deadline, head,
                          NULL, NULL)

    def peek(self):
        return queue_peek(&self.queue)

    def pop(self, double now):
        """queue_pop, then queue_sent: as the loop does once the pass's batches went."""
        cdef int64_t handle = queue_pop(&self.queue, now)
        queue_sent(&self.queue)
        return handle

    def remove(self, uint32_t handle, double now, int outcome):
        queue_remove(&self.queue, handle, now, outcome)

    def expired(self, double now):
        return queue_expired(&self.queue, now)

    def stats(self):
        return queue_stats(&self.queue)

    def metrics(self):
        return queue_metrics(&self.queue)


cdef void _msg(zmq_msg_t* msg, bytes data):
    zmq_msg_init_size(msg, len(data))
    memcpy(zmq_msg_data(msg), <const char*>data, len(data))


cdef bytes _span(const uint8_t* data, size_t size):
    return None if data == NULL else PyBytes_FromStringAndSize(<const char*>data, size)


def held_spans(bytes meta, list payload, bytes hashes, bint single, size_t prompt_at,
               size_t params_at, size_t params_size, size_t extra_at, size_t extra_size,
               bint computed, bint copied=False, int rounds=1):
    """A request read from ``meta`` (its metadata, or its one frame when ``single``),
    ``payload`` and ``hashes`` (a frame, or with ``computed`` bytes the loop hashed),
    its spans at these offsets (params_size 0: not found), pushed (its small frames
    copied with ``copied``: as many small ones shared as may be) and rebuilt
    (queue_inbound) ``rounds`` times with the frames it came in closed: its spans,
    (prompt, params, extra, hashes, hash frame given back, payload frames, batched), as
    bytes."""
    cdef Queue queue
    cdef Inbound inbound, out
    cdef zmq_msg_t msgs[4]
    cdef int i, n = len(payload)
    memset(&queue, 0, sizeof(Queue))
    queue_init(&queue, 4, 4, 1, ())
    if copied:
        queue.small_shared = SHARED_SMALL_MAX
    try:
        _msg(&msgs[0], meta)
        for i in range(n):
            _msg(&msgs[1 + i], payload[i])
        if hashes is not None:
            _msg(&msgs[1 + n], hashes)
        memset(&inbound, 0, sizeof(Inbound))
        # two payload frames: a KV submission's (its src_block_ids)
        inbound.header = HEADER_SUBMIT_REQUEST_WITH_KV if n == 2 else HEADER_SUBMIT_REQUEST
        inbound.single = single
        inbound.payload = &msgs[0] if single else &msgs[1]
        inbound.n_payload = 1 if single else n
        frame = <const uint8_t*>zmq_msg_data(inbound.payload)
        inbound.prompt = frame + prompt_at
        inbound.prompt_size = zmq_msg_size(inbound.payload) - prompt_at
        if params_size:
            inbound.prompt_size = params_at - prompt_at if single else inbound.prompt_size
            inbound.params = <const uint8_t*>zmq_msg_data(&msgs[0]) + params_at
            inbound.params_size = params_size
        if extra_size:
            inbound.extra = <const uint8_t*>zmq_msg_data(&msgs[0]) + extra_at
            inbound.extra_size = extra_size
        if hashes is not None:
            inbound.hashes = <const uint8_t*>zmq_msg_data(&msgs[1 + n])
            inbound.n_hashes = len(hashes) // BLOCK_HASH_SIZE
            inbound.hash_msg = NULL if computed else &msgs[1 + n]
        queue_push(&queue, 0, 0, 0, 0.0, INFINITY, False, &inbound,
                   NULL if single else &msgs[0])
        for i in range(1 + n + (hashes is not None)):
            zmq_msg_close(&msgs[i])  # the queue's own are what is left
        for _ in range(rounds):
            if not queue_inbound(&queue, 0, &out):
                return None
        spans = (
            _span(out.prompt, out.prompt_size),
            _span(out.params, out.params_size),
            _span(out.extra, out.extra_size),
            _span(out.hashes, out.n_hashes * BLOCK_HASH_SIZE),
            out.hash_msg != NULL,
            [PyBytes_FromStringAndSize(<const char*>zmq_msg_data(&out.payload[i]),
                                       zmq_msg_size(&out.payload[i]))
             for i in range(out.n_payload)],
            out.batched,
        )
        queue_pop(&queue, 1.0)
        queue_sent(&queue)
        assert queue.small_shared == (SHARED_SMALL_MAX if copied else 0)
        return spans
    finally:
        queue_free(&queue)
