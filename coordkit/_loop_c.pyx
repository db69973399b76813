# cython: language_level=3, embedsignature=True
"""The Cython loop core: the coordinator's tables and message handlers over raw libzmq.

:class:`coordkit.Coordinator` owns the sockets, the thread and the timers and
drives this core, or its twin :mod:`coordkit._loop_py`, the reference: both
make the same decisions in the same order and put the same frames on the
wire. pyzmq creates the sockets; the core takes their raw handles and calls
the libzmq that pyzmq loaded (see _libzmq.h).

The hot path (a SUBMIT out to an engine; an engine's batch of replies out to
their clients) comes first in this file. It runs without the GIL and without
Python objects: frames are received into ``zmq_msg_t``, the metadata frame is
read and rewritten by the C codec, payload frames go on as the same messages,
and state lives in the C tables of _tables.h. The rare paths come after it
(peers joining and leaving, control signals, failures, malformed input): they
take the GIL and parse with the message specs of coordkit.protocol. An engine
found gone on the hot path is only marked; its requests are settled on a
rare path once the message at hand is done (docs/design.md, "Failure model").
"""

cimport cython
from libc.errno cimport EINTR
from libc.stdint cimport UINT32_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort, realloc
from libc.string cimport memcpy, memset
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from ._codec_c cimport (
    CK_BATCH_HEAD_MAX,
    CK_HEADER_INT_MAX,
    CK_INT_MAX,
    CK_OK,
    CK_TOO_MANY,
    ck_batch_entry,
    ck_check_map,
    ck_check_prompt,
    ck_entry,
    ck_prompt_hashes,
    ck_prompt_tokens,
    ck_read_batch_into,
    ck_read_header,
    ck_read_reply,
    ck_read_single_head,
    ck_read_single_reply,
    ck_read_single_submit,
    ck_read_submit,
    ck_single_entry,
    ck_single_submit,
    ck_single_submit_size,
    ck_strstatus,
    ck_submit,
    ck_submit_size,
    ck_write_batch_head,
    ck_write_header_int,
    ck_write_int,
    ck_write_single_submit,
    ck_write_submit,
)
from ._constants cimport *
from .includes.libzmq cimport (
    ZMQ_DONTWAIT,
    ZMQ_POLLIN,
    ZMQ_SNDMORE,
    bind_libzmq,
    zmq_errno,
    zmq_msg_close,
    zmq_msg_copy,
    zmq_msg_data,
    zmq_msg_init,
    zmq_msg_init_size,
    zmq_msg_more,
    zmq_msg_move,
    zmq_msg_recv,
    zmq_msg_send,
    zmq_msg_size,
    zmq_msg_t,
    zmq_poll,
    zmq_pollitem_t,
)
from ._routing_c cimport Router
from .includes.sysdep cimport DEBUG

from . import protocol
from ._shared import (
    LATENCY_BUCKETS,
    RateLimitedLog,
    check_constants,
    detokenize,
    metrics_map,
    stats_map,
)
from .protocol import (
    BATCH_FEATURE,
    CONTROL_TRANSITIONS,
    ProtocolError,
    error_text,
    header_name,
    packb,
    parse_connect,
    parse_engine_hello,
)

bind_libzmq()
check_constants(generated_constants())

__all__ = ["Loop"]

cdef enum:
    FIRST_PARTS = 64  # frames of a message before the buffer grows
    FIRST_ENTRIES = 64  # entries of a reply batch before the buffer grows

GONE_REASONS = ("unreachable", "no heartbeat", "drain timed out")  # by GoneReason

cdef enum:
    MSGPACK_FIXARRAY_2 = 0x92  # the head of a batch entry [rid, ...] of two
    MSGPACK_TRUE = 0xc3
    MSGPACK_FALSE = 0xc2


# -- sending ---------------------------------------------------------------------------

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


cdef bint reserve(void** buffer, size_t* capacity, size_t needed, size_t item) noexcept nogil:
    """Grow ``buffer`` to hold ``needed`` items of ``item`` bytes; False when memory is short."""
    cdef void* grown
    if needed <= capacity[0]:
        return True
    grown = realloc(buffer[0], needed * item)
    if grown == NULL:
        return False
    buffer[0] = grown
    capacity[0] = needed
    return True


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef size_t send_head(void* sock, int64_t header, uint32_t length, int64_t rid,
                      const uint8_t* rest, size_t rest_size, int flags) noexcept nogil:
    """``[header, rid, <rest>]`` (an array of ``length``) as one new frame; its size."""
    cdef ck_submit head
    cdef zmq_msg_t msg
    cdef size_t n
    head.header = header
    head.length = length
    n = ck_submit_size(&head, rid, rest_size)
    zmq_msg_init_size(&msg, n)
    ck_write_submit(<uint8_t*>zmq_msg_data(&msg), &head, rid, rest, rest_size)
    if zmq_msg_send(&msg, sock, flags) < 0:
        zmq_msg_close(&msg)
    return n


cdef size_t send_submit(void* sock, ck_buffer_pool* buffers, bint single_frame,
                        int64_t rid, const uint8_t* prompt, size_t prompt_size,
                        const uint8_t* params, size_t params_size) noexcept nogil:
    """A request from the bytes of its prompt and its params, in an engine's format:
    ``[20, rid, <prompt>, <params>]``, or ``[20, rid, <params>]`` and the prompt;
    the bytes sent. Both copy the prompt: a large one into a buffer of ``buffers``."""
    cdef zmq_msg_t msg
    cdef size_t n
    if not single_frame:
        ck_buffer_msg(buffers, &msg, prompt_size)
        memcpy(zmq_msg_data(&msg), prompt, prompt_size)
        n = send_head(sock, HEADER_SUBMIT_REQUEST, 3, rid, params, params_size, ZMQ_SNDMORE)
        if zmq_msg_send(&msg, sock, 0) < 0:
            zmq_msg_close(&msg)
        return n + prompt_size
    n = ck_single_submit_size(HEADER_SUBMIT_REQUEST, rid, prompt_size, params_size)
    ck_buffer_msg(buffers, &msg, n)
    ck_write_single_submit(
        <uint8_t*>zmq_msg_data(&msg), HEADER_SUBMIT_REQUEST, rid, prompt, prompt_size,
        params, params_size,
    )
    if zmq_msg_send(&msg, sock, 0) < 0:
        zmq_msg_close(&msg)
    return n


# -- kept prompts ----------------------------------------------------------------------

cdef struct Kept:
    # One allocation per kept request: this head, then either the metadata bytes
    # and the prompt's bytes, or (prompt_size == UINT32_MAX) a zmq_msg_t
    # sharing the prompt, then the metadata bytes. A request that came as a
    # single frame keeps that frame whole as its "prompt", with no metadata.
    uint32_t meta_size
    uint32_t prompt_size
    bint single


cdef Kept* keep(zmq_msg_t* meta, zmq_msg_t* prompt, bint single) noexcept nogil:
    """What re-sends a request, or NULL when memory is short (it is then not kept).

    A prompt below COPY_BELOW bytes is copied: a refcounted copy of a small
    frame would pin the whole receive buffer libzmq decoded it from (pyzmq's
    copy-below-a-threshold rule). A larger one has a buffer of its own: shared.
    """
    cdef size_t meta_size = 0 if meta == NULL else zmq_msg_size(meta)
    cdef size_t prompt_size = zmq_msg_size(prompt)
    cdef bint shared = prompt_size >= COPY_BELOW
    cdef Kept* kept = <Kept*>malloc(
        sizeof(Kept) + meta_size + (sizeof(zmq_msg_t) if shared else prompt_size)
    )
    cdef uint8_t* data
    if kept == NULL:
        return NULL
    kept.meta_size = meta_size
    kept.single = single
    data = <uint8_t*>(kept + 1)
    if shared:
        kept.prompt_size = UINT32_MAX
        zmq_msg_init(<zmq_msg_t*>data)
        zmq_msg_copy(<zmq_msg_t*>data, prompt)
        if meta_size:
            memcpy(data + sizeof(zmq_msg_t), zmq_msg_data(meta), meta_size)
    else:
        kept.prompt_size = prompt_size
        if meta_size:
            memcpy(data, zmq_msg_data(meta), meta_size)
        memcpy(data + meta_size, zmq_msg_data(prompt), prompt_size)
    return kept


cdef inline const uint8_t* kept_meta(Kept* kept) noexcept nogil:
    cdef uint8_t* data = <uint8_t*>(kept + 1)
    return data + sizeof(zmq_msg_t) if kept.prompt_size == UINT32_MAX else data


cdef inline const uint8_t* kept_prompt(Kept* kept, size_t* size) noexcept nogil:
    """The kept prompt's bytes (for a single frame: the whole frame)."""
    cdef uint8_t* data = <uint8_t*>(kept + 1)
    if kept.prompt_size == UINT32_MAX:
        size[0] = zmq_msg_size(<zmq_msg_t*>data)
        return <const uint8_t*>zmq_msg_data(<zmq_msg_t*>data)
    size[0] = kept.prompt_size
    return data + kept.meta_size


cdef void release_kept(void* kept) noexcept nogil:
    if kept != NULL and (<Kept*>kept).prompt_size == UINT32_MAX:
        zmq_msg_close(<zmq_msg_t*>(<Kept*>kept + 1))
    free(kept)


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
        self.buffers = NULL
        self.clients = NULL
        self.engines = NULL
        self.gone = NULL
        self.parts = NULL
        self.entries = NULL
        self.single_entries = NULL
        self.hashes = NULL
        self.submitted = NULL
        self.older = NULL
        self.newer = NULL
        self.oldest = self.newest = UINT32_MAX
        self.work = NULL
        self.batch_entries = NULL
        self.batched_submits = NULL
        self.batched_replies = NULL
        self.scratch = NULL
        self.detokenized_bodies = []

    def __init__(self, options, Router router not None, router_socket, wake_socket):
        self.router = router
        # Held so that the raw handles below stay valid as long as this core.
        self._router_socket = router_socket
        self._wake_socket = wake_socket
        self.sock = <void*><size_t>router_socket.underlying
        self.wake = <void*><size_t>wake_socket.underlying
        self.max_inflight = options.max_inflight
        self.heartbeat_timeout = options.heartbeat_timeout
        self.drain_timeout = options.drain_timeout
        self.max_clients = options.max_clients
        self.max_engines = options.max_engines
        self.keep_prompts = options.keep_prompts
        self.megatron_core = options.dialect == "megatron-core"
        self.computes_hashes = self.megatron_core and router.policy == "prefix"
        self.block_size = options.block_size
        self._detokenizer = options.detokenizer
        self.has_detokenizer = options.detokenizer is not None
        self._log = RateLimitedLog()
        self.control_state = CONTROL_RUNNING
        self.request_timeout = options.request_timeout
        self.measure_latency = options.measure_latency
        for i, bound in enumerate(LATENCY_BUCKETS):
            self.latency_bounds[i] = bound
        if self.request_timeout or self.measure_latency:
            self.submitted = <double*>malloc(options.max_inflight * sizeof(double))
            if self.submitted == NULL:
                raise MemoryError()
        if self.request_timeout:
            self.older = <uint32_t*>malloc(options.max_inflight * sizeof(uint32_t))
            self.newer = <uint32_t*>malloc(options.max_inflight * sizeof(uint32_t))
            if self.older == NULL or self.newer == NULL:
                raise MemoryError()
        self.clients = <Client*>calloc(self.max_clients, sizeof(Client))
        self.engines = <Engine*>calloc(self.max_engines, sizeof(Engine))
        self.gone = <int*>malloc(self.max_engines * sizeof(int))
        self.parts_capacity = FIRST_PARTS
        self.parts = <zmq_msg_t*>malloc(FIRST_PARTS * sizeof(zmq_msg_t))
        self.entries_capacity = FIRST_ENTRIES
        self.entries = <ck_entry*>malloc(FIRST_ENTRIES * sizeof(ck_entry))
        self.single_entries_capacity = FIRST_ENTRIES
        self.single_entries = <ck_single_entry*>malloc(FIRST_ENTRIES * sizeof(ck_single_entry))
        self.work = <uint32_t*>calloc(options.max_inflight, sizeof(uint32_t))
        self.buffers = ck_buffer_pool_new()
        if (
            self.buffers == NULL or self.clients == NULL or self.engines == NULL
            or self.gone == NULL or self.parts == NULL or self.entries == NULL or self.work == NULL
            or self.single_entries == NULL
            or ck_requests_init(
                &self.requests, options.max_inflight, options.index_size, INDEX_WINDOW_MIN
            ) != 0
            or ck_ids_init(&self.client_ids, self.max_clients) != 0
            or ck_ids_init(&self.engine_ids, self.max_engines) != 0
        ):
            raise MemoryError()

    def __dealloc__(self):
        cdef uint32_t slot
        if self.requests.pool != NULL:
            for slot in range(self.requests.used):
                if self.requests.pool[slot].server_rid >= 0:
                    release_kept(self.requests.pool[slot].kept)
        ck_requests_free(&self.requests)
        if self.buffers != NULL:
            ck_buffer_pool_close(self.buffers)
        ck_ids_free(&self.client_ids)
        ck_ids_free(&self.engine_ids)
        free(self.clients)
        free(self.engines)
        free(self.gone)
        free(self.parts)
        free(self.entries)
        free(self.single_entries)
        free(self.hashes)
        free(self.submitted)
        free(self.older)
        free(self.newer)
        free(self.work)
        free(self.batch_entries)
        free(self.batched_submits)
        free(self.batched_replies)
        free(self.scratch)

    # -- what the Coordinator calls ------------------------------------------------------

    def serve(self, double timeout) -> bool:
        """Handle messages for up to ``timeout`` seconds, without the GIL.

        False once the loop must stop (a SHUTDOWN arrived, or ``stop()`` woke
        it); True when the time is up or a signal interrupted the wait.
        """
        cdef bint stop
        with nogil:
            stop = self._serve_for(timeout)
        return not stop

    def expire(self, double now) -> None:
        """Declare gone the engines whose drain or heartbeat timed out, end the
        requests in flight longer than request_timeout, and settle what that left."""
        cdef int rank
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
        # The oldest first: only the requests that are due are touched.
        while self.oldest != UINT32_MAX and self.submitted[self.oldest] < deadline:
            self._time_out(self.oldest)
        self._settle()

    def shutdown(self) -> None:
        """End every request still in flight with ERROR(SHUTTING_DOWN): its terminal reply."""
        cdef uint32_t i, n
        cdef RequestOrder* order = self._in_order(-1, -1, &n)
        try:
            for i in range(n):
                if self.requests.pool[order[i].slot].server_rid == order[i].server_rid:
                    self._fail_request(order[i].slot, ERROR_SHUTTING_DOWN, HEADER_SHUTDOWN)
        finally:
            free(order)
        self._settle()

    def stats(self) -> dict:
        cdef int rank
        cdef size_t n
        cdef const uint8_t* identity
        engines = []
        for rank in range(self.n_engines):
            identity = ck_ids_get(&self.engine_ids, rank, &n)
            state = self.engines[rank].state
            engines.append((rank, identity[:n], state, self.router.pending(rank)))
        result = stats_map(
            implementation=self.implementation,
            policy=self.router.policy,
            messages=self.messages,
            inflight=self.requests.live,
            clients=self.n_clients,
            control_state=self.control_state,
            counters=[self.counters[i] for i in range(N_COUNTERS)],
            engines=engines,
        )
        if DEBUG:
            result["debug"] = {"polls": self.debug_polls}
        return result

    def count_auth_refused(self) -> None:
        """A peer refused at the CURVE handshake (from the thread that watches for them)."""
        self.counters[COUNTER_AUTH_REFUSED] += 1

    def metrics(self) -> dict:
        """Traffic by header and direction, outcomes by error code, latencies."""
        cdef int direction, header
        latency = None
        if self.measure_latency:
            latency = {
                "final": (list(self.final_latency), self.final_latency_sum),
                "first_reply": (list(self.first_latency), self.first_latency_sum),
            }
        return metrics_map(
            traffic=[
                (
                    direction,
                    header,
                    self.traffic_messages[direction][header],
                    self.traffic_bytes[direction][header],
                )
                for direction in range(2)
                for header in range(HEADER_SLOTS)
            ],
            failed=list(self.failed),
            refused=list(self.refused),
            latency=latency,
            prefix=self.router.prefix_counts,
        )

    # -- the hot path (no GIL) -----------------------------------------------------------

    cdef bint _serve_for(self, double timeout) noexcept nogil:
        """Poll and handle messages for up to ``timeout`` seconds; True once the loop must stop."""
        cdef zmq_pollitem_t items[2]
        cdef zmq_msg_t wake
        cdef double deadline = monotonic() + timeout
        cdef long wait_ms
        items[0].socket = self.sock
        items[0].fd = 0
        items[0].events = ZMQ_POLLIN
        items[1].socket = self.wake
        items[1].fd = 0
        items[1].events = ZMQ_POLLIN
        while not self.stopping:
            wait_ms = <long>((deadline - monotonic()) * 1000.0)
            if wait_ms <= 0:
                return False
            if zmq_poll(items, 2, wait_ms) < 0:
                # EINTR: back to Python, which runs the signal handlers; anything
                # else means the context was terminated.
                return zmq_errno() != EINTR
            if DEBUG:
                self.debug_polls += 1
            if items[1].revents & ZMQ_POLLIN:
                zmq_msg_init(&wake)
                zmq_msg_recv(&wake, self.wake, ZMQ_DONTWAIT)
                zmq_msg_close(&wake)
                self.stopping = True
            elif items[0].revents & ZMQ_POLLIN:
                self._drain()
        return True

    cdef void _drain(self) noexcept nogil:
        """Handle every message waiting, one at a time."""
        cdef int i
        while not self.stopping and self._receive():
            self.messages += 1
            self._handle()
            for i in range(self.n_parts):
                zmq_msg_close(&self.parts[i])
            self.n_parts = 0
            if self.n_gone:
                with gil:
                    self._settle()

    cdef bint _receive(self) noexcept nogil:
        """Receive every frame of the next message into ``parts``; False if none waits."""
        cdef zmq_msg_t* grown
        cdef int i
        zmq_msg_init(&self.parts[0])
        if zmq_msg_recv(&self.parts[0], self.sock, ZMQ_DONTWAIT) < 0:
            zmq_msg_close(&self.parts[0])
            return False
        self.n_parts = 1
        self.oversized = False
        while zmq_msg_more(&self.parts[self.n_parts - 1]):
            if self.n_parts == MAX_PARTS:
                break
            if self.n_parts == self.parts_capacity:
                grown = <zmq_msg_t*>malloc(2 * self.parts_capacity * sizeof(zmq_msg_t))
                if grown == NULL:
                    break
                for i in range(self.n_parts):
                    zmq_msg_init(&grown[i])
                    zmq_msg_move(&grown[i], &self.parts[i])
                free(self.parts)
                self.parts = grown
                self.parts_capacity *= 2
            zmq_msg_init(&self.parts[self.n_parts])
            zmq_msg_recv(&self.parts[self.n_parts], self.sock, 0)
            self.n_parts += 1
        if zmq_msg_more(&self.parts[self.n_parts - 1]):
            self._discard_rest()
        return True

    cdef void _discard_rest(self) noexcept nogil:
        """Drop the remaining frames of an oversized message; it is then malformed."""
        cdef zmq_msg_t extra
        cdef int more = 1
        while more:
            zmq_msg_init(&extra)
            zmq_msg_recv(&extra, self.sock, 0)
            more = zmq_msg_more(&extra)
            zmq_msg_close(&extra)
        self.oversized = True

    cdef inline const uint8_t* _data(self, int part) noexcept nogil:
        return <const uint8_t*>zmq_msg_data(&self.parts[part])

    cdef inline size_t _size(self, int part) noexcept nogil:
        return zmq_msg_size(&self.parts[part])

    cdef void _handle(self) noexcept nogil:
        """Dispatch the message in ``parts`` (frame 0 is the sender's routing id)."""
        cdef const uint8_t* identity = self._data(0)
        cdef size_t identity_size = self._size(0)
        cdef int32_t engine = ck_ids_find(&self.engine_ids, identity, identity_size)
        cdef int32_t client
        cdef int64_t header
        cdef uint32_t length
        cdef size_t end
        if self.n_parts == 2 and self._size(1) == 0:
            with gil:
                self._register(engine)
            return
        client = ck_ids_find(&self.client_ids, identity, identity_size)
        if self.oversized or ck_read_header(
            self._data(1), self._size(1), &header, &length, &end
        ) != CK_OK:
            self._count_in(-1)
            with gil:
                self._malformed(client, None, -1, "malformed metadata frame")
            return
        self._count_in(header)
        if engine >= 0:
            self._from_engine(engine, header)
        elif header == HEADER_CONNECT:
            with gil:
                self._connect(client)
        elif header == HEADER_ENGINE_HELLO and client < 0:
            with gil:
                self._engine_hello(-1)
        elif client < 0:
            self.counters[COUNTER_NOT_CONNECTED] += 1
            with gil:
                self._log.warn(
                    "not_connected",
                    f"dropped {header_name(header)} from a peer that never connected",
                )
        else:
            self.clients[client].last_seen = self.messages
            self._from_client(client, header)

    cdef void _from_client(self, int32_t client, int64_t header) noexcept nogil:
        if header == HEADER_SUBMIT_REQUEST and self.clients[client].format == FORMAT_SINGLE_FRAME:
            self._submit_single(client)
        elif header == HEADER_SUBMIT_REQUEST or header == HEADER_SUBMIT_REQUEST_WITH_KV:
            if self.clients[client].format == FORMAT_SINGLE_FRAME:  # 0.19 has no KV submission
                with gil:
                    self._refuse(
                        client, None, ERROR_UNKNOWN_HEADER, header, COUNTER_UNKNOWN_HEADER
                    )
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
        cdef int read = ck_read_submit(self._data(1), self._size(1), &submit)
        cdef int n_payload = 1 if header == HEADER_SUBMIT_REQUEST else 2
        cdef int n_frames = self.n_parts - 2
        cdef const uint8_t* hashes = NULL
        cdef size_t n_hashes = 0
        if read != CK_OK:
            with gil:
                rid = submit.rid if submit.offset else None
                self._malformed(client, rid, header, ck_strstatus(read).decode())
            return
        if n_frames == n_payload + 1:  # the optional block-hash frame
            hashes = self._data(2 + n_payload)
            n_hashes = self._size(2 + n_payload) // BLOCK_HASH_SIZE
        if (
            submit.length != <uint32_t>(2 + n_payload)
            or not n_payload <= n_frames <= n_payload + 1
            or (hashes != NULL and self._size(2 + n_payload) % BLOCK_HASH_SIZE)
        ):
            with gil:
                self._malformed(client, submit.rid, header, "bad frame layout")
            return
        memset(&inbound, 0, sizeof(Inbound))
        inbound.header = header
        inbound.length = submit.length
        inbound.payload = 2
        inbound.n_payload = n_payload
        inbound.params_data = self._data(1) + submit.offset
        inbound.params_size = self._size(1) - submit.offset
        inbound.multi_ok = True
        # A single-frame engine takes [20, rid, prompt, params]: a str or array, and a map.
        inbound.single_ok = (
            self.n_single_engines > 0
            and header == HEADER_SUBMIT_REQUEST
            and ck_check_prompt(self._data(2), self._size(2)) == CK_OK
            and ck_check_map(inbound.params_data, inbound.params_size) == CK_OK
        )
        self._accept(
            client, submit.rid, hashes, n_hashes, ck_prompt_tokens(self._data(2), self._size(2)),
            &inbound,
        )

    cdef void _submit_single(self, int32_t client) noexcept nogil:
        """A new request in one frame: [20, client_rid, prompt, params] (Megatron-Core 0.19).

        Read as far as its request id: to a single-frame engine the rest goes as it
        came. The prompt and the params are found (walking the prompt) only when a
        multipart engine may take it, or the prefix policy hashes the prompt.
        """
        cdef Inbound inbound
        cdef ck_single_submit single
        cdef const uint8_t* hashes = NULL
        cdef size_t n_hashes = 0
        cdef int read = ck_read_single_head(self._data(1), self._size(1), &single)
        if read == CK_OK and self.n_parts != 2:
            with gil:
                self._malformed(client, single.rid, HEADER_SUBMIT_REQUEST, "bad frame layout")
            return
        if read == CK_OK and (self.n_multipart_engines > 0 or self.computes_hashes):
            read = ck_read_single_submit(self._data(1), self._size(1), &single)
        if read != CK_OK:
            with gil:
                rid = single.rid if single.prompt else None
                detail = ck_strstatus(read).decode()
                self._malformed(client, rid, HEADER_SUBMIT_REQUEST, detail)
            return
        memset(&inbound, 0, sizeof(Inbound))
        inbound.header = HEADER_SUBMIT_REQUEST
        inbound.frame = self._data(1)
        inbound.frame_size = self._size(1)
        inbound.prompt = single.prompt
        inbound.params = single.params
        inbound.single_ok = True
        inbound.multi_ok = single.params != 0
        if self.computes_hashes:
            hashes = self._prompt_hashes(
                inbound.frame + single.prompt, single.params - single.prompt, &n_hashes
            )
        self._accept(
            client,
            single.rid,
            hashes,
            n_hashes,
            ck_prompt_tokens(inbound.frame + single.prompt, inbound.frame_size - single.prompt),
            &inbound,
        )

    cdef void _submit_batch(self, int32_t client) noexcept nogil:
        """SUBMIT_BATCH: each entry down the path of a SUBMIT_REQUEST; the entries
        routed to batched engines leave as one ENGINE_SUBMIT_BATCH per engine once
        every entry is routed (see _send_engine_batches)."""
        cdef Inbound inbound
        cdef ck_batch_entry* entry
        cdef uint32_t count, i
        cdef size_t needed = 0, n_hashes
        cdef int part = 2
        cdef const uint8_t* hashes
        cdef int read
        if not self.clients[client].batch:
            with gil:
                self._malformed(client, None, HEADER_SUBMIT_BATCH, "batches not granted")
            return
        read = self._read_submit_batch(&count)
        if read != CK_OK:
            with gil:
                self._malformed_batch(client, count, ck_strstatus(read).decode())
            return
        for i in range(count):
            needed += 1 + self.batch_entries[i].flag
        if needed != <size_t>(self.n_parts - 2):
            with gil:
                self._malformed_batch(client, count, "bad frame layout")
            return
        for i in range(count):
            if not self.clients[client].used:
                break  # found gone meanwhile
            entry = &self.batch_entries[i]
            hashes = NULL
            n_hashes = 0
            if entry.flag:
                hashes = self._data(part + 1)
                n_hashes = self._size(part + 1) // BLOCK_HASH_SIZE
            if entry.flag and self._size(part + 1) % BLOCK_HASH_SIZE:
                with gil:
                    self._malformed(client, entry.rid, HEADER_SUBMIT_BATCH, "bad frame layout")
            else:
                memset(&inbound, 0, sizeof(Inbound))
                inbound.header = HEADER_SUBMIT_REQUEST
                inbound.length = 3
                inbound.payload = part
                inbound.n_payload = 1
                inbound.batched = True
                inbound.params_data = self._data(1) + entry.params_offset
                inbound.params_size = entry.params_size
                inbound.multi_ok = True
                inbound.single_ok = (
                    self.n_single_engines > 0
                    and ck_check_prompt(self._data(part), self._size(part)) == CK_OK
                    and ck_check_map(inbound.params_data, inbound.params_size) == CK_OK
                )
                self._accept(
                    client, entry.rid, hashes, n_hashes,
                    ck_prompt_tokens(self._data(part), self._size(part)), &inbound,
                )
            part += 1 + entry.flag
        self._send_engine_batches()

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
            self._malformed(client, self.batch_entries[i].rid, HEADER_SUBMIT_BATCH, detail)

    cdef int _read_submit_batch(self, uint32_t* count) noexcept nogil:
        """Read the SUBMIT_BATCH at hand into ``batch_entries``, and make room for its
        entries bound for batched engines and their metadata; growing as needed."""
        cdef int status = ck_read_batch_into(
            self._data(1), self._size(1), HEADER_SUBMIT_BATCH, 3, &self.batch_entries,
            &self.batch_entries_capacity, count,
        )
        if status != CK_OK:
            return status
        self.n_batched_submits = 0
        # An ENGINE_SUBMIT_BATCH's metadata: the head, then per entry a fixarray,
        # a server id and the params as they came.
        if not reserve(
            <void**>&self.batched_submits, &self.batched_submits_capacity, count[0],
            sizeof(BatchedSubmit),
        ) or not reserve(
            <void**>&self.scratch, &self.scratch_capacity,
            CK_BATCH_HEAD_MAX + count[0] * (1 + CK_INT_MAX) + self._size(1), 1,
        ):
            return CK_TOO_MANY
        return CK_OK

    cdef void _send_engine_batches(self) noexcept nogil:
        """The entries routed to batched engines: one ENGINE_SUBMIT_BATCH per engine,
        in the order the engines were first chosen, the prompts as the same frames.
        An entry re-sent or ended meanwhile is left out; an engine found gone here
        leaves its requests to _settle, as any engine found gone."""
        cdef BatchedSubmit* batched = self.batched_submits
        cdef uint32_t n = self.n_batched_submits, i, j
        cdef ck_request* request
        cdef int rank
        self.n_batched_submits = 0
        for i in range(n):
            request = &self.requests.pool[batched[i].slot]
            if request.server_rid != batched[i].server_rid or request.rank != batched[i].rank:
                batched[i].rank = -1
        for i in range(n):
            rank = batched[i].rank
            if rank < 0:
                continue
            if self.engines[rank].state != ENGINE_GONE:  # a gone one's requests are settled
                if self._send_identity(&self.engine_ids, rank) == 0:
                    self._send_engine_batch(rank, i, n)
                else:
                    self._mark_gone(rank, GONE_UNREACHABLE)
            for j in range(i, n):
                if batched[j].rank == rank:
                    batched[j].rank = -1

    cdef void _send_engine_batch(self, int rank, uint32_t first, uint32_t n) noexcept nogil:
        """One engine's ENGINE_SUBMIT_BATCH after its routing id: the metadata written
        into ``scratch``, then the prompts as the same frames."""
        cdef BatchedSubmit* batched = self.batched_submits
        cdef uint32_t j, count = 0
        cdef uint8_t* out = self.scratch
        cdef size_t size, prompts = 0
        for j in range(first, n):
            count += batched[j].rank == rank
        out += ck_write_batch_head(out, HEADER_SUBMIT_BATCH, count)
        for j in range(first, n):
            if batched[j].rank == rank:
                out[0] = MSGPACK_FIXARRAY_2
                out += 1 + ck_write_int(out + 1, batched[j].server_rid)
                memcpy(out, batched[j].params, batched[j].params_size)
                out += batched[j].params_size
                prompts += self._size(batched[j].part)
        size = out - self.scratch
        self._count_out(HEADER_SUBMIT_BATCH, size + prompts)
        send_bytes(self.sock, self.scratch, size, ZMQ_SNDMORE)
        for j in range(first, n):
            if batched[j].rank == rank:
                count -= 1
                send_msg(self.sock, &self.parts[batched[j].part], ZMQ_SNDMORE if count else 0)

    cdef const uint8_t* _prompt_hashes(
        self, const uint8_t* prompt, size_t size, size_t* n_hashes
    ) noexcept nogil:
        """The block hashes of a token-id prompt (a client that sent none); NULL for a
        prompt with no token ids (a str: it is routed by load)."""
        cdef uint8_t* grown
        cdef int status = ck_prompt_hashes(
            prompt, size, self.block_size, self.hashes, self.hashes_capacity, n_hashes
        )
        if status == CK_TOO_MANY:
            grown = <uint8_t*>realloc(self.hashes, n_hashes[0] * BLOCK_HASH_SIZE)
            if grown == NULL:
                n_hashes[0] = 0
                return NULL
            self.hashes = grown
            self.hashes_capacity = n_hashes[0]
            status = ck_prompt_hashes(
                prompt, size, self.block_size, self.hashes, self.hashes_capacity, n_hashes
            )
        if status != CK_OK:
            n_hashes[0] = 0
            return NULL
        return self.hashes

    cdef void _accept(
        self,
        int32_t client,
        int64_t rid,
        const uint8_t* hashes,
        size_t n_hashes,
        uint64_t tokens,
        Inbound* inbound,
    ) noexcept nogil:
        """A request that parsed: refused (a duplicate id, a full table), or given a
        server id and an engine, and the frames on to it."""
        cdef int64_t header = inbound.header
        cdef uint32_t slot
        cdef int64_t server_rid
        cdef ck_request* request
        cdef int status
        cdef zmq_msg_t meta
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
        self.clients[client].inflight += 1
        if self.submitted != NULL:
            self.submitted[slot] = monotonic()
        if self.older != NULL:
            self._queue(slot)
        request = &self.requests.pool[slot]
        server_rid = request.server_rid
        if inbound.frame == NULL:  # multipart: the metadata with the server id
            self._rewrite_submit(&meta, server_rid, inbound)
            inbound.meta = &meta
        # A KV submission's source blocks are tied to the engine chosen now: never re-sent.
        if header == HEADER_SUBMIT_REQUEST and self.keep_prompts:
            if inbound.frame == NULL:
                request.kept = keep(&meta, &self.parts[inbound.payload], False)
            else:
                request.kept = keep(NULL, &self.parts[1], True)
        status = self._route(slot, hashes, n_hashes, tokens, inbound)
        while status == ROUTE_ENGINE_GONE:
            # The gone engine's requests are older than this one: they go first.
            with gil:
                self._settle()
            if request.server_rid != server_rid:  # its client went away meanwhile
                break
            status = self._route(slot, hashes, n_hashes, tokens, inbound)
        if inbound.meta != NULL:
            zmq_msg_close(&meta)
        if status == ROUTE_SENT:
            self.counters[COUNTER_SUBMITTED] += 1
        elif status != ROUTE_ENGINE_GONE:
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
                )

    cdef void _rewrite_submit(
        self, zmq_msg_t* out, int64_t server_rid, Inbound* inbound
    ) noexcept nogil:
        """A new request's metadata with ``server_rid``, in a new message."""
        cdef ck_submit head
        head.header = inbound.header
        head.length = inbound.length
        zmq_msg_init_size(out, ck_submit_size(&head, server_rid, inbound.params_size))
        ck_write_submit(
            <uint8_t*>zmq_msg_data(out), &head, server_rid, inbound.params_data,
            inbound.params_size,
        )

    cdef int _route(
        self,
        uint32_t slot,
        const uint8_t* hashes,
        size_t n_hashes,
        uint64_t tokens,
        Inbound* inbound,
    ) noexcept nogil:
        """Send a new request to the engine chosen for it, in its format; an entry of
        a SUBMIT_BATCH bound for a batched engine joins that engine's batch. A
        RouteStatus."""
        cdef int rank
        cdef BatchedSubmit* batched
        cdef int status = self._pick_engine(
            hashes, n_hashes, tokens, inbound.single_ok, inbound.multi_ok, inbound.batched,
            &rank,
        )
        if status == ROUTE_SENT:
            self.requests.pool[slot].rank = rank
            self.work[slot] = <uint32_t>self.router.charged
            if inbound.batched and self.engines[rank].batch:
                batched = &self.batched_submits[self.n_batched_submits]
                self.n_batched_submits += 1
                batched.slot = slot
                batched.server_rid = self.requests.pool[slot].server_rid
                batched.rank = rank
                batched.part = inbound.payload
                batched.params = inbound.params_data
                batched.params_size = inbound.params_size
            else:
                self._send_new(slot, rank, inbound)
        return status

    cdef void _send_new(self, uint32_t slot, int rank, Inbound* inbound) noexcept nogil:
        """The frames of a new request after the engine's routing id, in its format."""
        cdef int64_t server_rid = self.requests.pool[slot].server_rid
        cdef bint single_frame = self.engines[rank].format == FORMAT_SINGLE_FRAME
        cdef const uint8_t* frame = inbound.frame
        cdef size_t size, end = inbound.frame_size
        cdef int i
        if frame != NULL and single_frame:  # as it came, behind a new head
            size = send_submit(self.sock, self.buffers, True, server_rid, frame + inbound.prompt,
                               end - inbound.prompt, NULL, 0)
        elif frame != NULL:  # split at the field boundary
            size = send_submit(self.sock, self.buffers, False, server_rid, frame + inbound.prompt,
                               inbound.params - inbound.prompt, frame + inbound.params,
                               end - inbound.params)
        elif single_frame:
            size = send_submit(self.sock, self.buffers, True, server_rid,
                               self._data(inbound.payload), self._size(inbound.payload),
                               inbound.params_data, inbound.params_size)
        else:  # the metadata and the payload frames as themselves
            size = zmq_msg_size(inbound.meta)
            for i in range(inbound.n_payload):
                size += self._size(inbound.payload + i)
            send_msg(self.sock, inbound.meta, ZMQ_SNDMORE)
            for i in range(inbound.n_payload):
                send_msg(
                    self.sock, &self.parts[inbound.payload + i],
                    ZMQ_SNDMORE if i + 1 < inbound.n_payload else 0,
                )
        self._count_out(inbound.header, size)

    cdef int _resend(self, uint32_t slot) noexcept nogil:
        """Send a request whose engine died to another, from what it kept; a RouteStatus."""
        cdef Kept* kept = <Kept*>self.requests.pool[slot].kept
        cdef ck_single_submit single
        cdef ck_submit submit
        cdef size_t size
        cdef const uint8_t* prompt = kept_prompt(kept, &size)
        cdef const uint8_t* meta = kept_meta(kept)
        cdef bint single_ok, multi_ok
        cdef uint64_t tokens
        cdef int rank
        cdef int status = ROUTE_ENGINE_GONE
        if kept.single:
            ck_read_single_head(prompt, size, &single)
            tokens = ck_prompt_tokens(prompt + single.prompt, size - single.prompt)
            single_ok = True
            multi_ok = self.n_multipart_engines > 0 and ck_read_single_submit(
                prompt, size, &single
            ) == CK_OK
        else:
            tokens = ck_prompt_tokens(prompt, size)
            multi_ok = True
            ck_read_submit(meta, kept.meta_size, &submit)
            single_ok = (
                self.n_single_engines > 0
                and ck_check_prompt(prompt, size) == CK_OK
                and ck_check_map(meta + submit.offset, kept.meta_size - submit.offset) == CK_OK
            )
        while status == ROUTE_ENGINE_GONE:  # that one waits in the queue of gone engines
            status = self._pick_engine(NULL, 0, tokens, single_ok, multi_ok, False, &rank)
        if status == ROUTE_SENT:
            self.requests.pool[slot].rank = rank
            self.work[slot] = <uint32_t>self.router.charged
            self._send_kept(slot, rank)
        return status

    cdef void _send_kept(self, uint32_t slot, int rank) noexcept nogil:
        """A kept request's frames after the engine's routing id, in the engine's format."""
        cdef Kept* kept = <Kept*>self.requests.pool[slot].kept
        cdef int64_t server_rid = self.requests.pool[slot].server_rid
        cdef bint single_frame = self.engines[rank].format == FORMAT_SINGLE_FRAME
        cdef ck_single_submit single
        cdef ck_submit submit
        cdef size_t size, sent
        cdef const uint8_t* prompt = kept_prompt(kept, &size)
        cdef const uint8_t* meta = kept_meta(kept)
        if kept.single and single_frame:
            ck_read_single_head(prompt, size, &single)
            sent = send_submit(self.sock, self.buffers, True, server_rid, prompt + single.prompt,
                               size - single.prompt, NULL, 0)
        elif kept.single:  # _resend read it whole: it splits
            ck_read_single_submit(prompt, size, &single)
            sent = send_submit(self.sock, self.buffers, False, server_rid, prompt + single.prompt,
                               single.params - single.prompt, prompt + single.params,
                               size - single.params)
        elif single_frame:
            ck_read_submit(meta, kept.meta_size, &submit)
            sent = send_submit(self.sock, self.buffers, True, server_rid, prompt, size,
                               meta + submit.offset, kept.meta_size - submit.offset)
        else:  # the kept metadata (the server id in it already) and the prompt
            sent = kept.meta_size + size
            send_bytes(self.sock, meta, kept.meta_size, ZMQ_SNDMORE)
            if kept.prompt_size == UINT32_MAX:
                send_shared(self.sock, <zmq_msg_t*>(kept + 1), 0)
            else:
                send_bytes(self.sock, prompt, size, 0)
        self._count_out(HEADER_SUBMIT_REQUEST, sent)

    cdef int _pick_engine(self, const uint8_t* hashes, size_t n_hashes, uint64_t tokens,
                          bint single_ok, bint multi_ok, bint batched, int* rank) noexcept nogil:
        """The router's choice into ``rank``, its routing id sent (the request's frames
        follow) unless ``batched`` and the engine takes batches (the batch is sent
        later); a RouteStatus. An unreachable choice is marked gone: ENGINE_GONE; one
        whose format the request cannot be put in: UNSENDABLE."""
        rank[0] = self.router.choose_c(hashes, n_hashes, tokens, monotonic())
        if rank[0] < 0:
            return ROUTE_NO_ENGINES if self.router.n_members == 0 else ROUTE_ALL_BUSY
        if not (single_ok if self.engines[rank[0]].format == FORMAT_SINGLE_FRAME else multi_ok):
            self.router.release_c(rank[0], self.router.charged)
            return ROUTE_UNSENDABLE
        if batched and self.engines[rank[0]].batch:
            return ROUTE_SENT
        if self._send_identity(&self.engine_ids, rank[0]) == 0:
            return ROUTE_SENT
        self.router.release_c(rank[0], self.router.charged)
        self._mark_gone(rank[0], GONE_UNREACHABLE)
        return ROUTE_ENGINE_GONE

    cdef void _from_engine(self, int32_t engine, int64_t header) noexcept nogil:
        if self.engines[engine].format == FORMAT_SINGLE_FRAME and header == HEADER_ENGINE_REPLY:
            self._forward_single_replies(engine)
        elif self.engines[engine].format != FORMAT_SINGLE_FRAME and (
            header == HEADER_ENGINE_REPLY or header == HEADER_ENGINE_REPLY_PARTIAL
        ):
            self._forward_replies(engine)
        else:
            with gil:
                self._from_engine_rarely(engine, header)

    cdef void _forward_replies(self, int32_t engine) noexcept nogil:
        """Each entry of an engine's batch to its request's client, the body as itself."""
        cdef int64_t header, slot, client_rid
        cdef uint32_t count, i
        cdef int32_t client
        cdef bint final
        cdef double now = 0.0
        cdef BatchedReply* batched
        if self._read_replies(&header, &count) != CK_OK:
            with gil:
                self._malformed(-1, None, -1, "bad ENGINE_REPLY metadata")
            return
        if count != <uint32_t>(self.n_parts - 2):
            with gil:
                self._malformed(
                    -1, None, header, f"{count} entries but {self.n_parts - 2} payload frames"
                )
            return
        final = header == HEADER_ENGINE_REPLY
        if self.measure_latency:
            now = monotonic()
        for i in range(count):
            if not self.entries[i].valid:
                with gil:
                    self._reject_entry(engine, None, ERROR_MALFORMED, header)
                continue
            slot = ck_requests_find(&self.requests, self.entries[i].rid)
            if slot < 0 or self.requests.pool[slot].rank != engine:
                # A late reply (its request ended: aborted, timed out, its client
                # gone), or a reply the engine got wrong.
                self.counters[COUNTER_UNKNOWN_REQUEST] += 1
                if self.engines[engine].coordkit:
                    with gil:
                        rid = self.entries[i].rid
                        self._reject_entry(engine, rid, ERROR_UNKNOWN_REQUEST, header)
                continue
            client = self.requests.pool[slot].client
            client_rid = self.requests.pool[slot].client_rid
            self._finish(<uint32_t>slot, final, now)
            if self.entries[i].needs_detokenize and self.has_detokenizer:
                with gil:
                    self._detokenize(2 + i)
            if self.clients[client].batch:
                batched = &self.batched_replies[self.n_batched_replies]
                self.n_batched_replies += 1
                batched.client = client
                batched.client_rid = client_rid
                batched.part = 2 + i
                batched.data = NULL
                batched.size = self._size(2 + i)
            elif not self._deliver(client, header, client_rid, NULL, 0, &self.parts[2 + i]):
                with gil:
                    self._client_gone(client)
        self._send_client_batches(final)

    cdef void _send_client_batches(self, bint final) noexcept nogil:
        """The entries of the reply batch at hand bound for batched clients: one
        REPLY_BATCH per client, in the order the clients first came, the bodies as
        the same frames."""
        cdef BatchedReply* batched = self.batched_replies
        cdef uint32_t n = self.n_batched_replies, i, j
        cdef int32_t client
        self.n_batched_replies = 0
        for i in range(n):
            client = batched[i].client
            if client < 0:
                continue
            if self._send_identity(&self.client_ids, client) == 0:
                self._send_client_batch(client, final, i, n)
            else:
                with gil:
                    self._client_gone(client)
            for j in range(i, n):
                if batched[j].client == client:
                    batched[j].client = -1

    cdef void _send_client_batch(
        self, int32_t client, bint final, uint32_t first, uint32_t n
    ) noexcept nogil:
        """One client's REPLY_BATCH after its routing id: the metadata written into
        ``scratch``, then the bodies as the same frames."""
        cdef BatchedReply* batched = self.batched_replies
        cdef uint32_t j, count = 0
        cdef uint8_t* out = self.scratch
        cdef size_t size, bodies = 0
        for j in range(first, n):
            if batched[j].client == client:
                count += 1
                bodies += batched[j].size
        out += ck_write_batch_head(out, HEADER_REPLY_BATCH, count)
        for j in range(first, n):
            if batched[j].client == client:
                out[0] = MSGPACK_FIXARRAY_2
                out += 1 + ck_write_int(out + 1, batched[j].client_rid)
                out[0] = MSGPACK_TRUE if final else MSGPACK_FALSE
                out += 1
        size = out - self.scratch
        self._count_out(HEADER_REPLY_BATCH, size + bodies)
        send_bytes(self.sock, self.scratch, size, ZMQ_SNDMORE)
        for j in range(first, n):
            if batched[j].client == client:
                count -= 1
                if batched[j].data == NULL:
                    send_msg(self.sock, &self.parts[batched[j].part], ZMQ_SNDMORE if count else 0)
                else:
                    send_bytes(
                        self.sock, batched[j].data, batched[j].size, ZMQ_SNDMORE if count else 0
                    )

    cdef int _read_replies(self, int64_t* header, uint32_t* count) noexcept nogil:
        """Read the batch's entries into ``entries``, and make room for those bound for
        batched clients and their metadata; growing as needed for a large batch."""
        cdef ck_entry* grown
        cdef int status = ck_read_reply(
            self._data(1), self._size(1), header, self.entries, self.entries_capacity, count
        )
        if status == CK_TOO_MANY:
            grown = <ck_entry*>malloc(count[0] * sizeof(ck_entry))
            if grown == NULL:
                return status
            free(self.entries)
            self.entries = grown
            self.entries_capacity = count[0]
            status = ck_read_reply(
                self._data(1), self._size(1), header, self.entries, self.entries_capacity, count
            )
        if status != CK_OK:
            return status
        return self._reserve_reply_batch(count[0])

    cdef int _reserve_reply_batch(self, uint32_t count) noexcept nogil:
        """Room for ``count`` entries bound for batched clients and their metadata."""
        self.n_batched_replies = 0
        # A REPLY_BATCH's metadata: the head, then per entry a fixarray, a rid, a bool.
        if not reserve(
            <void**>&self.batched_replies, &self.batched_replies_capacity, count,
            sizeof(BatchedReply),
        ) or not reserve(
            <void**>&self.scratch, &self.scratch_capacity,
            CK_BATCH_HEAD_MAX + count * (2 + CK_INT_MAX), 1,
        ):
            return CK_TOO_MANY
        return CK_OK

    cdef void _forward_single_replies(self, int32_t engine) noexcept nogil:
        """A 0.19 engine's finished requests, each map to its request's client; those
        bound for batched clients leave as one REPLY_BATCH per client."""
        cdef uint32_t count, i
        cdef int64_t slot, client_rid
        cdef int32_t client
        cdef double now = 0.0
        cdef ck_single_entry* entry
        cdef BatchedReply* batched
        cdef const uint8_t* body
        cdef size_t size
        if (
            self.n_parts != 2
            or self._read_single_replies(&count) != CK_OK
            or self._reserve_reply_batch(count) != CK_OK
        ):
            with gil:
                self._malformed(-1, None, HEADER_ENGINE_REPLY, "bad single-frame ENGINE_REPLY")
            return
        if self.measure_latency:
            now = monotonic()
        for i in range(count):
            entry = &self.single_entries[i]
            if entry.status != CK_OK:
                with gil:
                    self._reject_entry(engine, None, ERROR_MALFORMED, HEADER_ENGINE_REPLY)
                continue
            slot = ck_requests_find(&self.requests, entry.rid)
            if slot < 0 or self.requests.pool[slot].rank != engine:
                self.counters[COUNTER_UNKNOWN_REQUEST] += 1
                continue
            client = self.requests.pool[slot].client
            client_rid = self.requests.pool[slot].client_rid
            self._finish(<uint32_t>slot, True, now)
            body = self._data(1) + entry.offset
            size = entry.size
            if self.has_detokenizer:  # as 0.19's coordinator: every finished request
                with gil:
                    detokenized = self._detokenized(body, size)
                    self.detokenized_bodies.append(detokenized)  # alive until sent
                    body = <const uint8_t*><const char*>detokenized
                    size = len(detokenized)
            if self.clients[client].batch:
                batched = &self.batched_replies[self.n_batched_replies]
                self.n_batched_replies += 1
                batched.client = client
                batched.client_rid = client_rid
                batched.part = 1
                batched.data = body
                batched.size = size
            elif not self._deliver(client, HEADER_ENGINE_REPLY, client_rid, body, size, NULL):
                with gil:
                    self._client_gone(client)
        self._send_client_batches(True)
        if self.has_detokenizer:
            with gil:
                self.detokenized_bodies.clear()

    cdef void _finish(self, uint32_t slot, bint final, double now) noexcept nogil:
        """A reply for the request at ``slot`` arrived: timed, counted, and a final
        forgets it."""
        cdef double elapsed
        if self.measure_latency:
            elapsed = now - self.submitted[slot]
            if not self.requests.pool[slot].flags & FLAG_PRODUCED:
                self._observe(self.first_latency, &self.first_latency_sum, elapsed)
            if final:
                self._observe(self.final_latency, &self.final_latency_sum, elapsed)
        if final:
            self._forget(slot)
            self.counters[COUNTER_REPLIES] += 1
        else:
            self.requests.pool[slot].flags |= FLAG_PRODUCED
            self.counters[COUNTER_PARTIALS] += 1

    cdef int _read_single_replies(self, uint32_t* count) noexcept nogil:
        """Read a single-frame batch's entries into ``single_entries``, growing it."""
        cdef ck_single_entry* grown
        cdef int status = ck_read_single_reply(
            self._data(1), self._size(1), self.single_entries, self.single_entries_capacity, count
        )
        if status != CK_TOO_MANY:
            return status
        grown = <ck_single_entry*>malloc(count[0] * sizeof(ck_single_entry))
        if grown == NULL:
            return status
        free(self.single_entries)
        self.single_entries = grown
        self.single_entries_capacity = count[0]
        return ck_read_single_reply(
            self._data(1), self._size(1), self.single_entries, self.single_entries_capacity, count
        )

    cdef bint _deliver(self, int32_t client, int64_t header, int64_t client_rid,
                       const uint8_t* body, size_t size, zmq_msg_t* message) noexcept nogil:
        """One reply to its client in the client's format: the body as ``message``
        itself when given, else a copy of ``body``. False when the client is gone.

        A 0.19 client takes finals only, each ``[21, client_rid, <map>]``: a partial is
        not sent, and a final whose body is not a map cannot be (counted, dropped).
        """
        cdef uint8_t out[CK_HEADER_INT_MAX]
        cdef size_t n
        if message != NULL:
            body = <const uint8_t*>zmq_msg_data(message)
            size = zmq_msg_size(message)
        if self.clients[client].format == FORMAT_SINGLE_FRAME:
            if header != HEADER_ENGINE_REPLY:
                return True
            if ck_check_map(body, size) != CK_OK:
                self.counters[COUNTER_MALFORMED_ENTRIES] += 1
                return True
            if self._send_identity(&self.client_ids, client) != 0:
                return False
            self._count_out(header, send_head(self.sock, header, 3, client_rid, body, size, 0))
            return True
        n = ck_write_header_int(out, header, client_rid)
        if self._send_identity(&self.client_ids, client) != 0:
            return False
        self._count_out(header, n + size)
        send_bytes(self.sock, out, n, ZMQ_SNDMORE)
        if message != NULL:
            send_msg(self.sock, message, 0)
        else:
            send_bytes(self.sock, body, size, 0)
        return True

    cdef void _forget(self, uint32_t slot) noexcept nogil:
        """Take the request at ``slot`` out of every table and count; a draining
        engine whose last request this was is gone."""
        cdef ck_request* request = &self.requests.pool[slot]
        cdef int rank = request.rank
        self.clients[request.client].inflight -= 1
        if self.older != NULL:
            self._unqueue(slot)
        release_kept(request.kept)
        ck_requests_remove(&self.requests, slot)
        if rank < 0:
            return
        self.router.release_c(rank, self.work[slot])
        if self.engines[rank].state == ENGINE_DRAINING and self.router.pending_count[rank] == 0:
            self.engines[rank].state = ENGINE_GONE

    cdef void _count_in(self, int64_t header) noexcept nogil:
        """Count the message in ``parts`` as received (header -1: unreadable)."""
        cdef int slot = header if 0 <= header < HEADER_SLOTS - 1 else HEADER_SLOTS - 1
        cdef size_t size = 0
        cdef int i
        for i in range(1, self.n_parts):
            size += self._size(i)
        self.traffic_messages[0][slot] += 1
        self.traffic_bytes[0][slot] += size

    cdef void _count_out(self, int64_t header, size_t size) noexcept nogil:
        cdef int slot = header if 0 <= header < HEADER_SLOTS - 1 else HEADER_SLOTS - 1
        self.traffic_messages[1][slot] += 1
        self.traffic_bytes[1][slot] += size

    cdef void _observe(self, uint64_t* buckets, double* total, double seconds) noexcept nogil:
        """One duration into a latency histogram: the first bucket whose bound it fits."""
        cdef int i = 0
        while i < N_LATENCY_BUCKETS and seconds > self.latency_bounds[i]:
            i += 1
        buckets[i] += 1
        total[0] += seconds

    cdef void _queue(self, uint32_t slot) noexcept nogil:
        """Append a new request to the submission-order list (request_timeout)."""
        self.older[slot] = self.newest
        self.newer[slot] = UINT32_MAX
        if self.newest != UINT32_MAX:
            self.newer[self.newest] = slot
        else:
            self.oldest = slot
        self.newest = slot

    cdef void _unqueue(self, uint32_t slot) noexcept nogil:
        cdef uint32_t older = self.older[slot], newer = self.newer[slot]
        if older != UINT32_MAX:
            self.newer[older] = newer
        else:
            self.oldest = newer
        if newer != UINT32_MAX:
            self.older[newer] = older
        else:
            self.newest = older

    cdef void _mark_gone(self, int rank, int reason) noexcept nogil:
        """Take ``rank`` out of the pool now; its requests are settled after the
        message at hand (see _settle), so a failure never recurses into routing."""
        if self.engines[rank].state == ENGINE_GONE:
            return
        if self.engines[rank].state == ENGINE_ALIVE:
            self.router.remove_rank_c(rank)
        self.engines[rank].state = ENGINE_GONE
        self.engines[rank].gone_reason = reason
        self.counters[COUNTER_ENGINE_FAILURES] += 1
        self.gone[self.n_gone] = rank
        self.n_gone += 1

    cdef int _send_identity(self, ck_ids* table, int32_t index) noexcept nogil:
        """Start a message to a peer; -1 when it is gone (ROUTER_MANDATORY)."""
        cdef size_t n
        cdef const uint8_t* identity = ck_ids_get(table, index, &n)
        return send_bytes(self.sock, identity, n, ZMQ_SNDMORE)

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
        else:
            self._refuse(client, None, ERROR_UNKNOWN_HEADER, header, COUNTER_UNKNOWN_HEADER)

    cdef _from_engine_rarely(self, int32_t engine, int64_t header):
        if header == HEADER_HEARTBEAT:
            self._heartbeat(engine)
        elif header == HEADER_ENGINE_HELLO:
            self._engine_hello(engine)
        elif header == HEADER_DISCONNECT:
            self._disconnect(engine)
        else:
            self.counters[COUNTER_UNKNOWN_HEADER] += 1
            self._log.warn(
                "unknown_header", f"dropped {header_name(header)} from engine {engine}"
            )

    cdef _register(self, int32_t engine):
        """An engine announced itself (one empty frame): a new rank, or one coming
        back after it left or was declared gone."""
        if engine >= 0 and self.engines[engine].state == ENGINE_ALIVE:
            self.counters[COUNTER_DUPLICATE_REGISTER] += 1
        else:
            self._new_engine(engine)

    cdef _engine_hello(self, int32_t engine):
        """ENGINE_HELLO: a coordkit engine registers, or says so once registered."""
        try:
            hello = parse_engine_hello(self._frames())
        except ProtocolError as exc:
            self._malformed(-1, None, HEADER_ENGINE_HELLO, str(exc))
            return
        if engine < 0 or self.engines[engine].state != ENGINE_ALIVE:
            engine = self._new_engine(engine)
        if engine >= 0:
            self.engines[engine].coordkit = hello.coordkit
            self.engines[engine].batch = hello.batch
            self.engines[engine].format = FORMAT_MULTIPART
            self._count_formats()

    cdef _count_formats(self):
        """How many engines not gone speak each format: which checks a SUBMIT needs."""
        cdef int rank
        self.n_single_engines = self.n_multipart_engines = 0
        for rank in range(self.n_engines):
            if self.engines[rank].state == ENGINE_GONE:
                continue
            if self.engines[rank].format == FORMAT_SINGLE_FRAME:
                self.n_single_engines += 1
            else:
                self.n_multipart_engines += 1

    cdef int32_t _new_engine(self, int32_t engine) except -2:
        """Put the sender in the pool: ``engine`` coming back, or a new rank (reusing
        a gone rank with nothing left in flight once the table is full). Its rank,
        or -1 when there is no room or the sender is a client."""
        cdef int32_t rank
        cdef size_t n = self._size(0)
        if engine < 0:
            if ck_ids_find(&self.client_ids, self._data(0), n) >= 0:
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
                ck_ids_remove(&self.engine_ids, rank)
            else:
                self.n_engines += 1
            self.engines[rank].last_heartbeat = 0.0
            self.engines[rank].drain_deadline = 0.0
            ck_ids_insert(&self.engine_ids, rank, self._data(0), n)
            engine = rank
        self.engines[engine].state = ENGINE_ALIVE
        self.engines[engine].coordkit = False
        self.engines[engine].batch = False
        self.engines[engine].format = (
            FORMAT_SINGLE_FRAME if self.megatron_core else FORMAT_MULTIPART
        )
        self.engines[engine].heartbeats = False
        self.router.add_rank(engine)
        self._count_formats()
        return engine

    cdef _connect(self, int32_t client):
        """CONNECT: a new client (or a repeated CONNECT), answered with CONNECT_ACK."""
        cdef int32_t index
        try:
            hello = parse_connect(self._frames())
        except ProtocolError as exc:
            self._malformed(-1, None, HEADER_CONNECT, str(exc))
            return
        if client >= 0:
            self.counters[COUNTER_DUPLICATE_CONNECT] += 1
            index = client
        else:
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
            ck_ids_insert(&self.client_ids, index, self._data(0), self._size(0))
            self.n_clients += 1
        self.clients[index].coordkit = hello.coordkit
        self.clients[index].batch = hello.batch
        self.clients[index].last_seen = self.messages
        self.clients[index].format = (
            FORMAT_SINGLE_FRAME if self.megatron_core and not hello.coordkit else FORMAT_MULTIPART
        )
        if hello.batch:
            self._reply_to_sender(protocol.CONNECT_ACK_BATCH.pack({BATCH_FEATURE: 1}))
        else:
            self._reply_to_sender(protocol.CONNECT_ACK.pack())

    cdef int32_t _vacant_client(self) except -2:
        """A free client index; when all are used, the idle client seen longest ago
        gives up its own; -1 when none is idle."""
        cdef int32_t index, idle = -1
        if self.n_clients < self.max_clients:
            for index in range(self.max_clients):
                if not self.clients[index].used:
                    return index
        for index in range(self.max_clients):
            if self.clients[index].used and self.clients[index].inflight == 0:
                if idle < 0 or self.clients[index].last_seen < self.clients[idle].last_seen:
                    idle = index
        if idle >= 0:
            self._remove_client(idle)
        return idle

    cdef _remove_client(self, int32_t client):
        ck_ids_remove(&self.client_ids, client)
        self.clients[client].used = False
        self.n_clients -= 1

    cdef _heartbeat(self, int32_t engine):
        if self._parse(protocol.HEARTBEAT, -1, HEADER_HEARTBEAT) is None:
            return
        if self.engines[engine].state != ENGINE_GONE:
            self.engines[engine].heartbeats = True
            self.engines[engine].last_heartbeat = monotonic()

    cdef _disconnect(self, int32_t engine):
        """DISCONNECT: no new work; its requests in flight may finish, for a while."""
        if self._parse(protocol.DISCONNECT, -1, HEADER_DISCONNECT) is None:
            return
        if self.engines[engine].state != ENGINE_ALIVE:
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
        if request.flags & FLAG_ABORTED:
            return
        request.flags |= FLAG_ABORTED
        self._abort_at_engine(request.rank, request.server_rid)

    cdef _abort_at_engine(self, int rank, int64_t server_rid):
        """ABORT_REQUEST to an engine; a 0.19 engine has none: the request runs to its end."""
        if self.engines[rank].format == FORMAT_SINGLE_FRAME:
            return
        abort = protocol.ABORT_REQUEST.pack(server_rid)
        if not self._send_frames(&self.engine_ids, rank, abort):
            self._mark_gone(rank, GONE_UNREACHABLE)

    cdef _release_kv(self, int32_t client):
        if self._parse(protocol.RELEASE_KV, client, HEADER_RELEASE_KV) is not None:
            self.counters[COUNTER_RELEASE_KV] += 1
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
        if self._parse(protocol.STATS, client, HEADER_STATS) is not None:
            if self.clients[client].coordkit:
                reply = protocol.STATS_REPLY.pack(packb(self.stats()))
                self._send_frames(&self.client_ids, client, reply)

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
            if header == HEADER_RELEASE_KV and self.engines[rank].format == FORMAT_SINGLE_FRAME:
                continue  # 0.19 has no KV transfer
            if self._send_identity(&self.engine_ids, rank) != 0:
                self._mark_gone(rank, GONE_UNREACHABLE)
            else:
                self._count_out(header, self._size(1))
                send_shared(self.sock, &self.parts[1], 0)

    cdef _detokenize(self, int part):
        """Replace a reply body frame by its detokenized copy."""
        cdef bytes body = self._detokenized(self._data(part), self._size(part))
        zmq_msg_close(&self.parts[part])
        zmq_msg_init_size(&self.parts[part], len(body))
        memcpy(zmq_msg_data(&self.parts[part]), <const char*>body, len(body))

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
        """Each request of a gone engine, by server id: re-sent when it produced
        nothing and was kept, otherwise ended with ERROR(ENGINE_FAILED)."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        cdef ck_request* request
        cdef int status
        reason = GONE_REASONS[self.engines[rank].gone_reason]
        self._log.warn("engine_failed", f"engine {rank} gone ({reason})")
        order = self._in_order(rank, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                request = &self.requests.pool[slot]
                if request.server_rid != order[i].server_rid or request.rank != rank:
                    continue  # ended meanwhile: its client went away
                self.router.release_c(rank, self.work[slot])
                request.rank = -1
                if request.flags & (FLAG_PRODUCED | FLAG_ABORTED) or request.kept == NULL:
                    self._fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
                    continue
                status = self._resend(slot)
                if status == ROUTE_SENT:
                    self.counters[COUNTER_REROUTED] += 1
                elif status == ROUTE_UNSENDABLE:  # no engine left that speaks its format
                    self._fail_request(slot, ERROR_ENGINE_FAILED, HEADER_SUBMIT_REQUEST)
                else:
                    self._fail_request(slot, refusal(status), HEADER_SUBMIT_REQUEST)
        finally:
            free(order)

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
        for slot in range(self.requests.used):
            request = &self.requests.pool[slot]
            if request.server_rid < 0:
                continue
            if (rank >= 0 and request.rank != rank) or (client >= 0 and request.client != client):
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
        self._forget(slot)
        self.failed[code] += 1
        if code == ERROR_ENGINE_FAILED:
            self.counters[COUNTER_ENGINE_FAILED] += 1
        if not self._send_error(client, rid, code, header):
            self._client_gone(client)

    cdef _time_out(self, uint32_t slot):
        """End a request in flight longer than request_timeout: ERROR(TIMED_OUT) to
        its client, ABORT to its engine (whose late final is then unknown, dropped)."""
        cdef ck_request* request = &self.requests.pool[slot]
        cdef int rank = request.rank
        self.counters[COUNTER_TIMED_OUT] += 1
        if not request.flags & FLAG_ABORTED and self.engines[rank].state != ENGINE_GONE:
            self._abort_at_engine(rank, request.server_rid)
        self._fail_request(slot, ERROR_TIMED_OUT, HEADER_SUBMIT_REQUEST)

    cdef _reject_entry(self, int32_t engine, object rid, int code, int64_t header):
        """An entry of an engine's batch that was not delivered: malformed ones are
        counted and logged, and a coordkit engine is told with an ERROR."""
        if code == ERROR_MALFORMED:
            self.counters[COUNTER_MALFORMED_ENTRIES] += 1
            what = f"malformed entry in {header_name(header)} from engine {engine}"
            self._log.warn("malformed", what)
        if self.engines[engine].coordkit:
            error = protocol.ERROR.pack(rid, code, error_text(code, header))
            if not self._send_frames(&self.engine_ids, engine, error):
                self._mark_gone(engine, GONE_UNREACHABLE)

    cdef _client_gone(self, int32_t client):
        """A client that cannot be reached: its requests are aborted at their
        engines and forgotten, and so is the client."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        cdef ck_request* request
        cdef int rank
        cdef bint aborted
        if not self.clients[client].used:
            return
        self.counters[COUNTER_CLIENT_GONE] += 1
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
        return [self._frame_bytes(part) for part in range(1, self.n_parts)]

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
        cdef size_t end
        if ck_read_header(<const uint8_t*><const char*>first, len(first), &header, &length, &end):
            header = -1
        self._count_out(header, sum(len(frame) for frame in frames))

    cdef bint _send_error(self, int32_t client, object rid, int code, int64_t header):
        """ERROR to a coordkit client (others cannot parse it); False when it is gone."""
        if not self.clients[client].coordkit:
            return True
        self.counters[COUNTER_ERRORS_SENT] += 1
        error = protocol.ERROR.pack(rid, code, error_text(code, header))
        return self._send_frames(&self.client_ids, client, error)

    cdef _refuse(self, int32_t client, object rid, int code, int64_t header, int counter):
        """Count a refused message and answer its client with ERROR(code)."""
        self.counters[counter] += 1
        self.refused[code] += 1
        if not self._send_error(client, rid, code, header):
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
