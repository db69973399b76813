# cython: language_level=3, embedsignature=True
"""The Cython loop core: the coordinator's tables and message handlers over raw libzmq.

:class:`coordkit.Coordinator` owns the sockets, the thread and the timers and
drives this core, or its twin :mod:`coordkit._loop_py`, the reference: both
make the same decisions in the same order and put the same frames on the
wire. pyzmq creates the sockets; the core takes their raw handles and calls
the libzmq that pyzmq loaded (see includes/libzmq.h).

The loop's concepts are small structs with inline functions, each in loop/
(its struct in the .pxd, its functions in the .pyx), included here into one
extension: the message at hand (message), multipart and single frame
(dialect), the kept-prompt store (kept), the batch fan-out of both directions
(fanout), lists through indices (lists: the request_timeout queue, each
client's requests, the idle clients), the latency histograms
(latency) and the traffic counters (traffic). The Loop keeps the tables and
the handlers.

The hot path (a SUBMIT out to an engine; an engine's batch of replies out to
their clients) comes first in the Loop, top to bottom. It runs without the GIL
and without Python objects: frames are received into ``zmq_msg_t``, the
metadata frame is read and rewritten by the C codec, payload frames go on as
the same messages, and state lives in the C tables of includes/tables.h. The rare
paths come after it (peers joining and leaving, control signals, failures,
malformed input): they take the GIL and parse with the message specs of
coordkit.protocol. An engine found gone on the hot path is only marked; its
requests are settled on a rare path once the message at hand is done
(docs/design.md, "Failure model").
"""

cimport cython
from libc.errno cimport EINTR, errno
from libc.math cimport INFINITY, ceil
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport (
    UINT32_MAX,
    int8_t,
    int32_t,
    int64_t,
    uint8_t,
    uint16_t,
    uint32_t,
    uint64_t,
)
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcpy, memmove, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ._codec_c cimport (
    CK_ARRAY_MAX,
    CK_BATCH_HEAD_MAX,
    CK_HEADER_INT_MAX,
    CK_INT_MAX,
    CK_NEW_TOKENS,
    CK_NO_TOKENS,
    CK_OK,
    CK_QOS_WIDTH,
    CK_TOO_MANY,
    ck_batch_entry,
    ck_check_map,
    ck_check_prompt,
    ck_entry,
    ck_prompt_hashes,
    ck_prompt_tokens,
    ck_qos,
    ck_read_batch_into,
    ck_read_header,
    ck_read_int,
    ck_read_qos,
    ck_read_reply,
    ck_read_rids,
    ck_read_single_head,
    ck_read_single_reply,
    ck_read_single_submit,
    ck_read_submit,
    ck_single_entry,
    ck_single_submit,
    ck_single_submit_size,
    ck_streamed_tokens,
    ck_strstatus,
    ck_submit,
    ck_submit_size,
    ck_write_array,
    ck_write_batch_head,
    ck_write_header_int,
    ck_write_int,
    ck_write_single_submit,
    ck_write_submit,
)
from ._constants cimport *
from .includes.libzmq cimport (
    CK_ETERM,
    ZMQ_DONTWAIT,
    ZMQ_SNDMORE,
    ZMQ_SRCFD,
    bind_libzmq,
    zmq_errno,
    zmq_msg_close,
    zmq_msg_copy,
    zmq_msg_data,
    zmq_msg_get,
    zmq_msg_init,
    zmq_msg_init_size,
    zmq_msg_more,
    zmq_msg_recv,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
)
from ._routing_c cimport Router
from .includes.bytebuf cimport reserve
from .includes.cursor cimport (
    ck_cursor,
    ck_load_be16,
    ck_load_be32,
    ck_store_be16,
    ck_store_be32,
)
from .includes.tables cimport ck_cells_for, ck_cells_remove, ck_cells_vacant, ck_mix64
from .includes.ring cimport (
    ck_ring_drop,
    ck_ring_dropped,
    ck_ring_filled,
    ck_ring_push,
    ck_ring_room,
    ck_ring_taken,
)
from .includes.poll cimport POLLIN, poll, pollfd
from .includes.sysdep cimport DEBUG, memmem

import struct
from collections import deque

import zmq

from . import protocol
from ._codec_c import read_single_submit
from ._pd import (
    ABORTED_TEXT,
    LEASE_EXPIRED,
    MEGATRON_DOMAIN,
    PARAMS_NOT_A_MAP,
    PD_COUNTS,
    PREFILL_OVERRIDES,
    PROMPT_LOG_PROBS,
    TIMED_OUT_TEXT,
    UNEXPECTED_READINESS,
    cannot_route,
    check_register_role,
    decode_frames,
    decode_slots,
    handoff_of,
    prefill_frames,
    refuses_prompt_log_probs,
    removed,
    restore_nixl_blobs,
    send_kv_message,
    str_prompt,
    uncached_tokens,
)
from ._shared import (
    BACKOFF_MAX,
    DECISION_BUCKETS,
    DECISION_SAMPLE,
    GONE_REASONS,
    LATENCY_BUCKETS,
    OTHER_TENANTS,
    REFUSAL_EVENTS,
    STATS_CLIENTS,
    TICK,
    QueueOutcome,
    RateLimitedLog,
    busiest,
    check_constants,
    continued,
    detokenize,
    megatron_failed_reply,
    metrics_map,
    monitor_events,
    never_ran,
    resumed,
    stats_map,
    tenant_stride,
    unknown_from_engine,
)
from .protocol import (
    BATCH_FEATURE,
    CONTROL_TRANSITIONS,
    EPOCH_KEY,
    QOS_FEATURE,
    REBUILD_FEATURE,
    ROLE_NAMES,
    ProtocolError,
    asks_metrics,
    error_text,
    header_name,
    packb,
    parse_connect,
    parse_engine_hello,
    unpackb,
)
from .tracing import CLIENT_GONE, TRACEPARENT_MARK, TraceRecord

bind_libzmq()
check_constants(generated_constants())

__all__ = ["Loop"]


cdef double TICK_SECONDS = TICK
# Server ids are the wall clock in ns at a life's start, and up: an id an engine reports
# at or past this (the year 2116) is no earlier life's, and would leave no ids to draw.
cdef int64_t MAX_ADOPTED = 0x4000000000000000  # 2**62
cdef uint32_t DECISION_EVERY = DECISION_SAMPLE
# A traceparent in a request's params: the packed key and its value's head (tracing).
cdef bytes _TRACE_MARK = TRACEPARENT_MARK
cdef const char* TRACE_MARK = _TRACE_MARK
cdef size_t TRACE_MARK_SIZE = len(_TRACE_MARK)
cdef int32_t TRACED_CLIENT_GONE = CLIENT_GONE

cdef enum:
    MSGPACK_FIXARRAY_2 = 0x92  # the head of a batch entry [rid, ...] of two
    MSGPACK_NIL = 0xc0  # Megatron main's multi_modal_data of a text request

cdef const char* MSGPACK_BOOLS = b"\xc2\xc3"  # false, true: a reply batch entry's final flag


# -- sending, growing ------------------------------------------------------------------

cdef inline int send_bytes(void* sock, const void* data, size_t n, int flags) noexcept nogil:
    """Send a copy of ``data`` as one frame; 0, or -1 when the peer is gone."""
    cdef zmq_msg_t msg
    zmq_msg_init_size(&msg, n)
    memcpy(zmq_msg_data(&msg), data, n)
    if zmq_msg_send(&msg, sock, flags) < 0:
        zmq_msg_close(&msg)
        return -1
    return 0


cdef inline void send_msg(void* sock, zmq_msg_t* msg, int flags) noexcept nogil:
    """Send ``msg`` itself (libzmq takes it; closing it afterwards is harmless).

    Only a message's first frame can fail (ROUTER_MANDATORY): this sends the rest.
    """
    zmq_msg_send(msg, sock, flags)


cdef inline void send_shared(void* sock, zmq_msg_t* msg, int flags) noexcept nogil:
    """Send a refcounted copy of ``msg``, keeping ours (pyzmq's rule for re-sends)."""
    cdef zmq_msg_t copy
    zmq_msg_init(&copy)
    zmq_msg_copy(&copy, msg)
    if zmq_msg_send(&copy, sock, flags) < 0:
        zmq_msg_close(&copy)


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# -- the concepts (loop/) --------------------------------------------------------------

include "loop/message.pyx"
include "loop/dialect.pyx"
include "loop/kept.pyx"
include "loop/fanout.pyx"
include "loop/lists.pyx"
include "loop/latency.pyx"
include "loop/traffic.pyx"
include "loop/roles.pyx"
include "loop/queue.pyx"
include "loop/tally.pyx"
include "loop/rebuild.pyx"
include "loop/faults.pyx"
include "loop/pd.pyx"
include "loop/traces.pyx"
include "loop/kvindex.pyx"


# -- the rare paths' helpers -----------------------------------------------------------

cdef inline int refusal(int status) noexcept nogil:
    """The ErrorCode for a new request no engine took (a RouteStatus other than SENT)."""
    if status == ROUTE_NO_ENGINES:
        return ERROR_NO_ENGINES
    return ERROR_MALFORMED if status == ROUTE_UNSENDABLE else ERROR_BUSY


cdef int compare_server_rids(const void* a, const void* b) noexcept nogil:
    cdef int64_t x = (<const RequestOrder*>a).server_rid, y = (<const RequestOrder*>b).server_rid
    return (x > y) - (x < y)


@cython.final
cdef class Loop:
    """The Cython loop core; :class:`coordkit.Coordinator` builds and drives it."""

    implementation = "c"

    def __cinit__(self):
        self.held_bodies = []  # the C fields start zeroed: NULL, empty
        self.deadline = INFINITY

    def __init__(
        self, options, Router router not None, router_socket, wake_socket, monitor_socket
    ):
        self.router = router
        # Held so that the raw handles below stay valid as long as this core.
        self._router_socket = router_socket
        self._wake_socket = wake_socket
        self._monitor_socket = monitor_socket
        self.sock = <void*><size_t>router_socket.underlying
        self.wake = <void*><size_t>wake_socket.underlying
        self.monitor = <void*><size_t>monitor_socket.underlying
        self.fds[0] = router_socket.FD  # in _serve_for's order: messages, stop(), monitor
        self.fds[1] = wake_socket.FD
        self.fds[2] = monitor_socket.FD
        self.connections = {}
        self.ended = []
        self.max_inflight = options.max_inflight
        self.heartbeat_timeout = options.heartbeat_timeout
        self.drain_timeout = options.drain_timeout
        self.max_clients = options.max_clients
        self.max_engines = options.max_engines
        self.keep_prompts = options.keep_prompts
        self.megatron_core = options.dialect == "megatron-core"
        self.single_format = (
            FORMAT_SINGLE_FRAME_MAIN if options.megatron_version == "main" else FORMAT_SINGLE_FRAME
        )
        self.computes_hashes = self.megatron_core and router.policy == "prefix"
        self.block_size = options.block_size
        self._detokenizer = options.detokenizer
        self.has_detokenizer = options.detokenizer is not None
        self._log = RateLimitedLog()
        self.control_state = CONTROL_RUNNING
        self.request_timeout = options.request_timeout
        self.measure_latency = options.measure_latency
        self.epoch = options.epoch
        self.first_server_id = options.first_server_id
        self.rebuild = Rebuild(self, options)
        self.faults = Faults(self, options)
        self.pd = None
        self.pr6675 = options.megatron_version == "pr6675"
        self._options = options
        self.traces = Traces(self, options)
        self.kv_events = options.kv_events
        if self.kv_events is not None:
            self.kv = KVIndex(self.max_engines, options.block_size)
            router.attach_kv(self.kv)
        self.engine_fds = {}
        self.forwards_hashes = router.policy == "prefix"
        latency_init(&self.latency)
        if self.request_timeout or self.measure_latency:
            self.submitted = <double*>malloc(options.max_inflight * sizeof(double))
            if self.submitted == NULL:
                raise MemoryError()
        ends_init(&self.deadlines)
        if self.request_timeout and not links_init(&self.deadline_links, options.max_inflight):
            raise MemoryError()
        ends_init(&self.idle)
        ends_init(&self.vacant)
        self.clients = <Client*>calloc(self.max_clients, sizeof(Client))
        self.engines = <Engine*>calloc(self.max_engines, sizeof(Engine))
        self.gone = <int*>malloc(self.max_engines * sizeof(int))
        self.work = <uint32_t*>calloc(options.max_inflight, sizeof(uint32_t))
        self.priority = <int8_t*>calloc(options.max_inflight, sizeof(int8_t))
        self.wait_deadline = <double*>calloc(options.max_inflight, sizeof(double))
        self.buffers = ck_buffer_pool_new()
        queue_init(&self.queue, options.queue_limit, options.max_inflight, self.max_clients,
                   options.tenant_weights)
        if (
            self.buffers == NULL or self.clients == NULL or self.engines == NULL
            or self.gone == NULL or self.work == NULL or self.priority == NULL
            or self.wait_deadline == NULL or not message_init(&self.message)
            or ck_requests_init(
                &self.requests, options.max_inflight, options.index_size, INDEX_WINDOW_MIN,
                options.first_server_id,
            ) != 0
            or ck_ids_init(&self.client_ids, self.max_clients) != 0
            or ck_ids_init(&self.engine_ids, self.max_engines) != 0
            or roles_init(&self.roles, RETIRED_IDS) != 0
            or not links_init(&self.client_links, options.max_inflight)
            or not links_init(&self.idle_links, self.max_clients)
            or not tally_init(&self.tally, self.max_engines, self.max_clients,
                              options.engine_histograms)
        ):
            raise MemoryError()

    def __dealloc__(self):
        cdef uint32_t slot
        if self.requests.pool != NULL:
            for slot in range(self.requests.used):
                if self.requests.pool[slot].server_rid >= 0:
                    release_kept(self.requests.pool[slot].kept, &self.small_shared)
        queue_free(&self.queue)  # it closes the messages waiting requests hold
        ck_requests_free(&self.requests)
        if self.buffers != NULL:
            ck_buffer_pool_close(self.buffers)
        ck_ids_free(&self.client_ids)
        ck_ids_free(&self.engine_ids)
        roles_free(&self.roles)
        free(self.clients)
        free(self.engines)
        free(self.gone)
        free(self.work)
        free(self.priority)
        free(self.wait_deadline)
        free(self.submitted)
        links_free(&self.deadline_links)
        links_free(&self.client_links)
        links_free(&self.idle_links)
        message_free(&self.message)
        fanout_free(&self.fanout)
        tally_free(&self.tally)

    # -- what the Coordinator calls ------------------------------------------------------

    def serve(self, double timeout, double deadline=INFINITY) -> bool:
        """Handle messages and run the timers (every ``TICK``) for up to ``timeout``
        seconds, without the GIL (taken only for what a timer finds due).

        False once the loop must stop (a SHUTDOWN arrived, ``stop()`` woke it, or
        ``deadline``, its term's ``time.monotonic()``, passed: read after each
        wake-up, before anything is handled); True when the time is up or a signal
        interrupted the wait.
        """
        cdef bint stop
        self.deadline = deadline
        with nogil:
            stop = self._serve_for(timeout)
        return not stop

    def shutdown(self) -> None:
        """End every request still in flight with ERROR(SHUTTING_DOWN): its terminal reply."""
        cdef uint32_t i, n
        cdef RequestOrder* order = self._in_order(-1, -1, &n)
        try:
            for i in range(n):
                if self.requests.pool[order[i].slot].server_rid == order[i].server_rid:
                    self._unqueue(order[i].slot, OUTCOME_REFUSED)
                    self._fail_request(order[i].slot, ERROR_SHUTTING_DOWN, HEADER_SHUTDOWN)
        finally:
            free(order)
        self._settle()
        if self.traces.n_ending:
            self.traces.end()

    def stats(self) -> dict:
        cdef int rank
        cdef uint32_t client
        cdef int64_t least = 0  # requests in flight of the last of the busiest so far
        cdef size_t n
        cdef const uint8_t* identity
        cdef Engine* engine
        cdef double now = monotonic()
        engines = []
        for rank in range(self.n_engines):
            identity = ck_ids_get(&self.engine_ids, rank, &n)
            engine = &self.engines[rank]
            engines.append((
                rank, identity[:n], engine.state, self.router.pending(rank),
                max(engine.quarantined_until - now, 0.0), engine.failures, engine.last_failure,
                *tally_engine(&self.tally, rank, self.measure_latency),
                now - engine.last_heartbeat if engine.heartbeats else None,
            ))
        clients = []  # the busiest so far, pruned as it grows
        for client in range(self.clients_used):
            if not self.clients[client].used or self.clients[client].inflight < least:
                continue
            clients.append((
                self._identity(client), self.clients[client].inflight,
                self.tally.submitted[client] if self.measure_latency else None,
                self.clients[client].rebuild, not self.clients[client].present,
            ))
            if len(clients) == 2 * STATS_CLIENTS:
                clients = busiest(clients)
                least = clients[-1][1]
        result = stats_map(
            implementation=self.implementation,
            policy=self.router.policy,
            epoch=self.epoch,
            messages=self.messages,
            inflight=self.requests.live,
            clients=self.n_clients - self.rebuild.absent(),
            control_state=self.control_state,
            counters=[self.counters[i] for i in range(N_COUNTERS)],
            engines=engines,
            queue=queue_stats(&self.queue),
            busiest_clients=busiest(clients),
        )
        if DEBUG:
            result["debug"] = {"polls": self.debug_polls}
        if self.pd is not None:
            result["pd"] = self.pd.stats()
        if self.kv is not None:
            result["kv_events"] = _kvevents.kv_stats(self.kv.stats(), self.kv_events.stats())
        return result

    def metrics(self) -> dict:
        """Traffic by header and direction, outcomes by error code, latencies."""
        return metrics_map(
            traffic=traffic_metrics(&self.traffic),
            failed=list(self.failed),
            refused=list(self.refused),
            latency=latency_metrics(&self.latency) if self.measure_latency else None,
            prefix=self.router.prefix_counts,
            queue=queue_metrics(&self.queue),
            engine_latency=tally_latency(&self.tally, self.n_engines)
            if self.tally.final != NULL else None,
        )

    # -- the hot path (no GIL) -----------------------------------------------------------

    # No Python object lives in a variable of these functions: Cython would take the GIL
    # at every return to release it (a ``with gil`` block passes its objects inline).

    cdef bint _serve_for(self, double timeout) noexcept nogil:
        """Poll and handle messages, and run the timers when due, for up to ``timeout``
        seconds; True once the loop must stop.

        The loop sleeps in poll(2) on the sockets' ZMQ_FDs, not in zmq_poll: zmq_poll
        asks every socket for ZMQ_EVENTS before and after it sleeps, and each ask is
        two system calls (libzmq's fork check, getpid, and a poll of the socket's
        mailbox): fourteen for three sockets where one poll(2) does. A ZMQ_FD says only
        that commands came since the socket last took them, so a socket is read to
        EAGAIN (which takes them) right before every sleep: a silent fd is then an idle
        socket.
        """
        cdef pollfd fds[3]
        cdef double now = monotonic()
        cdef double deadline = now + timeout
        cdef int i
        for i in range(3):
            fds[i].fd = self.fds[i]
            fds[i].events = POLLIN
            fds[i].revents = POLLIN  # the first pass reads all three: what came before
        while True:
            # Read on entering and after each wake-up, before anything is handled.
            if now >= self.deadline:  # its term is over (a freeze, say): serve nobody
                self.stopping = True
                return True
            self.latency.since = now
            if now >= self.next_tick:
                self.next_tick = now + TICK_SECONDS
                self._tick(now)
            if fds[2].revents:
                with gil:
                    self._connection_events()
            if fds[1].revents and self._woken():
                self.stopping = True
            if self.kv_due:
                self.kv_due = False
                with gil:
                    self.kv.take(self.kv_events, self.router)
            self._drain()
            while self.n_ended and not self.stopping:
                # what they sent before their connections ended went first (the drain)
                with gil:
                    self._drop_ended()
                if self.traces.n_ending:
                    self.traces.end()
                self._drain()
            if self.stopping:
                return True
            now = monotonic()
            if now >= deadline:
                return False
            # Rounded up: rounded down, the last millisecond before the deadline would
            # return at once, again and again, handling nothing until it passed.
            if poll(fds, 3, <int>ceil(max(min(deadline, self.next_tick) - now, 0.0) * 1000.0)) < 0:
                # EINTR: back to Python, which runs the signal handlers.
                return errno != EINTR
            if DEBUG:
                self.debug_polls += 1
            now = monotonic()

    cdef bint _woken(self) noexcept nogil:
        """stop() wrote to the wake socket: read to EAGAIN (see _serve_for)."""
        cdef zmq_msg_t wake
        cdef bint woken = False
        while True:
            zmq_msg_init(&wake)
            if zmq_msg_recv(&wake, self.wake, ZMQ_DONTWAIT) < 0:
                zmq_msg_close(&wake)
                return woken
            # stop() sends an empty frame; the KV events' thread, a byte (records wait).
            if zmq_msg_size(&wake):
                self.kv_due = True
            else:
                woken = True
            zmq_msg_close(&wake)

    cdef void _tick(self, double now) noexcept nogil:
        """The timers: engines whose drain or heartbeat timed out declared gone, the
        requests in flight longer than request_timeout ended, the rebuild window
        closed, HANDLED to rebuild engines, and what that left settled. The GIL is
        taken only for what is due."""
        cdef int rank
        cdef int64_t slot
        cdef double deadline = now - self.request_timeout
        for rank in range(self.n_engines):
            if self.engines[rank].state == ENGINE_GONE:
                continue
            if self.engines[rank].state == ENGINE_DRAINING:
                if now >= self.engines[rank].drain_deadline:
                    self._mark_gone(rank, GONE_DRAIN_TIMED_OUT)
            elif (
                self.heartbeat_timeout
                and self.engines[rank].heartbeats
                and now - self.engines[rank].last_heartbeat > self.heartbeat_timeout
            ):
                self._mark_gone(rank, GONE_NO_HEARTBEAT)
        self.faults.tick(now)
        if self.pd is not None:
            with gil:
                self.pd.tick(now)
        # The oldest first: only the requests that are due are touched.
        if self.request_timeout and self._oldest_submitted_before(deadline):
            with gil:
                while self._oldest_submitted_before(deadline):
                    self._time_out(self.deadlines.oldest)
        if self.queue.n_due and self.queue.entries[self.queue.due[0]].deadline <= now:
            with gil:
                while True:
                    slot = queue_expired(&self.queue, now)
                    if slot < 0:
                        break
                    self.counters[COUNTER_TIMED_OUT] += 1  # its own deadline, while it waited
                    self._fail_request(slot, ERROR_TIMED_OUT, HEADER_SUBMIT_REQUEST)
        if self.rebuild.rebuilding and now >= self.rebuild.until:
            with gil:
                self.rebuild.end_window()
        if self.rebuild.n_deferred and (self.router.n_members or not self.rebuild.rebuilding):
            with gil:
                self.rebuild.resend_deferred()
        if self.rebuild.n_away or self.rebuild.n_holding:
            with gil:
                self.rebuild.end_holds(now)
                self.rebuild.mark_holding()
        self.rebuild.acknowledge()
        if self.n_gone:
            with gil:
                self._settle()
        if self.dispatch_due or self.queue.depth:  # an engine back from quarantine, ...
            self._dispatch()
        if self.traces.n_ending:
            self.traces.end()

    cdef inline bint _oldest_submitted_before(self, double deadline) noexcept nogil:
        return self.deadlines.oldest != UINT32_MAX and (
            self.submitted[self.deadlines.oldest] < deadline
        )

    cdef void _drain(self) noexcept nogil:
        """Handle every message waiting, one at a time; the term's deadline is read
        again every 256 (a freeze in a long burst)."""
        while not self.stopping:
            if not message_receive(&self.message, self.sock):
                if zmq_errno() == CK_ETERM:  # the context is ending: so is the loop
                    self.stopping = True
                return
            self.drained += 1
            if not self.drained & 255 and monotonic() >= self.deadline:
                self.stopping = True
                message_close(&self.message)
                return
            self.messages += 1
            self._handle()
            message_close(&self.message)
            if self.n_gone:
                with gil:
                    self._settle()
            if self.dispatch_due:
                self._dispatch()
            if self.traces.n_ending:  # what the message ended was sent
                self.traces.end()

    cdef void _handle(self) noexcept nogil:
        """Dispatch the message at hand (frame 0 is the sender's routing id)."""
        cdef const uint8_t* identity = self._data(0)
        cdef size_t identity_size = self._size(0)
        cdef int32_t engine = ck_ids_find(&self.engine_ids, identity, identity_size)
        cdef int32_t client
        cdef int64_t header
        cdef uint32_t length
        cdef size_t end
        if self.message.n_parts == 2 and self._size(1) == 0:
            with gil:
                self._register(engine)
            return
        client = ck_ids_find(&self.client_ids, identity, identity_size)
        if self.message.oversized or ck_read_header(
            self._data(1), self._size(1), &header, &length, &end
        ) != CK_OK:
            traffic_count(&self.traffic, RECEIVED, -1, message_bytes(&self.message))
            with gil:
                self._malformed(client, None, -1, "malformed metadata frame")
            return
        traffic_count(&self.traffic, RECEIVED, header, message_bytes(&self.message))
        if engine >= 0:
            self._from_engine(engine, header)
            if self.measure_latency:
                latency_handled(&self.latency, STAGE_REPLY, header)
        elif header == HEADER_CONNECT:
            with gil:
                self._connect(client)
        elif header == HEADER_ENGINE_HELLO and client < 0:
            with gil:
                self._engine_hello(-1)
        elif header == HEADER_REGISTER_ROLE and client < 0:
            with gil:
                self._register_role(-1)
        elif client < 0 or not self.clients[client].present:
            # A client known only from an engine's report, or away after a blip: what
            # its socket queued before it lost us comes ahead of its CONNECT, stale
            # (its REJOIN names the requests; acting on them could run one twice).
            self.counters[COUNTER_NOT_CONNECTED] += 1
            with gil:
                self._log.warn(
                    "not_connected",
                    f"dropped {header_name(header)} from a peer that is not connected",
                )
        else:
            self._seen(client)
            if self.clients[client].fresh and header != HEADER_REJOIN:
                if self.clients[client].inflight:  # what was adopted for it
                    with gil:
                        self.rebuild.rejoins_nothing(client)
                else:
                    self.clients[client].fresh = False
            self._from_client(client, header)
            if self.measure_latency:
                latency_handled(&self.latency, STAGE_REQUEST, header)

    cdef void _from_client(self, int32_t client, int64_t header) noexcept nogil:
        if header == HEADER_SUBMIT_REQUEST or header == HEADER_SUBMIT_REQUEST_WITH_KV:
            if single_frame(self.clients[client].format):
                self._submit_single(client, header)
            else:
                self._submit(client, header)
        elif header == HEADER_SUBMIT_BATCH:
            self._submit_batch(client)
        else:
            with gil:
                self._from_client_rarely(client, header)

    cdef void _submit(self, int32_t client, int64_t header) noexcept nogil:
        """A new request in frames: metadata, payload, and maybe its block hashes."""
        cdef Inbound inbound
        cdef ck_submit submit
        cdef ck_qos qos
        cdef int read = ck_read_submit(self._data(1), self._size(1), &submit)
        cdef int n_payload = 1 if header == HEADER_SUBMIT_REQUEST else 2
        cdef int n_frames = self.message.n_parts - 2
        cdef bint hashed = n_frames == n_payload + 1  # the optional block-hash frame
        qos.priority = qos.deadline_ms = 0
        if read != CK_OK:
            with gil:
                self._malformed(client, submit.rid if submit.offset else None, header,
                                ck_strstatus(read).decode())
            return
        if submit.length != <uint32_t>(2 + n_payload):  # QoS, from a client granted it
            if submit.length != <uint32_t>(4 + n_payload) or not self.clients[client].qos:
                with gil:
                    self._malformed(client, submit.rid, header, "bad frame layout")
                return
            # The QoS fields come off here: the params span starts after them.
            read = ck_read_qos(self._data(1), self._size(1), &submit, &qos)
            if read != CK_OK:
                with gil:
                    self._malformed(client, submit.rid, header, ck_strstatus(read).decode())
                return
        if (
            not n_payload <= n_frames <= n_payload + 1
            or (hashed and self._size(2 + n_payload) % BLOCK_HASH_SIZE)
        ):
            with gil:
                self._malformed(client, submit.rid, header, "bad frame layout")
            return
        multipart_inbound(
            &inbound, header, &self.message.parts[2], n_payload,
            self._data(1) + submit.offset, self._size(1) - submit.offset,
            &self.message.parts[2 + n_payload] if hashed else NULL,
        )
        inbound.priority = <int>qos.priority
        inbound.deadline_ms = qos.deadline_ms
        self._accept(client, submit.rid, &inbound)

    cdef void _submit_single(self, int32_t client, int64_t header) noexcept nogil:
        """A new request in one frame (Megatron-Core): [20, client_rid, prompt, params],
        0.19's, with multi_modal_data last, main's, or main's KV submission [24, ...].

        Read as far as its request id: to an engine of its own layout the rest goes as
        it came. The fields are found (walking the prompt) only when another engine may
        take it (single_walks), or the prefix policy hashes the prompt. A client that
        sends main's layouts is main's, and is sent main's partial replies.
        """
        cdef Inbound inbound
        cdef ck_single_submit single
        cdef const uint8_t* frame = self._data(1)
        cdef size_t size = self._size(1)
        cdef bint hashes = self.computes_hashes and header == HEADER_SUBMIT_REQUEST
        cdef int read = ck_read_single_head(frame, size, &single)
        if read == CK_OK and (
            self.message.n_parts != 2 or not single_layout(header, single.length)
        ):
            with gil:
                self._malformed(client, single.rid, header, "bad frame layout")
            return
        if read == CK_OK and single.length > 4:
            self.clients[client].format = FORMAT_SINGLE_FRAME_MAIN
        if read == CK_OK and (
            hashes or single_walks(single.length, self.n_multipart_engines, self.n_single_engines)
        ):
            read = ck_read_single_submit(frame, size, &single)
        if read != CK_OK:
            with gil:
                self._malformed(client, single.rid if single.prompt else None, header,
                                ck_strstatus(read).decode())
            return
        single_inbound(&inbound, frame, size, &single)
        inbound.payload = &self.message.parts[1]  # kept whole
        if hashes and text_only(&inbound):  # main's: no prefix affinity for multimodal data
            inbound.hashes = message_prompt_hashes(
                &self.message, inbound.prompt, inbound.prompt_size, self.block_size,
                &inbound.n_hashes,
            )
        self._accept(client, single.rid, &inbound)

    cdef void _submit_batch(self, int32_t client) noexcept nogil:
        """SUBMIT_BATCH: each entry down the path of a SUBMIT_REQUEST; the entries
        routed to batched engines leave as one ENGINE_SUBMIT_BATCH per engine once
        every entry is routed (see _send_batches)."""
        cdef Inbound inbound
        cdef ck_batch_entry* entry
        cdef uint32_t count, i
        cdef size_t needed = 0
        cdef int part = 2
        cdef int read
        if not self.clients[client].batch:
            with gil:
                self._malformed(client, None, HEADER_SUBMIT_BATCH, "batches not granted")
            return
        read = message_read_batch(
            &self.message, HEADER_SUBMIT_BATCH, CK_QOS_WIDTH if self.clients[client].qos else 3,
            &count,
        )
        # Room for the entries bound for batched engines: their params are in frame 1.
        if read == CK_OK and not fanout_reserve(&self.fanout, count, self._size(1)):
            read = CK_TOO_MANY
        if read != CK_OK:
            with gil:
                self._malformed_batch(client, count, ck_strstatus(read).decode())
            return
        for i in range(count):
            needed += 1 + self.message.batch_entries[i].flag
        if needed != <size_t>(self.message.n_parts - 2):
            with gil:
                self._malformed_batch(client, count, "bad frame layout")
            return
        for i in range(count):
            if not self.clients[client].used:
                break  # found gone meanwhile
            entry = &self.message.batch_entries[i]
            if entry.flag and self._size(part + 1) % BLOCK_HASH_SIZE:
                with gil:
                    self._malformed(client, entry.rid, HEADER_SUBMIT_BATCH, "bad frame layout")
            else:
                multipart_inbound(
                    &inbound, HEADER_SUBMIT_REQUEST, &self.message.parts[part], 1,
                    self._data(1) + entry.params_offset, entry.params_size,
                    &self.message.parts[part + 1] if entry.flag else NULL,
                )
                inbound.batched = True
                if self.clients[client].qos:
                    inbound.priority = <int>entry.qos.priority
                    inbound.deadline_ms = entry.qos.deadline_ms
                self._accept(client, entry.rid, &inbound)
            part += 1 + entry.flag
        self._send_batches(HEADER_SUBMIT_BATCH)

    cdef void _accept(self, int32_t client, int64_t rid, Inbound* inbound) noexcept nogil:
        """A request that parsed: refused (a duplicate id, a full table), or given a
        server id and an engine, and the frames on to it; it waits in the queue while
        others do (it overtakes none), or when no engine has room."""
        cdef int64_t header = inbound.header
        cdef uint32_t slot
        cdef int status
        if ck_requests_find_client(&self.requests, client, rid) >= 0:
            with gil:
                self._refuse(
                    client, rid, ERROR_DUPLICATE_REQUEST, header, COUNTER_DUPLICATE_REQUEST
                )
            return
        if self.requests.live >= self.max_inflight:
            with gil:
                self._refuse(client, rid, ERROR_BUSY, header, COUNTER_BUSY)
            return
        slot = ck_requests_add(&self.requests, client, rid)
        self._admit(slot, client)
        if self.traces.on:
            self.traces.accept(slot, inbound)
        self.priority[slot] = <int8_t>inbound.priority
        self.wait_deadline[slot] = INFINITY
        if inbound.deadline_ms:
            self.wait_deadline[slot] = monotonic() + inbound.deadline_ms / 1000.0
        if self.queue.depth:  # others wait: it overtakes none
            status = ROUTE_ALL_BUSY
        else:
            status = self._send_new(slot, inbound)
            if status == ROUTE_SENT:
                self.counters[COUNTER_SUBMITTED] += 1
                return
            if status == ROUTE_ENGINE_GONE:
                return
        if status == ROUTE_ALL_BUSY and self.queue.limit:
            # kept again at its dispatch
            release_kept(self.requests.pool[slot].kept, &self.small_shared)
            self.requests.pool[slot].kept = NULL
            if self._queued(slot, inbound, False):
                return
        if (
            status == ROUTE_NO_ENGINES and self.rebuild.rebuilding and self.clients[client].rejoined
        ):
            # Back after a loss, before its engines registered again: sent back once
            # one has (RESEND), not refused.
            if self.traces.on:
                self.traces.drop(slot)
            self._forget(slot)
            with gil:
                self.rebuild.defer(client, rid)
            return
        if self.traces.on:
            self.traces.fail(slot, refusal(status))
        self._forget(slot)
        with gil:
            self._refuse(
                client,
                rid,
                refusal(status),
                header,
                COUNTER_NO_ENGINES if status == ROUTE_NO_ENGINES else (
                    COUNTER_MALFORMED if status == ROUTE_UNSENDABLE else COUNTER_BUSY
                ),
                True,
            )

    cdef int _send_new(self, uint32_t slot, Inbound* inbound) noexcept nogil:
        """A new request (or one that waited) out to an engine: its metadata with its
        server id, what re-sends it kept, and routed; a RouteStatus. An engine found
        gone on the way is settled first, and the request routed again; ENGINE_GONE:
        its client went away meanwhile, the request is forgotten."""
        cdef ck_request* request = &self.requests.pool[slot]
        cdef int64_t server_rid = request.server_rid
        cdef int status
        cdef bint taken
        cdef zmq_msg_t meta
        if not inbound.single:
            rewrite_meta(&meta, inbound, server_rid)
            inbound.meta = &meta
        if self.pd is not None:
            with gil:
                taken = self.pd.takes(slot, inbound)
            if taken:  # both hops: the room's
                if inbound.meta != NULL:
                    zmq_msg_close(&meta)
                    inbound.meta = NULL
                return ROUTE_SENT
        # A KV submission's source blocks are tied to the engine chosen now: never re-sent.
        # What is kept re-sends it, or moves it on with what it streamed, when its
        # engine dies (a rebuild client's too: after the coordinator's loss, it is the
        # client that sends it again, RESEND).
        if inbound.header != HEADER_SUBMIT_REQUEST:
            request.flags |= FLAG_PINNED
        elif self.keep_prompts:
            request.kept = keep(inbound.meta, inbound.payload, inbound.single,
                                &self.small_shared)
            self.faults.keep_streaming(slot)  # it may go on elsewhere from what it streams
        carriers(inbound, self.n_single_engines + self.n_main_engines > 0)
        status = self._route(slot, inbound)
        while status == ROUTE_ENGINE_GONE:
            # The gone engine's requests are older than this one: they go first.
            with gil:
                self._settle()
            if request.server_rid != server_rid:  # its client went away meanwhile
                break
            status = self._route(slot, inbound)
        if inbound.meta != NULL:
            zmq_msg_close(&meta)
            inbound.meta = NULL
        return status

    cdef bint _queued(self, uint32_t slot, Inbound* inbound, bint head) noexcept nogil:
        """The request at ``slot`` waits in the queue till an engine has room
        (_dispatch): last in its flow, or first (``head``: its engine died before it
        produced anything; NULL ``inbound``: it is sent from what it kept); False when
        the queue is full."""
        cdef int32_t tenant = self.clients[self.requests.pool[slot].client].tenant
        if not queue_push(
            &self.queue, slot, tenant if tenant > 0 else 0, self.priority[slot], monotonic(),
            self.wait_deadline[slot], head, inbound, &self.message.parts[1],
        ):
            return False
        self.counters[COUNTER_QUEUED] += 1
        return True

    cdef int _route(self, uint32_t slot, Inbound* inbound) noexcept nogil:
        """Send a request to the engine chosen for it, in its format (and its trailer to
        a rebuild engine); an entry of a SUBMIT_BATCH bound for a batched engine joins
        that engine's batch. A RouteStatus."""
        cdef int rank
        cdef ck_request* request = &self.requests.pool[slot]
        cdef int32_t client = request.client
        cdef Origin origin
        cdef Origin* trailer = NULL
        cdef int status = self._pick_engine(inbound, &rank)
        if status != ROUTE_SENT:
            return status
        request.rank = rank
        self.work[slot] = <uint32_t>self.router.charged
        if self.engines[rank].rebuild:
            trailer = &origin
            origin.client_rid = request.client_rid
            origin.client_id = NULL
            if self.clients[client].rebuild:
                origin.client_id = ck_ids_get(&self.client_ids, client, &origin.client_id_size)
            origin.hashes = inbound.hash_msg if self.forwards_hashes else NULL
        if inbound.batched and self.engines[rank].batch:
            fanout_add(&self.fanout, rank, request.server_rid, inbound.params,
                       inbound.params_size, inbound.payload, NULL, 0)
            if trailer != NULL:
                fanout_trail(&self.fanout, trailer)
        else:
            traffic_count(&self.traffic, SENT, inbound.header, send_request(
                self.sock, self.buffers, inbound, request.server_rid,
                self.engines[rank].format, trailer,
            ))
        if self.measure_latency:
            self.tally.engines[rank].routed += 1
        if self.traces.on:
            self.traces.routed(slot, rank)
        return status

    cdef int _pick_engine(self, Inbound* inbound, int* rank) noexcept nogil:
        """The router's choice into ``rank``, its routing id sent (the request's frames
        follow) unless the request is ``batched`` and the engine takes batches (the
        batch is sent later); a RouteStatus. An unreachable choice is marked gone:
        ENGINE_GONE; one whose format cannot carry the request: UNSENDABLE."""
        cdef double now = monotonic()
        rank[0] = self.router.choose_c(inbound.hashes, inbound.n_hashes, inbound.tokens, now)
        if self.measure_latency:
            latency_decided(&self.latency, now)
        if rank[0] < 0:
            return ROUTE_NO_ENGINES if self.router.n_members == 0 else ROUTE_ALL_BUSY
        if not carries(inbound, self.engines[rank[0]].format):
            self.router.release_c(rank[0], self.router.charged)
            return ROUTE_UNSENDABLE
        if inbound.batched and self.engines[rank[0]].batch:
            return ROUTE_SENT
        if self._send_identity(&self.engine_ids, rank[0]) == 0:
            return ROUTE_SENT
        self.router.release_c(rank[0], self.router.charged)
        self.faults.lost(rank[0], GONE_UNREACHABLE)
        return ROUTE_ENGINE_GONE

    cdef void _send_batches(self, int64_t header) noexcept nogil:
        """The fan-out's entries: one batch per peer (ENGINE_SUBMIT_BATCH to each
        batched engine, REPLY_BATCH to each batched client), in the order the peers
        were first chosen. An entry for an engine that was re-sent or ended meanwhile
        is left out; an engine found gone here leaves its requests to _settle, as any
        engine found gone, and a client that cannot be reached is gone."""
        cdef Fanout* fanout = &self.fanout
        cdef bint to_engines = header == HEADER_SUBMIT_BATCH
        cdef ck_ids* table = &self.engine_ids if to_engines else &self.client_ids
        cdef uint32_t i
        cdef int32_t to
        cdef int64_t slot
        if to_engines:
            for i in range(fanout.n):
                slot = ck_requests_find(&self.requests, fanout.entries[i].rid)
                if slot < 0 or self.requests.pool[slot].rank != fanout.entries[i].to:
                    fanout.entries[i].to = -1
        for i in range(fanout.n):
            to = fanout.entries[i].to
            if to < 0:
                continue
            if to_engines and self.engines[to].state == ENGINE_GONE:
                pass  # its requests are settled
            elif self._send_identity(table, to) == 0:
                traffic_count(&self.traffic, SENT, header,
                              fanout_send(fanout, self.sock, header, i))
            elif to_engines:
                self.faults.lost(to, GONE_UNREACHABLE)
            else:
                with gil:
                    self._client_gone(to)
            fanout_done(fanout, i)
        fanout.n = 0
        if self.holds_bodies:
            self.holds_bodies = False
            with gil:
                self.held_bodies.clear()

    cdef void _from_engine(self, int32_t engine, int64_t header) noexcept nogil:
        cdef int format = self.engines[engine].format
        if self.engines[engine].state == ENGINE_AWAY and header != HEADER_ENGINE_HELLO:
            with gil:  # back on a new connection
                self.faults.back(engine, zmq_msg_get(&self.message.parts[1], ZMQ_SRCFD))
        if header == HEADER_ENGINE_REPLY or (
            header == HEADER_ENGINE_REPLY_PARTIAL and format != FORMAT_SINGLE_FRAME
        ):
            if single_frame(format):
                self._forward_single_replies(engine)
            else:
                self.engines[engine].handled += 1
                self._forward_replies(engine)
        else:
            with gil:
                self._from_engine_rarely(engine, header)

    cdef void _forward_replies(self, int32_t engine) noexcept nogil:
        """Each entry of an engine's batch to its request's client, the body as itself;
        those bound for batched clients leave as one REPLY_BATCH per client. A final to
        a client with a hold is forgotten only once sent: one whose client is found
        gone by its send waits, with the client's other requests, for its REJOIN."""
        cdef int64_t header, slot, client_rid
        cdef uint32_t count, i
        cdef uint32_t deferred = 0  # finals to clients with a hold (_sent_finals)
        cdef int32_t client
        cdef bint final
        cdef double now = 0.0
        cdef ck_entry* entries
        # Room for the entries bound for batched clients: each tail a final flag.
        if message_read_replies(&self.message, &header, &count) != CK_OK or not fanout_reserve(
            &self.fanout, count, count
        ):
            with gil:
                self._malformed(-1, None, -1, "bad ENGINE_REPLY metadata")
            return
        if count != <uint32_t>(self.message.n_parts - 2):
            with gil:
                self._malformed(
                    -1, None, header,
                    f"{count} entries but {self.message.n_parts - 2} payload frames",
                )
            return
        entries = self.message.entries
        final = header == HEADER_ENGINE_REPLY
        if self.measure_latency:
            now = monotonic()
        for i in range(count):
            if not entries[i].valid:
                with gil:
                    self._reject_entry(engine, None, ERROR_MALFORMED, header)
                continue
            slot = ck_requests_find(&self.requests, entries[i].rid)
            if slot < 0 or self.requests.pool[slot].rank != engine:
                # A late reply (its request ended: aborted, timed out, its client
                # gone), or a reply the engine got wrong.
                self.counters[COUNTER_UNKNOWN_REQUEST] += 1
                self.tally.engines[engine].unknown_request += 1
                if self.engines[engine].coordkit:
                    with gil:
                        self._reject_entry(engine, entries[i].rid, ERROR_UNKNOWN_REQUEST, header)
                continue
            if self.requests.pool[slot].flags & FLAG_REPLAYING:
                continue  # the engine's REPLAYED brings it again, in its place
            if not final and self.faults.streamed[slot].known:  # it may have to go on
                self.faults.stream(<uint32_t>slot, self._data(2 + i), self._size(2 + i))
            if self.requests.pool[slot].flags & FLAG_MIGRATED:  # it continues a stream
                with gil:
                    self._replace(2 + i, self.faults.continued(
                        entries[i].rid, self._data(2 + i), self._size(2 + i)
                    ))
            client = self.requests.pool[slot].client
            client_rid = self.requests.pool[slot].client_rid
            if final and self.clients[client].hold > 0:
                deferred += 1
            else:
                self._finish(<uint32_t>slot, final, now)
            if entries[i].needs_detokenize and self.has_detokenizer:
                with gil:
                    self._replace(2 + i, self._detokenized(self._data(2 + i), self._size(2 + i)))
            if self.clients[client].batch:
                fanout_add(&self.fanout, client, client_rid,
                           <const uint8_t*>MSGPACK_BOOLS + final, 1,
                           &self.message.parts[2 + i], NULL, 0)
            elif not self._deliver(
                client, header, client_rid, NULL, 0, &self.message.parts[2 + i]
            ):
                with gil:
                    self._client_gone(client)
        self._send_batches(HEADER_REPLY_BATCH)
        if deferred:
            self._sent_finals(engine, count, now)

    cdef void _sent_finals(self, int32_t engine, uint32_t count, double now) noexcept nogil:
        """The finals to clients with a hold, sent: forgotten now, but those whose client
        went away meanwhile (REPLAYING since: its REJOIN replays them)."""
        cdef uint32_t i
        cdef int64_t slot
        cdef ck_request* request
        for i in range(count):
            if not self.message.entries[i].valid:
                continue
            slot = ck_requests_find(&self.requests, self.message.entries[i].rid)
            if slot < 0:
                continue
            request = &self.requests.pool[slot]
            if (
                request.rank == engine
                and self.clients[request.client].hold > 0
                and not request.flags & FLAG_REPLAYING
            ):
                self._finish(<uint32_t>slot, True, now)

    cdef void _forward_single_replies(self, int32_t engine) noexcept nogil:
        """A Megatron engine's finished requests (or main's partial replies), each map to
        its request's client; those bound for batched clients leave as one REPLY_BATCH
        per client."""
        cdef uint32_t count, i
        cdef int64_t header, slot, client_rid
        cdef int32_t client
        cdef bint final
        cdef double now = 0.0
        cdef ck_single_entry* entry
        cdef const uint8_t* body
        cdef size_t size
        if (
            self.message.n_parts != 2
            or message_read_single_replies(&self.message, &header, &count) != CK_OK
            or not fanout_reserve(&self.fanout, count, count)
        ):
            with gil:
                self._malformed(-1, None, HEADER_ENGINE_REPLY, "bad single-frame ENGINE_REPLY")
            return
        final = header == HEADER_ENGINE_REPLY
        if self.measure_latency:
            now = monotonic()
        for i in range(count):
            entry = &self.message.single_entries[i]
            if entry.status != CK_OK:
                with gil:
                    self._reject_entry(engine, None, ERROR_MALFORMED, header)
                continue
            slot = ck_requests_find(&self.requests, entry.rid)
            if slot < 0 or self.requests.pool[slot].rank != engine:
                self.counters[COUNTER_UNKNOWN_REQUEST] += 1
                self.tally.engines[engine].unknown_request += 1
                if self.pd is not None:
                    with gil:
                        self.pd.stray_reply(engine, entry.rid)
                continue
            client = self.requests.pool[slot].client
            client_rid = self.requests.pool[slot].client_rid
            body = self._data(1) + entry.offset
            size = entry.size
            if self.pd is not None and self.pd.hops[slot].stage == PD_STAGE_PREFILL:
                with gil:  # hop 1's answer
                    self.pd.prefilled(<uint32_t>slot, engine, (<const char*>body)[:size])
                continue
            if not final and self.faults.streamed[slot].known:  # it may have to go on
                self.faults.stream(<uint32_t>slot, body, size)
            if self.requests.pool[slot].flags & FLAG_MIGRATED:  # it continues a stream
                with gil:
                    body = self._held_body(self.faults.continued(entry.rid, body, size), &size)
            self._finish(<uint32_t>slot, final, now)
            if final and self.has_detokenizer:  # as Megatron's coordinator: every final
                with gil:
                    body = self._held_body(self._detokenized(body, size), &size)
            if self.clients[client].batch:
                fanout_add(&self.fanout, client, client_rid,
                           <const uint8_t*>MSGPACK_BOOLS + final, 1, NULL, body, size)
            elif not self._deliver(client, header, client_rid, body, size, NULL):
                with gil:
                    self._client_gone(client)
        self._send_batches(HEADER_REPLY_BATCH)

    cdef void _finish(self, uint32_t slot, bint final, double now) noexcept nogil:
        """A reply for the request at ``slot`` arrived: timed, counted, and a final
        forgets it."""
        cdef ck_request* request = &self.requests.pool[slot]
        if self.measure_latency:
            latency_observe(&self.latency, now - self.submitted[slot],
                            not request.flags & FLAG_PRODUCED, final)
            tally_replied(&self.tally, self.latency.bounds, request.rank,
                          now - self.submitted[slot], not request.flags & FLAG_PRODUCED, final)
        if self.traces.on:
            self.traces.replied(slot, final, now)
        if final:
            if self.pd is not None and self.pd.hops[slot].stage:
                self.pd.finished(slot)
            self._forget(slot)
            self.counters[COUNTER_REPLIES] += 1
        else:
            request.flags |= FLAG_PRODUCED
            self.counters[COUNTER_PARTIALS] += 1

    cdef bint _deliver(self, int32_t client, int64_t header, int64_t client_rid,
                       const uint8_t* body, size_t size, zmq_msg_t* message) noexcept nogil:
        """One reply to its client in the client's format (reply_carried, send_reply):
        the body as ``message`` itself when given, else a copy of ``body``. False when
        the client is gone."""
        cdef int format = self.clients[client].format
        cdef int carried
        if message != NULL:
            body = <const uint8_t*>zmq_msg_data(message)
            size = zmq_msg_size(message)
        carried = reply_carried(format, header, body, size)
        if carried != CARRIED:
            if carried == NOT_A_MAP:
                self.counters[COUNTER_MALFORMED_ENTRIES] += 1
            return True
        if self._send_identity(&self.client_ids, client) != 0:
            return False
        traffic_count(&self.traffic, SENT, header, send_reply(
            self.sock, self.buffers, format, header, client_rid, body, size, message
        ))
        return True

    cdef void _admit(self, uint32_t slot, int32_t client) noexcept nogil:
        """A request that joins the tables: counted at its client, listed, timed."""
        if self.clients[client].inflight == 0:
            list_remove(&self.idle_links, &self.idle, client)
        self.clients[client].inflight += 1
        list_push(&self.client_links, &self.clients[client].requests, slot)
        if self.submitted != NULL:  # timed, and counted at its client
            self.submitted[slot] = monotonic()
            self.tally.submitted[client] += 1
        if self.request_timeout:
            list_push(&self.deadline_links, &self.deadlines, slot)

    cdef void _forget(self, uint32_t slot) noexcept nogil:
        """Take the request at ``slot`` out of every table and count; a draining
        engine whose last request this was is gone."""
        cdef ck_request* request = &self.requests.pool[slot]
        cdef Client* client = &self.clients[request.client]
        cdef int rank
        if self.traces.on:
            self.traces.forget(slot)
        self._unqueue(slot, OUTCOME_ABANDONED)
        if self.pd is not None and self.pd.hops[slot].stage:
            with gil:
                self.pd.forget(slot)  # what its hops hold; its rank -1 after
        rank = request.rank
        list_remove(&self.client_links, &client.requests, slot)
        client.inflight -= 1
        if client.inflight == 0:
            list_push(&self.idle_links, &self.idle, request.client)
        if self.request_timeout:
            list_remove(&self.deadline_links, &self.deadlines, slot)
        self.faults.forget(slot)
        release_kept(request.kept, &self.small_shared)
        ck_requests_remove(&self.requests, slot)
        if rank < 0:
            return
        self.router.release_c(rank, self.work[slot])
        if self.engines[rank].state == ENGINE_DRAINING and self.router.pending_count[rank] == 0:
            self.engines[rank].state = ENGINE_GONE
        if self.queue.depth:  # its room is another's
            self.dispatch_due = True

    cdef void _unqueue(self, uint32_t slot, int outcome) noexcept nogil:
        """A request that waits leaves the queue, not dispatched (``outcome``)."""
        if (
            self.requests.pool[slot].rank < 0 and self.queue.depth
            and queue_holds(&self.queue, slot)
        ):
            queue_remove(&self.queue, slot, monotonic(), outcome)

    cdef void _dispatch(self) noexcept nogil:
        """The requests waiting, in the queue's order, to the engines with room now; the
        entries for batched engines leave as one ENGINE_SUBMIT_BATCH each, once all
        are routed (an engine that starts a step on the first arrival is not handed one
        request ahead of the rest). With no engine left, they end NO_ENGINES."""
        cdef Inbound inbound
        cdef int64_t slot
        cdef int status, code, counter
        self.dispatch_due = False
        fanout_reserve(&self.fanout, 0, 0)
        while self.queue.depth and self.router.has_room_c():
            slot = queue_peek(&self.queue)
            if queue_inbound(&self.queue, slot, &inbound):
                if inbound.batched and not fanout_grow(&self.fanout, inbound.params_size):
                    inbound.batched = False  # memory is short: it goes alone
                queue_pop(&self.queue, monotonic())
                status = self._send_new(slot, &inbound)
                counter, code = COUNTER_SUBMITTED, ERROR_MALFORMED
            else:  # re-queued when its engine died: sent from what it kept
                queue_pop(&self.queue, monotonic())
                status = self._resend(slot)
                counter, code = COUNTER_REROUTED, ERROR_ENGINE_FAILED
            if status == ROUTE_SENT:
                self.counters[counter] += 1
            elif status != ROUTE_ENGINE_GONE:  # ENGINE_GONE: its client went away
                with gil:
                    self._fail_request(
                        slot, code if status == ROUTE_UNSENDABLE else refusal(status),
                        HEADER_SUBMIT_REQUEST,
                    )
        self._send_batches(HEADER_SUBMIT_BATCH)
        queue_sent(&self.queue)  # now what they held may go
        if self.queue.depth and self.router.n_members == 0:
            with gil:
                self._no_engines_left()

    cdef inline void _seen(self, int32_t client) noexcept nogil:
        """A message from ``client``: with nothing in flight, it is the idle one seen last."""
        if self.clients[client].inflight == 0:
            list_remove(&self.idle_links, &self.idle, client)
            list_push(&self.idle_links, &self.idle, client)

    cdef void _mark_gone(self, int rank, int reason) noexcept nogil:
        """Take ``rank`` out of the pool now; its requests are settled after the
        message at hand (see _settle), so a failure never recurses into routing."""
        if self.engines[rank].state == ENGINE_GONE:
            return
        if self.engines[rank].state != ENGINE_AWAY:  # counted when it went away
            self.faults.strike(rank, reason, monotonic())
        if self.engines[rank].state == ENGINE_ALIVE:
            self.router.remove_rank_c(rank)
        self.engines[rank].state = ENGINE_GONE
        self.engines[rank].last_failure = reason
        self.counters[COUNTER_ENGINE_FAILURES] += 1
        self.tally.engines[rank].gone += 1
        self.gone[self.n_gone] = rank
        self.n_gone += 1

    cdef int _send_identity(self, ck_ids* table, int32_t index) noexcept nogil:
        """Start a message to a peer; -1 when it is gone (ROUTER_MANDATORY)."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(table, index, &n)
        return send_bytes(self.sock, identity, n, ZMQ_SNDMORE)

    cdef inline const uint8_t* _data(self, int part) noexcept nogil:
        return message_data(&self.message, part)

    cdef inline size_t _size(self, int part) noexcept nogil:
        return message_size(&self.message, part)

    # -- rare paths (with the GIL) -------------------------------------------------------

    cdef _from_client_rarely(self, int32_t client, int64_t header):
        if header == HEADER_ABORT_REQUEST:
            self._abort(client)
        elif header == HEADER_RELEASE_KV:
            self._release_kv(client)
        elif HEADER_PAUSE <= header <= HEADER_STOP_CUDA_PROFILER:
            self._control(client, header)
        elif header == HEADER_SHUTDOWN:
            self._shutdown_signal(client)
        elif header == HEADER_STATS:
            self._stats_request(client)
        elif header == HEADER_REJOIN and self.clients[client].rebuild:
            self.rebuild.rejoin(client)
        elif header == HEADER_DISCONNECT:
            self._goodbye(client)
        else:
            self._refuse(client, None, ERROR_UNKNOWN_HEADER, header, COUNTER_UNKNOWN_HEADER)

    cdef _from_engine_rarely(self, int32_t engine, int64_t header):
        if header == HEADER_HEARTBEAT:
            self._heartbeat(engine)
        elif header == HEADER_ENGINE_HELLO:
            self._engine_hello(engine)
        elif header == HEADER_DISCONNECT:
            self._disconnect(engine)
        elif header == HEADER_HELD and self.engines[engine].rebuild:
            self.rebuild.held(engine)
        elif header == HEADER_REPLAYED and self.engines[engine].rebuild:
            self.engines[engine].handled += 1
            self.rebuild.replayed(engine)
        elif header == HEADER_REGISTER_ROLE:
            self._register_role(engine)
        elif self.pd is not None and self.pd.from_engine(engine, header):
            pass
        else:
            self.counters[COUNTER_UNKNOWN_HEADER] += 1
            self._log.warn("unknown_header", unknown_from_engine(
                header, engine, self.engines[engine].format
            ))

    cdef _register(self, int32_t engine):
        """An engine announced itself (one empty frame) on a connection: a new rank, or
        one coming back after it left or was declared gone. Under an identity alive, it
        is a repeat on the same connection, or, on another, a new process (Megatron's
        engines register once, at their start) -- unless a hello named its process: then
        the hello that follows says which."""
        cdef int fd = zmq_msg_get(&self.message.parts[1], ZMQ_SRCFD)
        if engine < 0 or self.engines[engine].state in (ENGINE_GONE, ENGINE_DRAINING):
            self._new_engine(engine, fd)
        elif fd == self.engines[engine].fd or self.engines[engine].session:
            self.counters[COUNTER_DUPLICATE_REGISTER] += 1
        else:
            self._restarted(engine, fd)

    cdef _engine_hello(self, int32_t engine):
        """ENGINE_HELLO: a coordkit engine registers, or says so once registered; a
        hello naming another process than the one registered under its identity is a
        new process (the old one's requests are handled as its death)."""
        cdef int fd = zmq_msg_get(&self.message.parts[1], ZMQ_SRCFD)
        try:
            hello = parse_engine_hello(self._frames())
        except ProtocolError as exc:
            self._malformed(-1, None, HEADER_ENGINE_HELLO, str(exc))
            return
        if engine < 0 or self.engines[engine].state in (ENGINE_GONE, ENGINE_DRAINING):
            engine = self._new_engine(engine, fd)
        elif self.engines[engine].session and hello.session != self.engines[engine].session:
            self._restarted(engine, fd)
        elif self.engines[engine].state == ENGINE_AWAY or fd != self.engines[engine].fd:
            self.faults.back(engine, fd)  # the same process, a new connection
        if engine >= 0:
            self.engines[engine].session = hello.session
            self.engines[engine].coordkit = hello.coordkit
            self.engines[engine].batch = hello.batch
            self.engines[engine].format = FORMAT_MULTIPART
            # Its reply messages are numbered anew from its base: a registration each time.
            self.engines[engine].rebuild = hello.rebuild
            self.engines[engine].base = hello.base
            self.engines[engine].handled = self.engines[engine].mark = 0
            self.engines[engine].acked = 0
            self.router.set_capacity(engine, hello.capacity)
            self.dispatch_due = True
            self._count_formats()
            if hello.role:
                self._pd_room().seat(engine, hello.role, False, hello.domain, hello.capacity)
                self.pd.transfer[engine] = hello.transfer
            elif self.pd is not None and self.pd.seats[engine].seated:
                self.pd.unseat(engine)
                self.faults.admit(engine)
            if self.kv_events is not None:  # its publisher, or none (its predecessor's go)
                if hello.kv_events is None:
                    self.kv_events.unannounce(engine)
                else:
                    self.kv_events.add(
                        engine, hello.kv_events, hello.kv_events_replay, announced=True
                    )
            if hello.ack or hello.rebuild:  # it is in the pool: say so, and what it was granted
                self._reply_to_sender(protocol.engine_ack(hello, self.epoch, roles=True))
            if self.pd is not None:
                self.pd.drain()

    cdef PD _pd_room(self):
        """The P/D room, made when the first engine takes a role."""
        if self.pd is None:
            self.pd = PD(self, self._options)
        return self.pd

    cdef _register_role(self, int32_t engine):
        """A #6675 engine's REGISTER_ROLE: judged as #6675 judges it (a registered identity
        is replaced first: its requests as at its death), then acknowledged ([2]) and
        seated, or refused ([29, reason])."""
        cdef int fd = zmq_msg_get(&self.message.parts[1], ZMQ_SRCFD)
        cdef PD pd
        cdef int32_t rank
        identity = self._frame_bytes(0)
        try:
            message = unpackb(self._frame_bytes(1))
        except ProtocolError as exc:
            self._malformed(-1, None, HEADER_REGISTER_ROLE, str(exc))
            return
        pd = self._pd_room() if self.pr6675 else self.pd
        fleet = {} if pd is None else pd.registrations
        if not isinstance(message, list):
            message = [message]
        check = check_register_role(message, identity, fleet, self.pr6675)
        if check.replaces and engine >= 0 and self.engines[engine].state != ENGINE_GONE:
            self._mark_gone(engine, GONE_RESTARTED)
            self._settle()
        registration = check.registration
        if registration is None or pd is None:
            if pd is not None:
                pd.counts["roles_refused"] += 1
            self._reply_to_sender(protocol.ROLE_REFUSED.pack(check.refusal))
            return
        rank = self._new_engine(ck_ids_find(&self.engine_ids, self._data(0), self._size(0)), fd)
        if rank < 0:
            return
        self.engines[rank].format = FORMAT_SINGLE_FRAME_MAIN  # main's frames, four SUBMIT fields
        self._count_formats()
        pd.seat(rank, ROLE_NAMES[registration.role], True, MEGATRON_DOMAIN,
                registration.request_capacity)
        pd.seats[rank].ssm_capacity = registration.ssm_capacity or 0
        pd.seats[rank].slot_cost = registration.slot_cost
        pd.seats[rank].nccl = registration.transport == "nccl"
        pd.transfer[rank] = registration.instance_meta
        pd.registrations[identity] = registration
        self._reply_to_sender(protocol.REGISTER_ROLE_ACK.pack())
        pd.drain()

    cdef _count_formats(self):
        """How many engines not gone speak each format: which checks a SUBMIT needs."""
        cdef int rank
        self.n_single_engines = self.n_main_engines = self.n_multipart_engines = 0
        for rank in range(self.n_engines):
            if self.engines[rank].state == ENGINE_GONE:
                continue
            if self.engines[rank].format == FORMAT_SINGLE_FRAME:
                self.n_single_engines += 1
            elif self.engines[rank].format == FORMAT_SINGLE_FRAME_MAIN:
                self.n_main_engines += 1
            else:
                self.n_multipart_engines += 1

    cdef _restarted(self, int32_t engine, int fd):
        """A new process registered under an engine's identity: the old one's requests
        are handled as its death (re-sent or failed), and the rank starts anew."""
        self.counters[COUNTER_ENGINE_RESTARTS] += 1
        self._mark_gone(engine, GONE_RESTARTED)
        self._new_engine(engine, fd)  # first: the new one may take them
        self._settle()

    cdef int32_t _new_engine(self, int32_t engine, int fd) except -2:
        """Put the sender in the pool: ``engine`` coming back, or a new rank (reusing
        a gone rank with nothing left in flight once the table is full). Its rank,
        or -1 when there is no room or the sender is, or was, a client."""
        cdef int32_t rank
        cdef size_t n = self._size(0)
        cdef const uint8_t* retired
        cdef size_t retired_n
        if engine < 0:
            if ck_ids_find(&self.client_ids, self._data(0), n) >= 0 or (
                roles_of(&self.roles, self._data(0), n) == ROLE_CLIENT
            ):
                self._malformed(-1, None, -1, "a client sent an engine registration")
                return -1
            rank = self.n_engines
            if rank == self.max_engines:
                rank = -1
                for engine in range(self.n_engines):
                    if self.engines[engine].state == ENGINE_GONE:
                        if self.router.pending(engine) == 0:
                            rank = engine
                            break
                if rank < 0:
                    self.counters[COUNTER_TABLE_FULL] += 1
                    self._log.warn("engines_full", "engine table full: registration dropped")
                    return -1
                retired = ck_ids_get(&self.engine_ids, rank, &retired_n)
                roles_remember(&self.roles, retired, retired_n, ROLE_ENGINE)
                ck_ids_remove(&self.engine_ids, rank)
            else:
                self.n_engines += 1
            memset(&self.engines[rank], 0, sizeof(Engine))
            tally_reset(&self.tally, rank)
            self.engines[rank].fd = -1
            self.engines[rank].last_failure = -1
            ck_ids_insert(&self.engine_ids, rank, self._data(0), n)
            engine = rank
        self.engines[engine].state = ENGINE_ALIVE
        self._watch(engine, fd)
        self.engines[engine].session = 0
        self.engines[engine].coordkit = False
        self.engines[engine].batch = False
        self.engines[engine].format = self.single_format if self.megatron_core else FORMAT_MULTIPART
        self.engines[engine].heartbeats = False
        self.engines[engine].rebuild = False
        self.engines[engine].handled = self.engines[engine].mark = self.engines[engine].acked = 0
        self.router.set_capacity(engine, 0)  # until a hello says otherwise
        self.faults.admit(engine)
        self.dispatch_due = True
        self._count_formats()
        return engine

    cdef _watch(self, int rank, int fd):
        """An engine's connection is ``fd`` (-1: inproc, not watched): when it ends, the
        engine is lost (Faults.lost)."""
        if self.engine_fds.get(self.engines[rank].fd, -1) == rank:
            del self.engine_fds[self.engines[rank].fd]
        self.engines[rank].fd = fd
        if fd < 0:
            return
        self._connection_events()  # what the monitor said first
        if fd in self.connections:
            self.engine_fds[fd] = rank
        else:  # it ended already
            self._end(self._engine_identity(rank), fd)

    cdef _connect(self, int32_t client):
        """CONNECT: a new client (or a repeated CONNECT), answered with CONNECT_ACK."""
        cdef int32_t index
        try:
            hello = parse_connect(self._frames())
        except ProtocolError as exc:
            self._malformed(-1, None, HEADER_CONNECT, str(exc))
            return
        fd = zmq_msg_get(&self.message.parts[1], ZMQ_SRCFD)
        if client >= 0 and self.clients[client].present and fd != self.clients[client].fd:
            # Its routing id on a new connection (libzmq hands it over: nothing reaches
            # the old one any more): it reconnected before its old connection's end was
            # seen, or another process took its name: either way the old one is gone
            # (away, with a hold: a blip).
            if self.clients[client].hold > 0:
                self.rebuild.go_away(client)
            else:
                self._client_gone(client, False)
            # -1: forgotten (nothing in flight kept)
            client = ck_ids_find(&self.client_ids, self._data(0), self._size(0))
        if client < 0 and roles_of(&self.roles, self._data(0), self._size(0)) == ROLE_ENGINE:
            self._malformed(-1, None, HEADER_CONNECT, "an engine sent CONNECT")
            return
        if client >= 0:
            if self.clients[client].present:
                self.counters[COUNTER_DUPLICATE_CONNECT] += 1
            else:  # known from an engine's report only, or away: this is its connection
                self._connection_events()  # as for a new client: what the monitor said first
                self.clients[client].fd = fd
                self.rebuild.returned(client)
            index = client
            self._seen(client)
        else:
            # What the monitor said first: a connection that ended on this CONNECT's fd
            # before this one opened is not to be taken for this one's end.
            self._connection_events()
            index = self._vacant_client()
            if index < 0:
                self.counters[COUNTER_TABLE_FULL] += 1
                self.refused[ERROR_BUSY] += 1
                if hello.coordkit:
                    self.counters[COUNTER_ERRORS_SENT] += 1
                    text = error_text(ERROR_BUSY, HEADER_CONNECT)
                    self._reply_to_sender(protocol.ERROR.pack(None, ERROR_BUSY, text))
                return
            self.clients[index].used = True
            self.clients[index].inflight = 0
            self.clients[index].tenant = -1
            ends_init(&self.clients[index].requests)
            list_push(&self.idle_links, &self.idle, index)
            self.clients[index].fd = fd
            ck_ids_insert(&self.client_ids, index, self._data(0), self._size(0))
            self.n_clients += 1
        self.clients[index].coordkit = hello.coordkit
        self.clients[index].batch = hello.batch
        self.clients[index].rebuild = hello.rebuild
        self.clients[index].hold = hello.hold
        self.clients[index].qos = hello.qos
        tenant = self._tenant(hello.tenant)  # the one it names now (None: its own)
        if self.clients[index].tenant >= 0:
            queue_leave(&self.queue, self.clients[index].tenant)
        self.clients[index].tenant = tenant
        self.clients[index].present = self.clients[index].fresh = True
        self.clients[index].rejoined = False  # until its REJOIN, the requests adopted wait
        self.clients[index].format = FORMAT_MULTIPART
        if self.megatron_core and not hello.coordkit:
            self.clients[index].format = (
                FORMAT_SINGLE_FRAME_MAIN if self.pr6675 else FORMAT_SINGLE_FRAME
            )
        features = {BATCH_FEATURE: 1} if hello.batch else {}
        if hello.qos:
            features[QOS_FEATURE] = 1
        if hello.rebuild:
            features.update({REBUILD_FEATURE: 1, EPOCH_KEY: self.epoch})
        if features:
            self._reply_to_sender(protocol.CONNECT_ACK_BATCH.pack(features))
        else:
            self._reply_to_sender(protocol.CONNECT_ACK.pack())
        fd = self.clients[index].fd
        if fd >= 0:
            if fd in self.connections:
                self.connections[fd] = index
            else:  # the monitor said its connection ended already
                self._end(self._identity(index), fd)

    cdef int32_t _tenant(self, str name):
        """The queue's tenant named ``name`` (None: a new one of its own)."""
        cdef bytes encoded
        if name is None:
            return queue_tenant(&self.queue, NULL, 0)
        encoded = name.encode()
        return queue_tenant(&self.queue, encoded, len(encoded))

    cdef int32_t _vacant_client(self) except -2:
        """A free client index; when all are used, the client idle longest gives up
        its own; -1 when none is idle."""
        cdef int32_t index
        if self.vacant.newest == UINT32_MAX and self.clients_used < <uint32_t>self.max_clients:
            self.clients_used += 1
            return self.clients_used - 1
        if self.vacant.newest == UINT32_MAX:
            if self.idle.oldest == UINT32_MAX:
                return -1
            self._remove_client(self.idle.oldest)
        index = self.vacant.newest
        list_remove(&self.idle_links, &self.vacant, index)
        return index

    cdef _remove_client(self, int32_t client):
        """A client with nothing in flight leaves the tables (its identity stays a
        client's)."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(&self.client_ids, client, &n)
        roles_remember(&self.roles, identity, n, ROLE_CLIENT)
        if self.clients[client].tenant >= 0:
            queue_leave(&self.queue, self.clients[client].tenant)
            self.clients[client].tenant = -1
        self.rebuild.away.pop(self._identity(client), None)
        self.rebuild.n_away = len(self.rebuild.away)
        ck_ids_remove(&self.client_ids, client)
        self.tally.submitted[client] = 0
        self.clients[client].used = False
        self.n_clients -= 1
        list_remove(&self.idle_links, &self.idle, client)
        list_push(&self.idle_links, &self.vacant, client)
        fd = self.clients[client].fd
        if self.connections.get(fd, -1) == client:
            self.connections[fd] = -1

    cdef _connection_events(self):
        """The ROUTER's monitor: connections opened and ended (a client whose connection
        ended has left: nothing can reach its routing id again), handshakes refused."""
        cdef int32_t client
        cdef int rank
        for event, value in monitor_events(self._monitor_socket):
            if event == zmq.EVENT_ACCEPTED:
                self.connections[value] = -1
            elif event == zmq.EVENT_DISCONNECTED:
                client = self.connections.pop(value, -1)
                rank = self.engine_fds.pop(value, -1)
                if client >= 0:
                    self._end(self._identity(client), value)
                elif rank >= 0:
                    self._end(self._engine_identity(rank), value)
            elif event & REFUSAL_EVENTS:
                self.counters[COUNTER_AUTH_REFUSED] += 1

    cdef _end(self, bytes identity, int fd):
        """A peer's connection ended: dealt with once what it sent before is handled."""
        self.ended.append((identity, fd))
        self.n_ended = len(self.ended)

    cdef bytes _identity(self, int32_t client):
        """A client's routing id."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(&self.client_ids, client, &n)
        return identity[:n]

    cdef bytes _engine_identity(self, int rank):
        """An engine's routing id."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(&self.engine_ids, rank, &n)
        return identity[:n]

    cdef _drop_ended(self):
        """Forget the clients whose connection ended (those still known by that routing
        id on that connection), and abort their requests; an engine whose connection
        ended is lost (Faults.lost: away for the grace, or gone)."""
        cdef int32_t client, rank
        cdef bytes identity
        ended, self.ended = self.ended, []
        self.n_ended = 0
        for identity, fd in ended:
            client = ck_ids_find(&self.client_ids, <const uint8_t*><const char*>identity,
                                 len(identity))
            rank = ck_ids_find(&self.engine_ids, <const uint8_t*><const char*>identity,
                               len(identity))
            if client >= 0 and self.clients[client].fd == fd:
                self._client_gone(client, False)
            elif rank >= 0 and self.engines[rank].fd == fd and (
                self.engines[rank].state != ENGINE_GONE
            ):
                self.faults.lost(rank, GONE_DISCONNECTED)
        if self.n_gone:
            self._settle()

    cdef _goodbye(self, int32_t client):
        """DISCONNECT from a client: it closes; forget it and abort what it left."""
        if self._parse(protocol.DISCONNECT, client, HEADER_DISCONNECT) is not None:
            self._client_gone(client, False, True)

    cdef _heartbeat(self, int32_t engine):
        message = self._parse(protocol.HEARTBEAT, -1, HEADER_HEARTBEAT)
        if message is None:
            return
        if self.engines[engine].state != ENGINE_GONE:
            self.engines[engine].heartbeats = True
            self.engines[engine].last_heartbeat = monotonic()
            tally_heartbeat(&self.tally, engine, message.pending, message.capacity)

    cdef _disconnect(self, int32_t engine):
        """DISCONNECT: no new work; its requests in flight may finish, for a while."""
        if self._parse(protocol.DISCONNECT, -1, HEADER_DISCONNECT) is None:
            return
        if self.engines[engine].state != ENGINE_ALIVE:
            return
        if self.pd is not None and self.pd.seats[engine].seated:
            # a role engine leaves as #6675's do: its hops go on elsewhere now
            self._mark_gone(engine, GONE_DISCONNECTED)
            return
        self.router.remove_rank(engine)
        self.engines[engine].state = ENGINE_DRAINING
        self.engines[engine].drain_deadline = monotonic() + self.drain_timeout
        if self.router.pending(engine) == 0:
            self.engines[engine].state = ENGINE_GONE

    cdef _abort(self, int32_t client):
        """ABORT_REQUEST: on to the owning engine, once, with the server id."""
        cdef int64_t slot
        cdef ck_request* request
        message = self._parse(protocol.ABORT_REQUEST, client, HEADER_ABORT_REQUEST)
        if message is None:
            return
        slot = ck_requests_find_client(&self.requests, client, message.rid)
        if slot < 0 and (self._identity(client), message.rid) in self.rebuild.awaiting:
            # REJOINed, no engine claimed it yet: aborted when one does (_held), else
            # ended at the window's end, never sent again (_end_rebuild)
            self.counters[COUNTER_ABORTS] += 1
            self.rebuild.aborting.add((self._identity(client), message.rid))
            return
        if slot < 0:
            self._refuse(
                client,
                message.rid,
                ERROR_UNKNOWN_REQUEST,
                HEADER_ABORT_REQUEST,
                COUNTER_UNKNOWN_REQUEST,
            )
            return
        self.counters[COUNTER_ABORTS] += 1
        request = &self.requests.pool[slot]
        if request.rank < 0 and (self.pd is None or not self.pd.hops[slot].stage):
            self._forget(slot)  # it waits: it ends here, no engine has it
            self.failed[ERROR_ABORTED] += 1
            if not self._send_error(client, message.rid, ERROR_ABORTED,
                                    HEADER_ABORT_REQUEST, True, never_ran(message.rid)):
                self._client_gone(client)
            return
        if request.flags & FLAG_ABORTED:
            return
        request.flags |= FLAG_ABORTED
        if self.pd is not None and self.pd.hops[slot].stage:
            self.pd.abort(<uint32_t>slot)  # at the hop holding it, or ended waiting for one
            return
        self._abort_at_engine(request.rank, request.server_rid)

    cdef _abort_at_engine(self, int rank, int64_t server_rid):
        """ABORT_REQUEST to an engine; a 0.19 engine has none: the request runs to its end."""
        if not engine_parses(self.engines[rank].format, HEADER_ABORT_REQUEST):
            return
        abort = protocol.ABORT_REQUEST.pack(server_rid)
        if not self._send_frames(&self.engine_ids, rank, abort):
            self.faults.lost(rank, GONE_UNREACHABLE)

    cdef _release_kv(self, int32_t client):
        message = self._parse(protocol.RELEASE_KV, client, HEADER_RELEASE_KV)
        if message is None:
            return
        self.counters[COUNTER_RELEASE_KV] += 1
        if self.pd is not None:  # its own requests' pins, at their prefill only
            self.pd.client_release(client, message.rid)
        else:
            self._broadcast(HEADER_RELEASE_KV)

    cdef _control(self, int32_t client, int64_t header):
        """A control signal: through the state machine, then to every engine."""
        if self._parse(protocol.CONTROL[header], client, header) is None:
            return
        state = CONTROL_TRANSITIONS.get((self.control_state, header))
        if state is None:
            self._refuse(client, None, ERROR_INVALID_STATE, header, COUNTER_INVALID_CONTROL)
            return
        self.counters[COUNTER_CONTROL] += 1
        self.control_state = state
        self._broadcast(header)

    cdef _shutdown_signal(self, int32_t client):
        if self._parse(protocol.SHUTDOWN, client, HEADER_SHUTDOWN) is not None:
            self.stopping = True

    cdef _stats_request(self, int32_t client):
        """STATS: stats(), and with {"metrics": 1} metrics() in it too, to a coordkit client."""
        message = self._parse(protocol.STATS, client, HEADER_STATS)
        if message is not None and self.clients[client].coordkit:
            stats = self.stats()
            if asks_metrics(message.asked):
                stats["metrics"] = self.metrics()
            self._send_frames(&self.client_ids, client, protocol.STATS_REPLY.pack(packb(stats)))

    cdef object _parse(self, object spec, int32_t client, int64_t header):
        """The message parsed by ``spec``, or None after handling it as malformed."""
        try:
            return spec.parse(self._frames())
        except ProtocolError as exc:
            self._malformed(client, exc.rid, header, str(exc))
            return None

    cdef _broadcast(self, int64_t header):
        """The metadata frame as it came (refcounted copies) to every engine not gone."""
        cdef int rank
        for rank in range(self.n_engines):
            if self.engines[rank].state == ENGINE_GONE:
                continue
            if not engine_parses(self.engines[rank].format, header):
                continue  # 0.19 has no KV transfer
            if self._send_identity(&self.engine_ids, rank) != 0:
                self.faults.lost(rank, GONE_UNREACHABLE)
            else:
                traffic_count(&self.traffic, SENT, header, self._size(1))
                send_shared(self.sock, &self.message.parts[1], 0)

    cdef _replace(self, int part, bytes body):
        """Replace a reply body frame by ``body`` (detokenized, or continuing a stream)."""
        zmq_msg_close(&self.message.parts[part])
        zmq_msg_init_size(&self.message.parts[part], len(body))
        memcpy(zmq_msg_data(&self.message.parts[part]), <const char*>body, len(body))

    cdef const uint8_t* _held_body(self, bytes body, size_t* size):
        """A frame made on the way (a reply body detokenized or continuing a stream, a
        prefill hop's params), its size in ``size``, alive until the batches are sent
        (in held_bodies)."""
        self.held_bodies.append(body)
        self.holds_bodies = True
        size[0] = len(body)
        return <const uint8_t*><const char*>body

    cdef bytes _detokenized(self, const uint8_t* body, size_t size):
        """A reply body with its generated_text; on failure the body as it is."""
        cdef bytes original = (<const char*>body)[:size]
        try:
            result = detokenize(self._detokenizer, original)
        except Exception as exc:  # a bad body or a failing detokenizer
            self.counters[COUNTER_DETOKENIZE_ERRORS] += 1
            self._log.warn("detokenize", f"detokenize failed, body forwarded as is: {exc!r}")
            return original
        self.counters[COUNTER_DETOKENIZED] += 1
        return result

    # -- failures ------------------------------------------------------------------------

    cdef _settle(self):
        """Re-send or fail the requests of the engines found gone, oldest first.

        Settling one engine may find others gone (a re-send that cannot reach
        its engine): they join the queue, so the work stays a loop, not a recursion.
        """
        cdef int i = 0
        while i < self.n_gone:
            self._settle_engine(self.gone[i])
            i += 1
        self.n_gone = 0

    cdef _settle_engine(self, int rank):
        """Each request of a gone engine, by server id, lost there (_unrun)."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        reason = GONE_REASONS[self.engines[rank].last_failure]
        self._log.warn("engine_failed", f"engine {rank} gone ({reason})")
        if self.pd is not None:
            self.pd.engine_gone(rank)  # its P/D requests go on elsewhere, or end
        if self.kv_events is not None and self.engines[rank].state == ENGINE_GONE:
            self.kv_events.unannounce(rank)  # the publisher it announced goes too (not back)
        resend = {}
        order = self._in_order(rank, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                if self.requests.pool[slot].server_rid != order[i].server_rid or (
                    self.requests.pool[slot].rank != rank
                ):
                    continue  # ended meanwhile: its client went away
                self._unrun(slot, resend)
        finally:
            free(order)
        self.rebuild.send_resends(resend)

    cdef _unrun(self, uint32_t slot, dict resend):
        """A request its engine will never answer (it died, or does not hold it): re-sent
        from what was kept when it produced nothing (a rebuild client's: RESEND), moved on
        with the tokens it streamed when it did (Faults.migrate), otherwise ended with
        ERROR(ENGINE_FAILED)."""
        cdef ck_request* request = &self.requests.pool[slot]
        cdef int32_t client = request.client
        cdef int status
        cdef int counter = COUNTER_REROUTED
        tally_failed(&self.tally, request.rank)  # whatever comes of it, that engine lost it
        self.router.release_c(request.rank, self.work[slot])
        request.rank = -1
        request.flags &= ~FLAG_UNCONFIRMED
        if request.flags & (FLAG_ABORTED | FLAG_PINNED) or (
            request.kept == NULL and not self.clients[client].rebuild
        ):
            self._fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
            return
        if request.flags & FLAG_PRODUCED:
            status = self.faults.migrate(slot)
            if status < 0:  # it cannot go on elsewhere
                self._fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
                return
            counter = COUNTER_MIGRATED
        elif request.kept == NULL:  # a rebuild client sends it again itself
            resend.setdefault(client, []).append(request.client_rid)
            if self.traces.on:
                self.traces.drop(slot)
            self._forget(slot)
            return
        else:
            status = self._resend(slot)
        if status == ROUTE_ALL_BUSY and self.queue.limit and self._queued(slot, NULL, True):
            return  # it waits at the head, sent from what it kept (moved on: its tokens)
        if status == ROUTE_SENT:
            self.counters[counter] += 1
        elif status == ROUTE_UNSENDABLE:  # no engine left that speaks its format
            self._fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
        else:
            self._fail_request(slot, refusal(status), HEADER_SUBMIT_REQUEST)

    cdef int _resend(self, uint32_t slot) noexcept nogil:
        """Send a request whose engine died to another, from what it kept, as a new
        request is sent (_route); a RouteStatus."""
        cdef Inbound inbound
        cdef zmq_msg_t messages[2]
        cdef int status = ROUTE_ENGINE_GONE
        kept_inbound(<Kept*>self.requests.pool[slot].kept, &inbound, messages,
                     self.n_multipart_engines, self.n_single_engines)
        carriers(&inbound, self.n_single_engines + self.n_main_engines > 0)
        while status == ROUTE_ENGINE_GONE:  # that one waits in the queue of gone engines
            status = self._route(slot, &inbound)
        zmq_msg_close(&messages[0])
        zmq_msg_close(&messages[1])
        return status

    cdef RequestOrder* _in_order(self, int rank, int32_t client, uint32_t* count) except NULL:
        """The requests in flight (of ``rank`` / ``client`` when >= 0) by server id;
        the caller frees the array."""
        cdef RequestOrder* order = <RequestOrder*>malloc(
            (self.requests.live + 1) * sizeof(RequestOrder)
        )
        cdef ck_request* request
        cdef uint32_t slot, n = 0
        if order == NULL:
            raise MemoryError()
        if client >= 0:  # its own list
            slot = self.clients[client].requests.oldest
            while slot != UINT32_MAX:
                order[n].server_rid = self.requests.pool[slot].server_rid
                order[n].slot = slot
                n += 1
                slot = self.client_links.newer[slot]
        else:
            for slot in range(self.requests.used):
                request = &self.requests.pool[slot]
                if request.server_rid < 0 or (rank >= 0 and request.rank != rank):
                    continue
                order[n].server_rid = request.server_rid
                order[n].slot = slot
                n += 1
        qsort(order, n, sizeof(RequestOrder), compare_server_rids)
        count[0] = n
        return order

    cdef _fail_request(self, uint32_t slot, int code, int64_t header):
        """End the request at ``slot`` with ERROR(code): its one terminal reply."""
        cdef int32_t client = self.requests.pool[slot].client
        rid = self.requests.pool[slot].client_rid
        tally_failed(&self.tally, self.requests.pool[slot].rank)
        if self.traces.on:
            self.traces.fail(slot, code)
        self._forget(slot)
        self.failed[code] += 1
        if code == ERROR_ENGINE_FAILED:
            self.counters[COUNTER_ENGINE_FAILED] += 1
        if not self._send_error(client, rid, code, header, True):
            self._client_gone(client)

    cdef _time_out(self, uint32_t slot):
        """End a request in flight longer than request_timeout: ERROR(TIMED_OUT) to
        its client, ABORT to its engine (whose late final is then unknown, dropped); one
        that waits leaves the queue; a P/D request's hops are its room's."""
        cdef ck_request* request = &self.requests.pool[slot]
        cdef int rank = request.rank
        self.counters[COUNTER_TIMED_OUT] += 1
        if self.pd is not None and self.pd.hops[slot].stage:
            self.pd.time_out(slot)
            return
        if rank < 0:
            self._unqueue(slot, OUTCOME_TIMED_OUT)
        elif not request.flags & FLAG_ABORTED and self.engines[rank].state != ENGINE_GONE:
            self._abort_at_engine(rank, request.server_rid)
        self._fail_request(slot, ERROR_TIMED_OUT, HEADER_SUBMIT_REQUEST)

    cdef _no_engines_left(self):
        """The waiting requests, with no engine left to wait for: ERROR(NO_ENGINES)."""
        cdef uint32_t i, n
        cdef uint32_t slot
        cdef RequestOrder* order = self._in_order(-1, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                if (
                    self.requests.pool[slot].server_rid == order[i].server_rid
                    and self.requests.pool[slot].rank < 0 and queue_holds(&self.queue, slot)
                ):
                    self._unqueue(slot, OUTCOME_REFUSED)
                    self._fail_request(slot, ERROR_NO_ENGINES, HEADER_SUBMIT_REQUEST)
        finally:
            free(order)

    cdef _reject_entry(self, int32_t engine, object rid, int code, int64_t header):
        """An entry of an engine's batch that was not delivered: malformed ones are
        counted and logged, and a coordkit engine is told with an ERROR."""
        if code == ERROR_MALFORMED:
            self.counters[COUNTER_MALFORMED_ENTRIES] += 1
            self.tally.engines[engine].malformed_entries += 1
            what = f"malformed entry in {header_name(header)} from engine {engine}"
            self._log.warn("malformed", what)
        if self.engines[engine].coordkit:
            error = protocol.ERROR.pack(rid, code, error_text(code, header))
            if not self._send_frames(&self.engine_ids, engine, error):
                self.faults.lost(engine, GONE_UNREACHABLE)

    cdef _client_gone(self, int32_t client, bint unreachable=True, bint closed=False):
        """A client that cannot be reached, or that left (DISCONNECT: ``closed``, or its
        connection ended): its requests are aborted at their engines and forgotten, and
        so is the client; but a rebuild client with a hold that did not close may come
        back (a blip): it is only away (_go_away)."""
        if not self.clients[client].used:
            return
        self.counters[COUNTER_CLIENTS_DEPARTED] += 1
        if unreachable:
            self.counters[COUNTER_CLIENT_GONE] += 1
        if self.clients[client].present and self.clients[client].hold > 0 and not closed:
            self.rebuild.go_away(client)
        else:
            self._drop_client(client)

    cdef _drop_client(self, int32_t client):
        """Abort a client's requests at their engines, and forget them and it."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        cdef ck_request* request
        cdef int rank
        cdef bint aborted
        order = self._in_order(-1, client, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                request = &self.requests.pool[slot]
                if request.server_rid != order[i].server_rid:
                    continue
                rank = request.rank
                aborted = request.flags & FLAG_ABORTED
                self._forget(slot)
                if aborted or rank < 0 or self.engines[rank].state == ENGINE_GONE:
                    continue
                self._abort_at_engine(rank, order[i].server_rid)
        finally:
            free(order)
        self._remove_client(client)

    # -- answers and malformed input ------------------------------------------------------

    cdef list _frames(self):
        """The current message's frames after the routing id, as bytes."""
        return [self._frame_bytes(part) for part in range(1, self.message.n_parts)]

    cdef bytes _frame_bytes(self, int part):
        return (<const char*>self._data(part))[:self._size(part)]

    cdef bint _send_frames(self, ck_ids* table, int32_t index, list frames):
        """Send ``frames`` (bytes) to a peer; False when it is gone."""
        cdef bytes frame
        cdef Py_ssize_t i, last = len(frames) - 1
        if self._send_identity(table, index) != 0:
            return False
        self._count_frames_out(frames)
        for i in range(last + 1):
            frame = frames[i]
            send_bytes(self.sock, <const char*>frame, len(frame), ZMQ_SNDMORE if i < last else 0)
        return True

    cdef _reply_to_sender(self, list frames):
        """Send ``frames`` to the sender of the current message, in no table perhaps."""
        cdef bytes frame
        cdef Py_ssize_t i, last = len(frames) - 1
        if send_bytes(self.sock, self._data(0), self._size(0), ZMQ_SNDMORE) != 0:
            return
        self._count_frames_out(frames)
        for i in range(last + 1):
            frame = frames[i]
            send_bytes(self.sock, <const char*>frame, len(frame), ZMQ_SNDMORE if i < last else 0)

    cdef _count_frames_out(self, list frames):
        cdef bytes first = frames[0]
        cdef int64_t header
        cdef uint32_t length
        cdef size_t end, size = 0
        if ck_read_header(<const uint8_t*><const char*>first, len(first), &header, &length, &end):
            header = -1
        for frame in frames:
            size += len(<bytes>frame)
        traffic_count(&self.traffic, SENT, header, size)

    cdef bint _send_error(self, int32_t client, object rid, int code, int64_t header,
                          bint ends=False, str text=None):
        """ERROR to a coordkit client (its text ``text``, else error_text's); to a
        Megatron main client, when the error ends a request of its (``ends``), the
        FAILED final it takes (0.19's clients get nothing). False when the client is
        gone."""
        cdef bint coordkit = self.clients[client].coordkit
        if not self.clients[client].present or (
            not coordkit and not (ends and self.clients[client].format == FORMAT_SINGLE_FRAME_MAIN)
        ):
            return True  # away, its REJOIN then finds it ended; or it takes no ERROR
        self.counters[COUNTER_ERRORS_SENT] += 1
        text = error_text(code, header) if text is None else text
        if self.pr6675 and not coordkit:  # #6675's client: its REQUEST_ERROR
            error = protocol.REQUEST_ERROR.pack(rid, text, True)
            return self._send_frames(&self.client_ids, client, error)
        if not coordkit:
            self._log.warn("failed_final", f"a Megatron main client's request {rid} failed: {text}")
            return self._send_frames(&self.client_ids, client, [megatron_failed_reply(rid)])
        error = protocol.ERROR.pack(rid, code, text)
        return self._send_frames(&self.client_ids, client, error)

    cdef _refuse(self, int32_t client, object rid, int code, int64_t header, int counter,
                 bint ends=False):
        """Count a refused message and answer its client with ERROR(code); ``ends``:
        it was a request that parsed (see _send_error)."""
        self.counters[counter] += 1
        self.refused[code] += 1
        if not self._send_error(client, rid, code, header, ends):
            self._client_gone(client)

    cdef _malformed(self, int32_t client, object rid, int64_t header, str detail):
        """A message that does not parse: counted, logged (rate-limited), and
        answered when its sender is a client (``client`` >= 0)."""
        self._log.warn(
            "malformed", f"malformed {header_name(header)} from {self._frame_bytes(0)!r}: {detail}"
        )
        if client < 0:
            self.counters[COUNTER_MALFORMED] += 1
        else:
            self._refuse(client, rid, ERROR_MALFORMED, header, COUNTER_MALFORMED)

    cdef _malformed_batch(self, int32_t client, uint32_t count, str detail):
        """A SUBMIT_BATCH whose entries cannot all go on: no prompt can be told from
        another, so each of the ``count`` requests named ends here; when none is,
        one ERROR without an id says so."""
        cdef uint32_t i
        if count == 0:
            self._malformed(client, None, HEADER_SUBMIT_BATCH, detail)
        for i in range(count):
            if not self.clients[client].used:
                return  # found gone meanwhile
            self._malformed(
                client, self.message.batch_entries[i].rid, HEADER_SUBMIT_BATCH, detail
            )
