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
from .includes.handoff cimport (
    CK_HANDOFF_OK,
    ck_handoff,
    ck_pd_handoff,
    ck_pd_may_refuse,
    ck_pd_restore,
)
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
    decode_slots,
    handoff_of,
    prompt_tokens_of,
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
include "loop/answers.pyx"
include "loop/control.pyx"
include "loop/peers.pyx"
include "loop/refusals.pyx"
include "loop/report.pyx"
include "loop/timers.pyx"
include "loop/pd.pyx"
include "loop/pdmessages.pyx"
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
        self.answers = Answers(self)
        self.control = Control(self)
        self.peers = Peers(self)
        self.refusals = Refusals(self)
        self.report = Report(self)
        self.timers = Timers(self)
        self.pd = None
        self.pr6675 = options.megatron_version == "pr6675"
        self._options = options
        self.traces = Traces(self, options)
        self.kv_events = options.kv_events
        if self.kv_events is not None:
            self.kv = KVIndex(self.max_engines)
            router.attach_kv(self.kv)
            self.kv_events.attach(self.kv)
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
        self.refusals.shut_down()

    def stats(self) -> dict:
        return self.report.stats()

    def metrics(self) -> dict:
        return self.report.metrics()

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
                self.timers.tick(now)
            if fds[2].revents:
                with gil:
                    self.peers.connection_events()
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
                    self.peers.drop_ended()
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
            # stop() sends an empty frame; the KV events' thread, a byte (STATE records wait).
            if zmq_msg_size(&wake):
                self.kv_due = True
            else:
                woken = True
            zmq_msg_close(&wake)

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
                    self.faults.settle()
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
                self.peers.register(engine)
            return
        client = ck_ids_find(&self.client_ids, identity, identity_size)
        if self.message.oversized or ck_read_header(
            self._data(1), self._size(1), &header, &length, &end
        ) != CK_OK:
            traffic_count(&self.traffic, RECEIVED, -1, message_bytes(&self.message))
            with gil:
                self.refusals.malformed(client, None, -1, "malformed metadata frame")
            return
        traffic_count(&self.traffic, RECEIVED, header, message_bytes(&self.message))
        if engine >= 0:
            self._from_engine(engine, header)
            if self.measure_latency:
                latency_handled(&self.latency, STAGE_REPLY, header)
        elif header == HEADER_CONNECT:
            with gil:
                self.peers.connect(client)
        elif header == HEADER_ENGINE_HELLO and client < 0:
            with gil:
                self.peers.engine_hello(-1)
        elif header == HEADER_REGISTER_ROLE and client < 0:
            with gil:
                self.peers.register_role(-1)
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
                self.control.from_client(client, header)

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
                self.refusals.malformed(client, submit.rid if submit.offset else None, header,
                                        ck_strstatus(read).decode())
            return
        if submit.length != <uint32_t>(2 + n_payload):  # QoS, from a client granted it
            if submit.length != <uint32_t>(4 + n_payload) or not self.clients[client].qos:
                with gil:
                    self.refusals.malformed(client, submit.rid, header, "bad frame layout")
                return
            # The QoS fields come off here: the params span starts after them.
            read = ck_read_qos(self._data(1), self._size(1), &submit, &qos)
            if read != CK_OK:
                with gil:
                    self.refusals.malformed(client, submit.rid, header, ck_strstatus(read).decode())
                return
        if (
            not n_payload <= n_frames <= n_payload + 1
            or (hashed and self._size(2 + n_payload) % BLOCK_HASH_SIZE)
        ):
            with gil:
                self.refusals.malformed(client, submit.rid, header, "bad frame layout")
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
                self.refusals.malformed(client, single.rid, header, "bad frame layout")
            return
        if read == CK_OK and single.length > 4:
            self.clients[client].format = FORMAT_SINGLE_FRAME_MAIN
        if read == CK_OK and (
            hashes or single_walks(single.length, self.n_multipart_engines, self.n_single_engines)
        ):
            read = ck_read_single_submit(frame, size, &single)
        if read != CK_OK:
            with gil:
                self.refusals.malformed(client, single.rid if single.prompt else None, header,
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
                self.refusals.malformed(client, None, HEADER_SUBMIT_BATCH, "batches not granted")
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
                self.refusals.malformed_batch(client, count, ck_strstatus(read).decode())
            return
        for i in range(count):
            needed += 1 + self.message.batch_entries[i].flag
        if needed != <size_t>(self.message.n_parts - 2):
            with gil:
                self.refusals.malformed_batch(client, count, "bad frame layout")
            return
        for i in range(count):
            if not self.clients[client].used:
                break  # found gone meanwhile
            entry = &self.message.batch_entries[i]
            if entry.flag and self._size(part + 1) % BLOCK_HASH_SIZE:
                with gil:
                    self.refusals.malformed(
                        client, entry.rid, HEADER_SUBMIT_BATCH, "bad frame layout"
                    )
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
                self.refusals.refuse(
                    client, rid, ERROR_DUPLICATE_REQUEST, header, COUNTER_DUPLICATE_REQUEST
                )
            return
        if self.requests.live >= self.max_inflight:
            with gil:
                self.refusals.refuse(client, rid, ERROR_BUSY, header, COUNTER_BUSY)
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
            self.refusals.refuse(
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
                self.faults.settle()
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
                    self.peers.client_gone(to)
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
                self.control.from_engine(engine, header)

    cdef void _forward_replies(self, int32_t engine) noexcept nogil:
        """Each entry of an engine's batch to its request's client, the body as itself;
        those bound for batched clients leave as one REPLY_BATCH per client. A final to
        a client with a hold is forgotten only once sent: one whose client is found
        gone by its send waits, with the client's other requests, for its REJOIN."""
        cdef int64_t header, slot, client_rid
        cdef uint32_t count, i
        cdef uint32_t deferred = 0  # finals to clients with a hold (Rebuild.sent_finals)
        cdef int32_t client
        cdef bint final
        cdef double now = 0.0
        cdef ck_entry* entries
        # Room for the entries bound for batched clients: each tail a final flag.
        if message_read_replies(&self.message, &header, &count) != CK_OK or not fanout_reserve(
            &self.fanout, count, count
        ):
            with gil:
                self.refusals.malformed(-1, None, -1, "bad ENGINE_REPLY metadata")
            return
        if count != <uint32_t>(self.message.n_parts - 2):
            with gil:
                self.refusals.malformed(
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
                    self.refusals.reject_entry(engine, None, ERROR_MALFORMED, header)
                continue
            slot = ck_requests_find(&self.requests, entries[i].rid)
            if slot < 0 or self.requests.pool[slot].rank != engine:
                # A late reply (its request ended: aborted, timed out, its client
                # gone), or a reply the engine got wrong.
                self.counters[COUNTER_UNKNOWN_REQUEST] += 1
                self.tally.engines[engine].unknown_request += 1
                if self.engines[engine].coordkit:
                    with gil:
                        self.refusals.reject_entry(
                            engine, entries[i].rid, ERROR_UNKNOWN_REQUEST, header
                        )
                continue
            if self.requests.pool[slot].flags & FLAG_REPLAYING:
                continue  # the engine's REPLAYED brings it again, in its place
            if not final and self.faults.streamed[slot].known:  # it may have to go on
                self.faults.stream(<uint32_t>slot, self._data(2 + i), self._size(2 + i))
            if self.requests.pool[slot].flags & FLAG_MIGRATED:  # it continues a stream
                with gil:
                    self.answers.replace(2 + i, self.faults.continued(
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
                    self.answers.replace(
                        2 + i, self.answers.detokenized(self._data(2 + i), self._size(2 + i))
                    )
            if self.clients[client].batch:
                fanout_add(&self.fanout, client, client_rid,
                           <const uint8_t*>MSGPACK_BOOLS + final, 1,
                           &self.message.parts[2 + i], NULL, 0)
            elif not self._deliver(
                client, header, client_rid, NULL, 0, &self.message.parts[2 + i]
            ):
                with gil:
                    self.peers.client_gone(client)
        self._send_batches(HEADER_REPLY_BATCH)
        if deferred:
            self.rebuild.sent_finals(engine, count, now)

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
                self.refusals.malformed(
                    -1, None, HEADER_ENGINE_REPLY, "bad single-frame ENGINE_REPLY"
                )
            return
        final = header == HEADER_ENGINE_REPLY
        if self.measure_latency:
            now = monotonic()
        for i in range(count):
            entry = &self.message.single_entries[i]
            if entry.status != CK_OK:
                with gil:
                    self.refusals.reject_entry(engine, None, ERROR_MALFORMED, header)
                continue
            slot = ck_requests_find(&self.requests, entry.rid)
            if slot < 0 or self.requests.pool[slot].rank != engine:
                self.counters[COUNTER_UNKNOWN_REQUEST] += 1
                self.tally.engines[engine].unknown_request += 1
                if self.pd is not None:
                    with gil:
                        self.pd.messages.stray_reply(engine, entry.rid)
                continue
            client = self.requests.pool[slot].client
            client_rid = self.requests.pool[slot].client_rid
            body = self._data(1) + entry.offset
            size = entry.size
            if self.pd is not None and self.pd.hops[slot].stage == PD_STAGE_PREFILL:
                with gil:  # hop 1's answer
                    self.pd.messages.prefilled(<uint32_t>slot, engine, body, size)
                continue
            if not final and self.faults.streamed[slot].known:  # it may have to go on
                self.faults.stream(<uint32_t>slot, body, size)
            if self.requests.pool[slot].flags & FLAG_MIGRATED:  # it continues a stream
                with gil:
                    body = self.answers.held_body(
                        self.faults.continued(entry.rid, body, size), &size
                    )
            self._finish(<uint32_t>slot, final, now)
            if final and self.has_detokenizer:  # as Megatron's coordinator: every final
                with gil:
                    body = self.answers.held_body(self.answers.detokenized(body, size), &size)
            if self.clients[client].batch:
                fanout_add(&self.fanout, client, client_rid,
                           <const uint8_t*>MSGPACK_BOOLS + final, 1, NULL, body, size)
            elif not self._deliver(client, header, client_rid, body, size, NULL):
                with gil:
                    self.peers.client_gone(client)
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
                status = self.faults.resend(slot)
                counter, code = COUNTER_REROUTED, ERROR_ENGINE_FAILED
            if status == ROUTE_SENT:
                self.counters[counter] += 1
            elif status != ROUTE_ENGINE_GONE:  # ENGINE_GONE: its client went away
                with gil:
                    self.refusals.fail_request(
                        slot, code if status == ROUTE_UNSENDABLE else refusal(status),
                        HEADER_SUBMIT_REQUEST,
                    )
        self._send_batches(HEADER_SUBMIT_BATCH)
        queue_sent(&self.queue)  # now what they held may go
        if self.queue.depth and self.router.n_members == 0:
            with gil:
                self.refusals.no_engines_left()

    cdef inline void _seen(self, int32_t client) noexcept nogil:
        """A message from ``client``: with nothing in flight, it is the idle one seen last."""
        if self.clients[client].inflight == 0:
            list_remove(&self.idle_links, &self.idle, client)
            list_push(&self.idle_links, &self.idle, client)

    cdef int _send_identity(self, ck_ids* table, int32_t index) noexcept nogil:
        """Start a message to a peer; -1 when it is gone (ROUTER_MANDATORY)."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(table, index, &n)
        return send_bytes(self.sock, identity, n, ZMQ_SNDMORE)

    cdef inline const uint8_t* _data(self, int part) noexcept nogil:
        return message_data(&self.message, part)

    cdef inline size_t _size(self, int part) noexcept nogil:
        return message_size(&self.message, part)
