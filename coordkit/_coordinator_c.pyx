# cython: language_level=3, embedsignature=True
"""The Cython coordinator: the reference loop's decisions over raw libzmq.

pyzmq creates and configures the sockets; the loop takes their raw handles
and calls the libzmq that pyzmq loaded (see _libzmq.h). The hot path
(SUBMIT, ENGINE_REPLY, ENGINE_REPLY_PARTIAL) runs without the GIL and
without Python objects: frames are received into ``zmq_msg_t``, the metadata
frame is read and rewritten by the C codec, payload frames are sent on as
the same messages, and state lives in C tables. Rare paths (connects,
registrations, control, errors, failures, stats) take the GIL and share
their data and texts with the reference in coordkit._common.

Every decision, and its order, mirrors coordkit._coordinator_py; read that
file for the why of each step.
"""

cimport cython
from cpython.exc cimport PyErr_CheckSignals
from libc.errno cimport EINTR
from libc.stdint cimport UINT32_MAX, int32_t, int64_t, uint8_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort
from libc.string cimport memcmp, memcpy
from posix.time cimport CLOCK_MONOTONIC, clock_gettime, timespec

from coordkit._codec_c cimport (
    CK_HEADER_INT_MAX,
    CK_TOO_MANY,
    ck_entry,
    ck_read_header,
    ck_read_reply,
    ck_read_submit,
    ck_strstatus,
    ck_submit,
    ck_submit_size,
    ck_write_header_int,
    ck_write_submit,
)
from coordkit._libzmq cimport (
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
from coordkit._routing_c cimport Router

import threading

from coordkit import _codec_c
from coordkit._common import (
    CONTROL_TRANSITIONS,
    COPY_BELOW,
    MAX_PARTS,
    ControlState,
    Counter,
    LoopSockets,
    RateLimitedLog,
    build_stats,
    check_options,
    detokenize,
    error_frame,
    header_name,
    read_connect,
    table_size,
    valid_heartbeat,
)
from coordkit.protocol import BLOCK_HASH_SIZE, ErrorCode, Header, ProtocolError, packb

bind_libzmq()

__all__ = ["Coordinator"]

cdef extern from *:
    """
    #ifdef COORDKIT_DEBUG
    #define CK_DEBUG 1
    #else
    #define CK_DEBUG 0
    #endif
    """
    bint DEBUG "CK_DEBUG"


cdef enum:
    ALIVE = 0
    DRAINING = 1
    GONE = 2

cdef enum:  # Request.flags
    PRODUCED = 1
    ABORTED = 2

cdef enum:  # the headers the hot path reads
    H_CONNECT = 0
    H_SUBMIT = 20
    H_REPLY = 21
    H_PARTIAL = 22
    H_ABORT = 23
    H_SUBMIT_KV = 24
    H_RELEASE_KV = 25
    H_CONTROL_FIRST = 40
    H_CONTROL_LAST = 47
    H_EPOCH = 44
    H_DISCONNECT = 60
    H_SHUTDOWN = 61
    H_HEARTBEAT = 91
    H_STATS = 92

cdef enum:  # the same values as coordkit._common.Counter (checked at import)
    C_SUBMITTED = 0
    C_REPLIES = 1
    C_PARTIALS = 2
    C_ABORTS = 3
    C_RELEASE_KV = 4
    C_CONTROL = 5
    C_ERRORS_SENT = 6
    C_MALFORMED = 7
    C_UNKNOWN_HEADER = 8
    C_NOT_CONNECTED = 9
    C_UNKNOWN_REQUEST = 10
    C_DUPLICATE_REQUEST = 11
    C_BUSY = 12
    C_NO_ENGINES = 13
    C_INVALID_CONTROL = 14
    C_DUPLICATE_CONNECT = 15
    C_DUPLICATE_REGISTER = 16
    C_TABLE_FULL = 17
    C_REROUTED = 18
    C_ENGINE_FAILED = 19
    C_ENGINE_FAILURES = 20
    C_CLIENT_GONE = 21
    C_DETOKENIZED = 22
    C_DETOKENIZE_ERRORS = 23
    N_COUNTERS = 24

if N_COUNTERS != len(Counter) or C_DETOKENIZE_ERRORS != Counter.DETOKENIZE_ERRORS:
    raise ImportError("coordkit: _coordinator_c counters out of step with _common.Counter")

cdef enum:  # the ErrorCode values the hot path returns
    E_BUSY = 4
    E_NO_ENGINES = 6

cdef enum:
    N_MAX_PARTS = 1 << 16
    HASH_SIZE = 8
    KEEP_COPY_BELOW = 8192

if (
    E_BUSY != ErrorCode.BUSY
    or E_NO_ENGINES != ErrorCode.NO_ENGINES
    or N_MAX_PARTS != MAX_PARTS
    or HASH_SIZE != BLOCK_HASH_SIZE
    or KEEP_COPY_BELOW != COPY_BELOW
):
    raise ImportError("coordkit: _coordinator_c constants out of step with the Python ones")

cdef enum:
    IDENTITY_STRIDE = 256  # a ZeroMQ routing id is at most 255 bytes, plus its length
    TIMER_INTERVAL_MS = 50
    FIRST_PARTS = 64
    FIRST_ENTRIES = 64
    UNREACHABLE = -1


cdef struct Request:
    uint64_t tag  # server_rid + 1; 0 marks a free slot, so a zeroed table is empty
    int64_t client_rid
    int32_t client
    int32_t rank  # -1 while it is being re-routed or failed
    uint32_t flags
    Kept* kept  # what re-sends it if its engine dies; NULL: it is never re-sent


cdef struct Kept:
    # One allocation per kept request: this head, then either the metadata bytes
    # and the prompt's bytes, or (prompt_size == UINT32_MAX) a zmq_msg_t
    # sharing the prompt, then the metadata bytes.
    uint32_t meta_size
    uint32_t prompt_size


cdef struct Client:
    bint used
    bint coordkit
    int64_t inflight
    uint64_t last_seen


cdef struct Engine:
    int state
    bint heartbeats
    double last_heartbeat
    double drain_deadline


cdef struct IdTable:
    # Identity bytes -> table index: linear probing over index + 1 (0 = empty);
    # the identities themselves sit in `ids`, IDENTITY_STRIDE bytes per index.
    uint8_t* ids
    int32_t* slots
    uint32_t mask


cdef Kept* keep(zmq_msg_t* meta, zmq_msg_t* prompt) noexcept nogil:
    """What re-sends a request, or NULL when memory is short (it is then not kept).

    A prompt below KEEP_COPY_BELOW bytes is copied: a refcounted copy of a small
    frame would pin the whole receive buffer libzmq decoded it from (pyzmq's
    copy-below-a-threshold rule). A larger one has a buffer of its own: shared.
    """
    cdef size_t meta_size = zmq_msg_size(meta), prompt_size = zmq_msg_size(prompt)
    cdef bint shared = prompt_size >= KEEP_COPY_BELOW
    cdef Kept* kept = <Kept*>malloc(
        sizeof(Kept) + meta_size + (sizeof(zmq_msg_t) if shared else prompt_size)
    )
    cdef uint8_t* data
    if kept == NULL:
        return NULL
    kept.meta_size = meta_size
    data = <uint8_t*>(kept + 1)
    if shared:
        kept.prompt_size = UINT32_MAX
        zmq_msg_init(<zmq_msg_t*>data)
        zmq_msg_copy(<zmq_msg_t*>data, prompt)
        memcpy(data + sizeof(zmq_msg_t), zmq_msg_data(meta), meta_size)
    else:
        kept.prompt_size = prompt_size
        memcpy(data, zmq_msg_data(meta), meta_size)
        memcpy(data + meta_size, zmq_msg_data(prompt), prompt_size)
    return kept


cdef void send_kept(void* sock, Kept* kept) noexcept nogil:
    cdef uint8_t* data = <uint8_t*>(kept + 1)
    if kept.prompt_size == UINT32_MAX:
        send_copy(sock, data + sizeof(zmq_msg_t), kept.meta_size, ZMQ_SNDMORE)
        send_msg_copy(sock, <zmq_msg_t*>data, 0)
    else:
        send_copy(sock, data, kept.meta_size, ZMQ_SNDMORE)
        send_copy(sock, data + kept.meta_size, kept.prompt_size, 0)


cdef void release_kept(Kept* kept) noexcept nogil:
    if kept != NULL and kept.prompt_size == UINT32_MAX:
        zmq_msg_close(<zmq_msg_t*>(kept + 1))
    free(kept)


cdef struct RidSlot:  # for sorting requests by server id on the rare paths
    uint64_t tag
    uint32_t slot


cdef inline double monotonic() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline uint64_t mix64(uint64_t x) noexcept nogil:
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL
    return x ^ (x >> 31)


cdef inline uint32_t fnv1a(const uint8_t* data, size_t n) noexcept nogil:
    cdef uint32_t h = 2166136261u
    cdef size_t i
    for i in range(n):
        h = (h ^ data[i]) * 16777619u
    return h


cdef uint32_t pow2_at_least(uint64_t n) noexcept nogil:
    cdef uint32_t size = 1
    while size < n:
        size <<= 1
    return size


cdef int id_table_init(IdTable* t, uint32_t capacity) except -1:
    cdef uint32_t n_slots = pow2_at_least(2 * <uint64_t>capacity)
    t.ids = <uint8_t*>calloc(capacity, IDENTITY_STRIDE)
    t.slots = <int32_t*>calloc(n_slots, sizeof(int32_t))
    t.mask = n_slots - 1
    if t.ids == NULL or t.slots == NULL:
        raise MemoryError()
    return 0


cdef void id_table_free(IdTable* t) noexcept nogil:
    free(t.ids)
    free(t.slots)
    t.ids = NULL
    t.slots = NULL


cdef inline const uint8_t* id_bytes(IdTable* t, int32_t index) noexcept nogil:
    return t.ids + <size_t>index * IDENTITY_STRIDE


cdef inline uint32_t id_home(IdTable* t, int32_t index) noexcept nogil:
    cdef const uint8_t* stored = id_bytes(t, index)
    return fnv1a(stored + 1, stored[0]) & t.mask


cdef int32_t id_find(IdTable* t, const uint8_t* data, size_t n) noexcept nogil:
    cdef uint32_t pos = fnv1a(data, n) & t.mask
    cdef int32_t entry
    cdef const uint8_t* stored
    while True:
        entry = t.slots[pos]
        if entry == 0:
            return -1
        stored = id_bytes(t, entry - 1)
        if stored[0] == n and memcmp(stored + 1, data, n) == 0:
            return entry - 1
        pos = (pos + 1) & t.mask


cdef void id_insert(IdTable* t, int32_t index, const uint8_t* data, size_t n) noexcept nogil:
    cdef uint8_t* stored = t.ids + <size_t>index * IDENTITY_STRIDE
    stored[0] = <uint8_t>n
    memcpy(stored + 1, data, n)
    cdef uint32_t pos = fnv1a(data, n) & t.mask
    while t.slots[pos] != 0:
        pos = (pos + 1) & t.mask
    t.slots[pos] = index + 1


cdef void id_remove(IdTable* t, int32_t index) noexcept nogil:
    cdef uint32_t pos = id_home(t, index)
    while t.slots[pos] != index + 1:
        pos = (pos + 1) & t.mask
    # Backward-shift deletion keeps every probe chain unbroken without tombstones.
    cdef uint32_t hole = pos, j = pos, home
    while True:
        j = (j + 1) & t.mask
        if t.slots[j] == 0:
            break
        home = id_home(t, t.slots[j] - 1)
        if (hole <= j and hole < home <= j) or (hole > j and (home > hole or home <= j)):
            continue
        t.slots[hole] = t.slots[j]
        hole = j
    t.slots[hole] = 0


cdef object id_object(IdTable* t, int32_t index):
    cdef const uint8_t* stored = id_bytes(t, index)
    return stored[1:1 + stored[0]]


cdef int compare_tags(const void* a, const void* b) noexcept nogil:
    cdef uint64_t x = (<const RidSlot*>a).tag, y = (<const RidSlot*>b).tag
    return (x > y) - (x < y)


cdef inline int send_copy(void* sock, const void* data, size_t n, int flags) noexcept nogil:
    cdef zmq_msg_t msg
    zmq_msg_init_size(&msg, n)
    memcpy(zmq_msg_data(&msg), data, n)
    if zmq_msg_send(&msg, sock, flags) < 0:
        zmq_msg_close(&msg)
        return -1
    return 0


cdef inline int send_msg(void* sock, zmq_msg_t* msg, int flags) noexcept nogil:
    """Send ``msg`` itself: it is moved on success and left to the caller to close."""
    return 0 if zmq_msg_send(msg, sock, flags) >= 0 else -1


cdef inline int send_msg_copy(void* sock, zmq_msg_t* msg, int flags) noexcept nogil:
    """Send a refcounted copy of ``msg``, keeping ours (the pyzmq rule for re-sends)."""
    cdef zmq_msg_t copy
    zmq_msg_init(&copy)
    zmq_msg_copy(&copy, msg)
    if zmq_msg_send(&copy, sock, flags) < 0:
        zmq_msg_close(&copy)
        return -1
    return 0


@cython.final
cdef class Coordinator:
    """A data-parallel coordinator bound to ``bind`` (Cython implementation)."""

    implementation = "c"

    cdef readonly str address
    cdef readonly str policy
    cdef readonly int64_t max_inflight
    cdef readonly double heartbeat_timeout
    cdef readonly double drain_timeout
    cdef readonly int max_clients
    cdef readonly int max_engines

    cdef object _sockets, _thread, _log
    cdef object _detokenizer
    cdef bint has_detokenizer
    cdef readonly bint keep_prompts
    cdef void* sock
    cdef void* wake
    cdef Router router
    cdef bint running, started

    cdef Request* requests
    cdef uint64_t mask
    cdef uint64_t next_rid
    cdef int64_t inflight
    cdef uint32_t* by_client  # (client, client_rid) -> request slot + 1, linear probing
    cdef uint64_t by_client_mask

    cdef Client* clients
    cdef IdTable client_ids
    cdef int n_clients
    cdef Engine* engines
    cdef IdTable engine_ids
    cdef int n_engines

    cdef int control_state
    cdef uint64_t counters[N_COUNTERS]
    cdef uint64_t tick
    cdef uint64_t debug_polls  # DEBUG builds: loop wake-ups, against the messages handled

    cdef zmq_msg_t* parts
    cdef int n_parts
    cdef bint oversized  # the message had more than MAX_PARTS frames: malformed
    cdef int parts_cap
    cdef ck_entry* entries
    cdef uint32_t entries_cap

    def __cinit__(self):
        self.requests = NULL
        self.by_client = NULL
        self.clients = NULL
        self.engines = NULL
        self.parts = NULL
        self.entries = NULL

    def __init__(
        self,
        str bind="ipc:///tmp/coordkit.sock",
        *,
        str policy="least_loaded",
        int64_t max_inflight=1_000_000,
        int64_t max_inflight_per_engine=0,
        double heartbeat_timeout=10.0,
        double drain_timeout=30.0,
        int64_t max_message_size=256 << 20,
        detokenizer=None,
        uint64_t seed=0,
        double prefix_alpha=1.0,
        double prefix_ttl=600.0,
        int prefix_max_entries=1_000_000,
        int max_clients=65536,
        int max_engines=1024,
        bint keep_prompts=True,
        context=None,
    ):
        check_options(
            max_inflight=max_inflight,
            max_inflight_per_engine=max_inflight_per_engine,
            heartbeat_timeout=heartbeat_timeout,
            drain_timeout=drain_timeout,
            max_message_size=max_message_size,
            max_clients=max_clients,
            max_engines=max_engines,
        )
        self.policy = policy
        self.max_inflight = max_inflight
        self.heartbeat_timeout = heartbeat_timeout
        self.drain_timeout = drain_timeout
        self.max_clients = max_clients
        self.max_engines = max_engines
        self._detokenizer = detokenizer
        self.has_detokenizer = detokenizer is not None
        self.keep_prompts = keep_prompts
        self._log = RateLimitedLog()
        self.router = Router(
            policy,
            max_engines,
            seed=seed,
            rank_cap=max_inflight_per_engine,
            prefix_alpha=prefix_alpha,
            prefix_ttl=prefix_ttl,
            prefix_max_entries=prefix_max_entries,
        )
        cdef uint64_t n_slots = table_size(max_inflight)
        self.mask = n_slots - 1
        # calloc: untouched pages of an idle table cost no resident memory.
        self.requests = <Request*>calloc(n_slots, sizeof(Request))
        self.by_client_mask = 2 * n_slots - 1
        self.by_client = <uint32_t*>calloc(2 * n_slots, sizeof(uint32_t))
        self.clients = <Client*>calloc(max_clients, sizeof(Client))
        self.engines = <Engine*>calloc(max_engines, sizeof(Engine))
        self.parts_cap = FIRST_PARTS
        self.parts = <zmq_msg_t*>malloc(FIRST_PARTS * sizeof(zmq_msg_t))
        self.entries_cap = FIRST_ENTRIES
        self.entries = <ck_entry*>malloc(FIRST_ENTRIES * sizeof(ck_entry))
        if (
            self.requests == NULL or self.by_client == NULL or self.clients == NULL
            or self.engines == NULL or self.parts == NULL or self.entries == NULL
        ):
            raise MemoryError()
        id_table_init(&self.client_ids, max_clients)
        id_table_init(&self.engine_ids, max_engines)
        self.control_state = ControlState.RUNNING

        self._sockets = LoopSockets(bind, max_message_size, context)
        self.address = self._sockets.address
        self.sock = <void*><size_t>self._sockets.router.underlying
        self.wake = <void*><size_t>self._sockets.wake_recv.underlying

    def __dealloc__(self):
        cdef uint64_t slot
        if self.requests != NULL:
            for slot in range(self.mask + 1):
                if self.requests[slot].tag:
                    release_kept(self.requests[slot].kept)
        free(self.requests)
        free(self.by_client)
        free(self.clients)
        free(self.engines)
        free(self.parts)
        free(self.entries)
        id_table_free(&self.client_ids)
        id_table_free(&self.engine_ids)

    # -- lifecycle -----------------------------------------------------------------

    def serve_forever(self):
        """Run the loop until SHUTDOWN or :meth:`stop`; then close the sockets.

        The loop releases the GIL; it takes it back only on rare paths.
        """
        if self._sockets.closed:
            raise RuntimeError("coordinator is closed")
        self.running = self.started = True
        try:
            with nogil:
                self._serve()
        finally:
            self._finish()

    def start(self):
        """Run :meth:`serve_forever` on a background thread."""
        if self._thread is not None:
            raise RuntimeError("coordinator already started")
        self._thread = threading.Thread(target=self.serve_forever, name="coordkit", daemon=True)
        self._thread.start()

    def stop(self, timeout=10.0):
        """Stop the loop (from any thread) and wait for it when it runs on ours."""
        if not self.started:
            self._finish()
            return
        self._sockets.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    cdef _finish(self):
        cdef uint32_t i, n
        cdef RidSlot* order
        if self._sockets.closed:
            return
        order = self._sorted_requests(-1, -1, &n)
        try:
            for i in range(n):
                if self.requests[order[i].slot].tag == order[i].tag:
                    self._fail(order[i].slot, ErrorCode.SHUTTING_DOWN, Header.SHUTDOWN)
        finally:
            free(order)
        self._sockets.close()

    # -- stats ---------------------------------------------------------------------

    def stats(self):
        cdef int rank
        result = build_stats(
            implementation=self.implementation,
            policy=self.policy,
            messages=self.tick,
            inflight=self.inflight,
            clients=self.n_clients,
            control_state=self.control_state,
            counters=[self.counters[i] for i in range(N_COUNTERS)],
            engines=[
                (
                    rank,
                    id_object(&self.engine_ids, rank),
                    self.engines[rank].state,
                    self.router.pending(rank),
                )
                for rank in range(self.n_engines)
            ],
        )
        if DEBUG:
            result["debug"] = {"polls": self.debug_polls}
        return result

    # -- the loop ------------------------------------------------------------------

    cdef int _serve(self) except -1 nogil:
        cdef zmq_pollitem_t items[2]
        cdef zmq_msg_t wake
        cdef double now, next_timer = monotonic() + TIMER_INTERVAL_MS * 1e-3
        items[0].socket = self.sock
        items[0].fd = 0
        items[0].events = ZMQ_POLLIN
        items[1].socket = self.wake
        items[1].fd = 0
        items[1].events = ZMQ_POLLIN
        while self.running:
            if zmq_poll(items, 2, TIMER_INTERVAL_MS) < 0:
                if zmq_errno() == EINTR:
                    with gil:
                        PyErr_CheckSignals()  # lets SIGINT / SIGTERM handlers run
                    continue
                return 0  # the context was terminated
            if DEBUG:
                self.debug_polls += 1
            if items[1].revents & ZMQ_POLLIN:
                zmq_msg_init(&wake)
                zmq_msg_recv(&wake, self.wake, ZMQ_DONTWAIT)
                zmq_msg_close(&wake)
                self.running = False
                break
            if items[0].revents & ZMQ_POLLIN:
                self._drain()
            now = monotonic()
            if now >= next_timer:
                with gil:
                    self._run_timers(now)
                next_timer = now + TIMER_INTERVAL_MS * 1e-3
        return 0

    cdef void _drain(self) noexcept nogil:
        cdef int i
        while self.running and self._recv_message():
            self.tick += 1
            self._handle()
            for i in range(self.n_parts):
                zmq_msg_close(&self.parts[i])
            self.n_parts = 0

    cdef bint _recv_message(self) noexcept nogil:
        """Receive every frame of the next message into ``parts``; False if none."""
        cdef zmq_msg_t* grown
        cdef int i
        zmq_msg_init(&self.parts[0])
        if zmq_msg_recv(&self.parts[0], self.sock, ZMQ_DONTWAIT) < 0:
            zmq_msg_close(&self.parts[0])
            return False
        self.n_parts = 1
        self.oversized = False
        while zmq_msg_more(&self.parts[self.n_parts - 1]):
            if self.n_parts == N_MAX_PARTS:
                break
            if self.n_parts == self.parts_cap:
                grown = <zmq_msg_t*>malloc(2 * self.parts_cap * sizeof(zmq_msg_t))
                if grown == NULL:
                    break
                for i in range(self.n_parts):
                    zmq_msg_init(&grown[i])
                    zmq_msg_move(&grown[i], &self.parts[i])
                free(self.parts)
                self.parts = grown
                self.parts_cap *= 2
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

    cdef inline const uint8_t* _data(self, int i) noexcept nogil:
        return <const uint8_t*>zmq_msg_data(&self.parts[i])

    cdef inline size_t _size(self, int i) noexcept nogil:
        return zmq_msg_size(&self.parts[i])

    cdef void _handle(self) noexcept nogil:
        cdef const uint8_t* identity = self._data(0)
        cdef size_t identity_len = self._size(0)
        cdef int32_t engine = id_find(&self.engine_ids, identity, identity_len)
        cdef int32_t client
        cdef int64_t header
        cdef uint32_t length
        cdef size_t end
        if self.n_parts == 2 and self._size(1) == 0:
            with gil:
                self._register(engine)
            return
        client = id_find(&self.client_ids, identity, identity_len)
        if self.oversized or ck_read_header(self._data(1), self._size(1), &header, &length, &end) != 0:
            with gil:
                self._bad(None, ErrorCode.MALFORMED, -1, "malformed metadata frame", client)
            return
        if engine >= 0:
            self._from_engine(engine, header, length, end)
        elif header == H_CONNECT:
            with gil:
                self._connect(client, length, end)
        elif client < 0:
            self.counters[C_NOT_CONNECTED] += 1
            with gil:
                self._log.warn(
                    "not_connected",
                    f"dropped {header_name(header)} from a peer that never connected",
                )
        else:
            self.clients[client].last_seen = self.tick
            self._from_client(client, header, length, end)

    cdef void _from_engine(
        self, int32_t engine, int64_t header, uint32_t length, size_t end
    ) noexcept nogil:
        if header == H_REPLY or header == H_PARTIAL:
            self._reply(engine)
            return
        with gil:
            if header == H_HEARTBEAT:
                self._heartbeat(engine)
            elif header == H_DISCONNECT:
                if self._exact(length, end):
                    self._disconnect(engine)
                else:
                    self._bad(None, ErrorCode.MALFORMED, header, "bad DISCONNECT", -1)
            else:
                self.counters[C_UNKNOWN_HEADER] += 1
                self._log.warn(
                    "unknown_header", f"dropped {header_name(header)} from engine {engine}"
                )

    cdef void _from_client(
        self, int32_t client, int64_t header, uint32_t length, size_t end
    ) noexcept nogil:
        if header == H_SUBMIT or header == H_SUBMIT_KV:
            self._submit(client, header)
            return
        with gil:
            if header == H_ABORT:
                self._abort(client)
            elif header == H_RELEASE_KV:
                if self._read_rid(client, header) is not None:
                    self.counters[C_RELEASE_KV] += 1
                    self._broadcast()
            elif H_CONTROL_FIRST <= header <= H_CONTROL_LAST:
                self._control(client, header, length, end)
            elif header == H_SHUTDOWN:
                if self._simple(client, header, length, end):
                    self.running = False
            elif header == H_STATS:
                if self._simple(client, header, length, end) and self.clients[client].coordkit:
                    self._send_py(&self.client_ids, client, [packb([Header.STATS_REPLY]), packb(self.stats())])
            else:
                self.counters[C_UNKNOWN_HEADER] += 1
                self._error(client, None, ErrorCode.UNKNOWN_HEADER, header)

    # -- peers (rare: with the GIL) ----------------------------------------------------

    cdef _register(self, int32_t engine):
        cdef int32_t rank
        identity = bytes(self._data(0)[:self._size(0)])
        if engine >= 0:
            if self.engines[engine].state == ALIVE:
                self.counters[C_DUPLICATE_REGISTER] += 1
                return
            self.engines[engine].state = ALIVE
            self.engines[engine].heartbeats = False
            self.router.add_rank(engine)
            return
        if id_find(&self.client_ids, self._data(0), self._size(0)) >= 0:
            self._bad(None, ErrorCode.MALFORMED, -1, "a client sent an engine registration", -1)
            return
        rank = self.n_engines
        if rank == self.max_engines:
            rank = -1
            for engine in range(self.n_engines):
                if self.engines[engine].state == GONE and self.router.pending(engine) == 0:
                    rank = engine
                    break
            if rank < 0:
                self.counters[C_TABLE_FULL] += 1
                self._log.warn("engines_full", "engine table full: registration dropped")
                return
            id_remove(&self.engine_ids, rank)
        else:
            self.n_engines += 1
        self.engines[rank].state = ALIVE
        self.engines[rank].heartbeats = False
        self.engines[rank].last_heartbeat = 0.0
        self.engines[rank].drain_deadline = 0.0
        id_insert(&self.engine_ids, rank, self._data(0), self._size(0))
        self.router.add_rank(rank)

    cdef _connect(self, int32_t client, uint32_t length, size_t end):
        cdef int32_t index
        coordkit = read_connect(self.n_parts - 1, self._frame_bytes(1), length, end)
        if coordkit is None:
            self._bad(None, ErrorCode.MALFORMED, Header.CONNECT, "bad CONNECT", -1)
            return
        if client >= 0:
            self.counters[C_DUPLICATE_CONNECT] += 1
            self.clients[client].coordkit = coordkit
            self.clients[client].last_seen = self.tick
            index = client
        else:
            index = self._free_client_index()
            if index < 0:
                self.counters[C_TABLE_FULL] += 1
                if coordkit:
                    self.counters[C_ERRORS_SENT] += 1
                    self._send_identity_py([error_frame(None, ErrorCode.BUSY, Header.CONNECT)])
                return
            self.clients[index].used = True
            self.clients[index].coordkit = coordkit
            self.clients[index].inflight = 0
            self.clients[index].last_seen = self.tick
            id_insert(&self.client_ids, index, self._data(0), self._size(0))
            self.n_clients += 1
        self._send_identity_py([_codec_c.write_header(Header.CONNECT_ACK)])

    cdef int32_t _free_client_index(self):
        """A free client slot; when full, the idle client seen longest ago gives up its own."""
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
        id_remove(&self.client_ids, client)
        self.clients[client].used = False
        self.n_clients -= 1

    cdef _heartbeat(self, int32_t engine):
        try:
            metadata = _codec_c.decode(self._frame_bytes(1))
        except ProtocolError:
            metadata = None
        if not valid_heartbeat(self.n_parts - 1, metadata):
            self._bad(None, ErrorCode.MALFORMED, Header.HEARTBEAT, "bad HEARTBEAT", -1)
            return
        if self.engines[engine].state != GONE:
            self.engines[engine].heartbeats = True
            self.engines[engine].last_heartbeat = monotonic()

    cdef _disconnect(self, int32_t engine):
        if self.engines[engine].state != ALIVE:
            return
        self.router.remove_rank(engine)
        self.engines[engine].state = DRAINING
        self.engines[engine].drain_deadline = monotonic() + self.drain_timeout
        if self.router.pending(engine) == 0:
            self.engines[engine].state = GONE

    cdef _run_timers(self, double now):
        cdef int rank
        for rank in range(self.n_engines):
            if self.engines[rank].state == GONE:
                continue
            if self.engines[rank].state == DRAINING and now >= self.engines[rank].drain_deadline:
                self._engine_failed(rank, "drain timed out")
            elif (
                self.heartbeat_timeout
                and self.engines[rank].heartbeats
                and now - self.engines[rank].last_heartbeat > self.heartbeat_timeout
            ):
                self._engine_failed(rank, "no heartbeat")

    # -- requests (the hot path: no GIL) -----------------------------------------------

    cdef void _submit(self, int32_t client, int64_t header) noexcept nogil:
        cdef ck_submit prefix
        cdef int status = ck_read_submit(self._data(1), self._size(1), &prefix)
        cdef int n_payload = 1 if header == H_SUBMIT else 2
        cdef int n_frames = self.n_parts - 2
        cdef const uint8_t* hashes = NULL
        cdef size_t n_hashes = 0
        cdef uint64_t server_rid
        cdef uint32_t slot
        cdef Request* request
        cdef int rank
        cdef zmq_msg_t meta
        if status != 0:
            with gil:
                self._bad_submit(client, header, status, &prefix)
            return
        if n_frames == n_payload + 1:
            hashes = self._data(2 + n_payload)
            n_hashes = self._size(2 + n_payload) // HASH_SIZE
        if (
            prefix.length != <uint32_t>(2 + n_payload)
            or not n_payload <= n_frames <= n_payload + 1
            or (hashes != NULL and self._size(2 + n_payload) % HASH_SIZE)
        ):
            with gil:
                self._bad(prefix.rid, ErrorCode.MALFORMED, header, "bad frame layout", client)
            return
        if self._find_by_client(client, prefix.rid) >= 0:
            with gil:
                self._reject(client, prefix.rid, ErrorCode.DUPLICATE_REQUEST, header, C_DUPLICATE_REQUEST)
            return
        if self.inflight >= self.max_inflight:
            with gil:
                self._reject(client, prefix.rid, ErrorCode.BUSY, header, C_BUSY)
            return
        server_rid = self._allocate_rid()
        slot = server_rid & self.mask
        request = &self.requests[slot]
        request.client = client
        request.client_rid = prefix.rid
        request.flags = 0
        # The rewritten metadata goes out as a new message; the payload frames as themselves.
        self._rewrite(&meta, &prefix, server_rid)
        # A KV submission's source blocks are tied to the engine chosen now: never re-sent.
        request.kept = keep(&meta, &self.parts[2]) if header == H_SUBMIT and self.keep_prompts else NULL
        rank = self._route(slot, hashes, n_hashes, &meta, &self.parts[2], n_payload)
        zmq_msg_close(&meta)
        if rank < 0:
            release_kept(request.kept)
            request.kept = NULL
            with gil:
                if rank == -E_NO_ENGINES:
                    self._reject(client, prefix.rid, ErrorCode.NO_ENGINES, header, C_NO_ENGINES)
                else:
                    self._reject(client, prefix.rid, ErrorCode.BUSY, header, C_BUSY)
            return
        request.tag = server_rid + 1
        self._insert_by_client(slot)
        self.clients[client].inflight += 1
        self.inflight += 1
        self.counters[C_SUBMITTED] += 1

    cdef void _rewrite(self, zmq_msg_t* out, ck_submit* prefix, uint64_t server_rid) noexcept nogil:
        """The SUBMIT metadata with ``server_rid``, written straight into a new message."""
        cdef size_t rest_len = self._size(1) - prefix.offset
        zmq_msg_init_size(out, ck_submit_size(prefix, server_rid, rest_len))
        ck_write_submit(
            <uint8_t*>zmq_msg_data(out), prefix, server_rid, self._data(1) + prefix.offset, rest_len
        )

    cdef uint64_t _allocate_rid(self) noexcept nogil:
        cdef uint64_t rid = self.next_rid
        while self.requests[rid & self.mask].tag:
            rid += 1
        self.next_rid = rid + 1
        return rid

    cdef int _route(
        self,
        uint32_t slot,
        const uint8_t* hashes,
        size_t n_hashes,
        zmq_msg_t* meta,
        zmq_msg_t* payload,
        int n_payload,
    ) noexcept nogil:
        """Choose a rank and send the request at ``slot`` there: its rank, or -ErrorCode.

        A new request sends ``meta`` and its ``payload`` frames as themselves; a
        re-send (``meta`` NULL) sends what the request kept.
        """
        cdef Request* request = &self.requests[slot]
        cdef int rank, i
        while True:
            rank = self.router.choose_c(hashes, n_hashes, monotonic())
            if rank < 0:
                return -E_NO_ENGINES if self.router.n_members == 0 else -E_BUSY
            request.rank = rank
            if self._send_identity(&self.engine_ids, rank) == 0:
                break
            self.router.release_c(rank)
            request.rank = -1  # so failing that engine does not settle this request too
            with gil:
                self._engine_failed(rank, "unreachable")
        if meta == NULL:
            send_kept(self.sock, request.kept)
            return rank
        send_msg(self.sock, meta, ZMQ_SNDMORE)
        for i in range(n_payload):
            send_msg(self.sock, &payload[i], ZMQ_SNDMORE if i + 1 < n_payload else 0)
        return rank

    cdef inline int _send_identity(self, IdTable* table, int32_t index) noexcept nogil:
        cdef const uint8_t* stored = id_bytes(table, index)
        return send_copy(self.sock, stored + 1, stored[0], ZMQ_SNDMORE)

    cdef inline int64_t _lookup(self, int64_t server_rid) noexcept nogil:
        """The slot of a request in flight, or -1."""
        if server_rid < 0 or self.requests[server_rid & self.mask].tag != <uint64_t>server_rid + 1:
            return -1
        return server_rid & self.mask

    cdef inline uint64_t _by_client_home(self, int32_t client, int64_t rid) noexcept nogil:
        return mix64(<uint64_t>rid * 0x9E3779B97F4A7C15ULL ^ <uint64_t>client) & self.by_client_mask

    cdef int64_t _find_by_client(self, int32_t client, int64_t rid) noexcept nogil:
        cdef uint64_t pos = self._by_client_home(client, rid)
        cdef uint32_t entry
        cdef Request* request
        while True:
            entry = self.by_client[pos]
            if entry == 0:
                return -1
            request = &self.requests[entry - 1]
            if request.client == client and request.client_rid == rid:
                return entry - 1
            pos = (pos + 1) & self.by_client_mask

    cdef void _insert_by_client(self, uint32_t slot) noexcept nogil:
        cdef Request* request = &self.requests[slot]
        cdef uint64_t pos = self._by_client_home(request.client, request.client_rid)
        while self.by_client[pos] != 0:
            pos = (pos + 1) & self.by_client_mask
        self.by_client[pos] = slot + 1

    cdef void _remove_by_client(self, uint32_t slot) noexcept nogil:
        cdef Request* request = &self.requests[slot]
        cdef uint64_t pos = self._by_client_home(request.client, request.client_rid)
        cdef uint64_t hole, j, home
        while self.by_client[pos] != slot + 1:
            pos = (pos + 1) & self.by_client_mask
        hole = j = pos
        while True:
            j = (j + 1) & self.by_client_mask
            if self.by_client[j] == 0:
                break
            request = &self.requests[self.by_client[j] - 1]
            home = self._by_client_home(request.client, request.client_rid)
            if (hole <= j and hole < home <= j) or (hole > j and (home > hole or home <= j)):
                continue
            self.by_client[hole] = self.by_client[j]
            hole = j
        self.by_client[hole] = 0

    cdef void _free(self, uint32_t slot) noexcept nogil:
        cdef Request* request = &self.requests[slot]
        cdef int rank = request.rank
        self._remove_by_client(slot)
        release_kept(request.kept)
        request.kept = NULL
        request.tag = 0
        self.clients[request.client].inflight -= 1
        self.inflight -= 1
        if rank < 0:
            return
        self.router.release_c(rank)
        if self.engines[rank].state == DRAINING and self.router.pending_count[rank] == 0:
            self.engines[rank].state = GONE

    cdef void _reply(self, int32_t engine) noexcept nogil:
        cdef int64_t header
        cdef uint32_t count, i
        cdef int status = ck_read_reply(
            self._data(1), self._size(1), &header, self.entries, self.entries_cap, &count
        )
        cdef ck_entry* grown
        cdef int64_t slot
        cdef int32_t client
        cdef int64_t client_rid
        cdef bint final
        cdef uint8_t out[CK_HEADER_INT_MAX]
        cdef size_t n
        if status == CK_TOO_MANY:
            grown = <ck_entry*>malloc(count * sizeof(ck_entry))
            if grown != NULL:
                free(self.entries)
                self.entries = grown
                self.entries_cap = count
                status = ck_read_reply(
                    self._data(1), self._size(1), &header, self.entries, self.entries_cap, &count
                )
        if status != 0:
            with gil:
                self._bad(None, ErrorCode.MALFORMED, -1, "bad ENGINE_REPLY metadata", -1)
            return
        if count != <uint32_t>(self.n_parts - 2):
            with gil:
                self._bad(
                    None,
                    ErrorCode.MALFORMED,
                    header,
                    f"{count} entries but {self.n_parts - 2} payload frames",
                    -1,
                )
            return
        final = header == H_REPLY
        for i in range(count):
            slot = self._lookup(self.entries[i].rid)
            if slot < 0 or self.requests[slot].rank != engine:
                self.counters[C_UNKNOWN_REQUEST] += 1
                continue
            client = self.requests[slot].client
            client_rid = self.requests[slot].client_rid
            if final:
                self._free(slot)
                self.counters[C_REPLIES] += 1
            else:
                self.requests[slot].flags |= PRODUCED
                self.counters[C_PARTIALS] += 1
            if self.entries[i].needs_detokenize and self.has_detokenizer:
                with gil:
                    self._detokenize(2 + i)
            n = ck_write_header_int(out, header, client_rid)
            if self._send_identity(&self.client_ids, client) != 0:
                with gil:
                    self._client_gone(client)
                continue
            send_copy(self.sock, out, n, ZMQ_SNDMORE)
            send_msg(self.sock, &self.parts[2 + i], 0)

    cdef _detokenize(self, int part):
        cdef bytes body
        try:
            body = detokenize(self._detokenizer, self._frame_bytes(part))
        except Exception as exc:  # a bad body or a failing detokenizer: forward it untouched
            self.counters[C_DETOKENIZE_ERRORS] += 1
            self._log.warn("detokenize", f"detokenize failed, body forwarded as is: {exc!r}")
            return
        self.counters[C_DETOKENIZED] += 1
        zmq_msg_close(&self.parts[part])
        zmq_msg_init_size(&self.parts[part], len(body))
        memcpy(zmq_msg_data(&self.parts[part]), <const char*>body, len(body))

    # -- client requests on rare paths (with the GIL) ------------------------------------

    cdef _abort(self, int32_t client):
        cdef int64_t slot
        cdef uint8_t out[CK_HEADER_INT_MAX]
        cdef size_t n
        cdef int rank
        rid = self._read_rid(client, Header.ABORT_REQUEST)
        if rid is None:
            return
        slot = self._find_by_client(client, rid)
        if slot < 0:
            self._reject(client, rid, ErrorCode.UNKNOWN_REQUEST, Header.ABORT_REQUEST, C_UNKNOWN_REQUEST)
            return
        self.counters[C_ABORTS] += 1
        if self.requests[slot].flags & ABORTED:
            return
        self.requests[slot].flags |= ABORTED
        rank = self.requests[slot].rank
        n = ck_write_header_int(out, Header.ABORT_REQUEST, self.requests[slot].tag - 1)
        if self._send_identity(&self.engine_ids, rank) != 0:
            self._engine_failed(rank, "unreachable")
            return
        send_copy(self.sock, out, n, 0)

    cdef object _read_rid(self, int32_t client, int64_t header):
        """The rid of a ``[header, rid]`` message, or None after answering it as malformed."""
        cdef ck_submit prefix
        cdef int status = ck_read_submit(self._data(1), self._size(1), &prefix)
        if status != 0:
            self._bad_submit(client, header, status, &prefix)
            return None
        if prefix.length != 2 or self.n_parts != 2:
            self._bad(prefix.rid, ErrorCode.MALFORMED, header, "bad layout", client)
            return None
        return prefix.rid

    cdef _control(self, int32_t client, int64_t header, uint32_t length, size_t end):
        if header == H_EPOCH:
            if self._read_rid(client, header) is None:
                return
        elif not self._simple(client, header, length, end):
            return
        state = CONTROL_TRANSITIONS.get((self.control_state, header))
        if state is None:
            self._reject(client, None, ErrorCode.INVALID_STATE, header, C_INVALID_CONTROL)
            return
        self.counters[C_CONTROL] += 1
        self.control_state = state
        self._broadcast()

    cdef bint _simple(self, int32_t client, int64_t header, uint32_t length, size_t end):
        """Whether a ``[header]`` message is exactly that; answers it as malformed if not."""
        if self._exact(length, end):
            return True
        self._bad(None, ErrorCode.MALFORMED, header, "expected [header]", client)
        return False

    cdef bint _exact(self, uint32_t length, size_t end):
        return self.n_parts == 2 and length == 1 and end == self._size(1)

    cdef _broadcast(self):
        """Send the metadata frame as is (refcounted copies) to every engine not gone."""
        cdef int rank
        unreachable = []
        for rank in range(self.n_engines):
            if self.engines[rank].state == GONE:
                continue
            if self._send_identity(&self.engine_ids, rank) != 0:
                unreachable.append(rank)
                continue
            send_msg_copy(self.sock, &self.parts[1], 0)
        for rank in unreachable:
            self._engine_failed(rank, "unreachable")

    # -- failures ------------------------------------------------------------------------

    cdef RidSlot* _sorted_requests(self, int rank, int32_t client, uint32_t* count) except NULL:
        """Requests in flight (of ``rank`` / ``client`` when >= 0) by increasing server id."""
        cdef RidSlot* order = <RidSlot*>malloc((self.inflight + 1) * sizeof(RidSlot))
        cdef uint64_t slot
        cdef uint32_t n = 0
        if order == NULL:
            raise MemoryError()
        for slot in range(self.mask + 1):
            if not self.requests[slot].tag:
                continue
            if rank >= 0 and self.requests[slot].rank != rank:
                continue
            if client >= 0 and self.requests[slot].client != client:
                continue
            order[n].tag = self.requests[slot].tag
            order[n].slot = slot
            n += 1
        qsort(order, n, sizeof(RidSlot), compare_tags)
        count[0] = n
        return order

    cdef _engine_failed(self, int rank, str reason):
        """Take ``rank`` out of the pool; re-send or fail what it held."""
        cdef uint32_t i, n, slot
        cdef RidSlot* order
        cdef Request* request
        cdef int routed
        if self.engines[rank].state == GONE:
            return
        self.counters[C_ENGINE_FAILURES] += 1
        self._log.warn("engine_failed", f"engine {rank} gone ({reason})")
        if self.engines[rank].state == ALIVE:
            self.router.remove_rank(rank)
        self.engines[rank].state = GONE
        order = self._sorted_requests(rank, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                request = &self.requests[slot]
                if request.tag != order[i].tag or request.rank != rank:
                    continue  # settled by a nested failure meanwhile
                self.router.release_c(rank)
                request.rank = -1
                if request.flags & (PRODUCED | ABORTED) or request.kept == NULL:
                    self._fail(slot, ErrorCode.ENGINE_FAILED, Header.SUBMIT_REQUEST)
                    continue
                routed = self._route(slot, NULL, 0, NULL, NULL, 0)
                if routed >= 0:
                    self.counters[C_REROUTED] += 1
                else:
                    self._fail(slot, ErrorCode(-routed), Header.SUBMIT_REQUEST)
        finally:
            free(order)

    cdef _fail(self, uint32_t slot, code, int64_t header):
        """End the request at ``slot`` with ERROR(code): its one terminal reply."""
        cdef int32_t client = self.requests[slot].client
        rid = self.requests[slot].client_rid
        self._free(slot)
        if code == ErrorCode.ENGINE_FAILED:
            self.counters[C_ENGINE_FAILED] += 1
        if not self._error(client, rid, code, header):
            self._client_gone(client)

    cdef _client_gone(self, int32_t client):
        """A client that cannot be reached: abort its requests at their engines, forget it."""
        cdef uint32_t i, n, slot
        cdef RidSlot* order
        cdef int rank
        cdef uint8_t out[CK_HEADER_INT_MAX]
        cdef size_t size
        cdef bint aborted
        if not self.clients[client].used:
            return
        self.counters[C_CLIENT_GONE] += 1
        order = self._sorted_requests(-1, client, &n)
        unreachable = []
        try:
            for i in range(n):
                slot = order[i].slot
                if self.requests[slot].tag != order[i].tag:
                    continue
                rank = self.requests[slot].rank
                aborted = self.requests[slot].flags & ABORTED
                size = ck_write_header_int(out, Header.ABORT_REQUEST, order[i].tag - 1)
                self._free(slot)
                if not aborted and self.engines[rank].state != GONE:
                    if self._send_identity(&self.engine_ids, rank) != 0:
                        unreachable.append(rank)
                    else:
                        send_copy(self.sock, out, size, 0)
        finally:
            free(order)
        self._remove_client(client)
        for rank in unreachable:
            self._engine_failed(rank, "unreachable")

    # -- sending on rare paths -------------------------------------------------------------

    cdef bytes _frame_bytes(self, int part):
        return (<const char*>self._data(part))[:self._size(part)]

    cdef bint _send_py(self, IdTable* table, int32_t index, list frames):
        """Send Python bytes frames to a peer; False if it is gone."""
        cdef bytes frame
        cdef Py_ssize_t i
        if self._send_identity(table, index) != 0:
            return False
        for i in range(len(frames)):
            frame = frames[i]
            send_copy(self.sock, <const char*>frame, len(frame), ZMQ_SNDMORE if i + 1 < len(frames) else 0)
        return True

    cdef _send_identity_py(self, list frames):
        """Send to the sender of the current message, which may be in no table yet."""
        cdef bytes frame
        cdef Py_ssize_t i
        if send_copy(self.sock, self._data(0), self._size(0), ZMQ_SNDMORE) != 0:
            return
        for i in range(len(frames)):
            frame = frames[i]
            send_copy(self.sock, <const char*>frame, len(frame), ZMQ_SNDMORE if i + 1 < len(frames) else 0)

    cdef bint _error(self, int32_t client, rid, code, int64_t header):
        """ERROR to a coordkit client (others cannot parse it); False if it is gone."""
        if not self.clients[client].coordkit:
            return True
        self.counters[C_ERRORS_SENT] += 1
        return self._send_py(&self.client_ids, client, [error_frame(rid, code, header)])

    cdef _reject(self, int32_t client, rid, code, int64_t header, int counter):
        self.counters[counter] += 1
        if not self._error(client, rid, code, header):
            self._client_gone(client)

    cdef _bad_submit(self, int32_t client, int64_t header, int status, ck_submit* prefix):
        rid = prefix.rid if prefix.offset > 0 else None
        self._bad(rid, ErrorCode.MALFORMED, header, ck_strstatus(status).decode(), client)

    cdef _bad(self, rid, code, int64_t header, str detail, int32_t client):
        """A message that does not parse: count, log (rate-limited), answer a coordkit client."""
        identity = self._frame_bytes(0)
        self._log.warn("malformed", f"malformed {header_name(header)} from {identity!r}: {detail}")
        if client < 0:
            self.counters[C_MALFORMED] += 1
            return
        self._reject(client, rid, code, header, C_MALFORMED)
