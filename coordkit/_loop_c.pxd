# cython: language_level=3
"""Declarations of the Cython loop core (its C tables are in includes/tables.h)."""

from libc.stdint cimport int8_t, int32_t, int64_t, uint8_t, uint32_t, uint64_t

from ._codec_c cimport ck_batch_entry, ck_entry, ck_single_entry
from ._constants cimport (
    ERROR_SLOTS,
    HEADER_SLOTS,
    N_COUNTERS,
    N_LATENCY_BUCKETS,
    N_OUTCOMES,
    QUEUE_TENANTS,
)
from ._routing_c cimport Router
from .includes.framepool cimport (
    ck_buffer_msg,
    ck_buffer_pool,
    ck_buffer_pool_close,
    ck_buffer_pool_new,
)
from .includes.handoff cimport ck_agent
from .includes.libzmq cimport zmq_msg_t
from .includes.ring cimport ck_ring
from .includes.tables cimport (
    ck_ids,
    ck_ids_find,
    ck_ids_free,
    ck_ids_get,
    ck_ids_init,
    ck_ids_insert,
    ck_ids_remove,
    ck_request,
    ck_requests,
    ck_requests_add,
    ck_requests_adopt,
    ck_requests_find,
    ck_requests_find_client,
    ck_requests_free,
    ck_requests_init,
    ck_requests_remove,
)


include "loop/lists.pxd"


cdef struct Client:
    bint used
    bint coordkit  # said {"coordkit": 1} in CONNECT: may be sent ERROR and STATS_REPLY
    bint batch  # granted batches: may send SUBMIT_BATCH, is sent REPLY_BATCH
    bint rebuild  # keeps its requests: told to RESEND, sent CLIENT_REPLAYED
    bint present  # sent CONNECT (False: known only from an engine's report)
    # Connected and has sent nothing since: an engine's claim may be its (a rebuild
    # client REJOINs first); its first other message says it rejoins nothing.
    bint fresh
    bint rejoined  # sent REJOIN: its requests not listed are not awaited
    int format  # PeerFormat
    int64_t inflight
    Ends requests  # its requests in flight: slots, through Loop.client_links
    int fd  # the connection its CONNECT came on (ZMQ_SRCFD; -1: inproc)
    double hold  # a rebuild client: seconds its requests are kept once it is gone
    bint qos  # granted QoS: its SUBMITs may carry a priority and a deadline
    int32_t tenant  # its tenant in the queue (-1: none yet, it never sent CONNECT)


cdef struct Engine:
    int state  # EngineState
    bint coordkit  # sent ENGINE_HELLO: may be sent ERROR for the entries it got wrong
    bint batch  # asked for batches in ENGINE_HELLO: is sent ENGINE_SUBMIT_BATCH
    int format  # PeerFormat
    bint heartbeats  # has sent a HEARTBEAT: may be timed out
    double last_heartbeat
    double drain_deadline
    # A rebuild engine is sent a trailer with every request, and HANDLED on the
    # timer: the number of its last reply message handled a whole tick ago (its
    # reply messages since its registration are numbered from its base).
    bint rebuild
    int64_t base
    uint64_t handled  # reply messages received since its registration
    uint64_t mark  # handled at the last tick
    uint64_t acked  # handled as of the last HANDLED sent
    bint holding  # holds requests of a client away: sent no HANDLED (_mark_holding)
    int fd  # the connection it registered on (ZMQ_SRCFD; -1: inproc)
    int64_t session  # a coordkit engine: the token of its process, from its hello
    double away_until  # AWAY: when its grace ends
    # The breaker: its failures since failures_since (a window), the last one's
    # GoneReason (-1: none), until when it is quarantined, and how many quarantines in
    # a row (the next one's backoff doubles).
    int failures
    double failures_since
    int last_failure
    double quarantined_until
    int quarantines


cdef struct RequestOrder:  # a request on the rare paths that walk them in server-id order
    int64_t server_rid
    uint32_t slot


# The loop's concepts, each a struct of its own (their functions in loop/*.pyx).
include "loop/message.pxd"
include "loop/dialect.pxd"
include "loop/kept.pxd"
include "loop/fanout.pxd"
include "loop/latency.pxd"
include "loop/traffic.pxd"
include "loop/roles.pxd"
include "loop/queue.pxd"
include "loop/tally.pxd"

cdef class Loop
include "loop/rebuild.pxd"
include "loop/faults.pxd"
include "loop/answers.pxd"
include "loop/control.pxd"
include "loop/peers.pxd"
include "loop/refusals.pxd"
include "loop/report.pxd"
include "loop/timers.pxd"
include "loop/pd.pxd"
include "loop/pdmessages.pxd"
include "loop/traces.pxd"
include "loop/kvindex.pxd"


cdef class Loop:
    cdef:
        object _log, _detokenizer, _router_socket, _wake_socket, _monitor_socket
        Router router
        void* sock  # the ROUTER's raw libzmq handle
        void* wake  # the inproc PAIR that stop() writes to
        void* monitor  # the ROUTER's socket monitor: connections opened, ended, refused
        int fds[3]  # their ZMQ_FDs (the ROUTER's, the PAIR's, the monitor's): _serve_for
        dict connections  # the connections open, by fd, and the client index on each (-1)
        # Clients whose connection ended, (routing id, fd): dropped once what they sent
        # before it ended is handled.
        list ended
        Py_ssize_t n_ended  # len(ended), read without the GIL
        ck_buffer_pool* buffers  # large outgoing single frames, reused
        bint stopping  # SHUTDOWN arrived, or stop() woke us
        # The engines' KV-cache events: their thread (None: none read), the index they
        # make, and whether the thread said it has records waiting (on the wake socket).
        object kv_events
        KVIndex kv
        bint kv_due

        int64_t max_inflight
        double heartbeat_timeout
        double drain_timeout
        int max_clients
        int max_engines
        bint keep_prompts
        uint32_t small_shared  # kept prompts below COPY_BELOW shared, not copied
        bint has_detokenizer
        # The megatron-core dialect: peers that are not coordkit's speak single frames.
        bint megatron_core
        int single_format  # PeerFormat of an engine that only registered: its Megatron version
        bint computes_hashes  # the prefix policy hashes the prompts of single-frame SUBMITs
        size_t block_size
        double request_timeout  # 0: requests never time out
        bint measure_latency

        int64_t epoch  # what it announces to rebuild peers
        int64_t first_server_id  # this life's first server id: it drew those from here on
        Rebuild rebuild  # the rebuild after a coordinator's loss, and clients' blips
        Answers answers  # the rare paths' frames as Python bytes: read, parsed, sent
        Control control  # a peer's rare messages: aborts, KV releases, control signals, stats
        Peers peers  # the peers' life: engines and clients joining, living and leaving
        Refusals refusals  # the refusals and terminal errors
        Report report  # what the loop reports: stats() and metrics()
        Timers timers  # the loop's timers, every TICK
        Faults faults  # an engine's faults: the grace, the breaker, the migration
        PD pd  # disaggregated prefill/decode: made by the first engine with a role (None)
        bint pr6675  # serves #6675's P/D peers (megatron_version "pr6675")
        object _options  # what the P/D room is made with
        Traces traces  # the requests traced, for the coordinator's TraceSink
        dict engine_fds  # the connections engines registered on, by fd: their rank
        bint forwards_hashes  # the prefix policy learns from what rebuild engines report
        uint32_t drained  # messages handled in this wake-up: the deadline is read every 256
        double deadline  # the term's, for this serve() call
        double next_tick  # when the timers run next (time.monotonic())

        # The tables.
        ck_requests requests
        uint32_t* work  # by request slot: the work units its rank was charged (router.charged)
        # With a request_timeout or measure_latency: when each request (by slot) was submitted.
        double* submitted
        Client* clients
        ck_ids client_ids
        int n_clients
        uint32_t clients_used  # client indices ever used: above them, calloc's untouched zeros
        Links client_links  # by request slot: each client's requests
        Links idle_links  # by client index: the idle list, or the vacant list
        Ends idle  # the clients with nothing in flight, the one idle longest first
        Ends vacant  # the unused client indices below clients_used
        Engine* engines
        ck_ids engine_ids
        Roles roles  # the identities that left the tables, and their role
        int n_engines
        int n_single_engines  # engines not gone of each format: which checks a SUBMIT needs
        int n_main_engines
        int n_multipart_engines
        int* gone  # ranks found gone whose requests are not settled yet, oldest first
        int n_gone
        int control_state

        # The counts.
        uint64_t counters[N_COUNTERS]
        uint64_t messages
        uint64_t failed[ERROR_SLOTS]  # accepted requests ended with ERROR(code)
        uint64_t refused[ERROR_SLOTS]  # messages refused with ERROR(code)
        uint64_t debug_polls  # DEBUG builds: loop wake-ups, against the messages handled
        Traffic traffic
        Latency latency  # measure_latency
        Tally tally  # each engine's and client's counts
        Links deadline_links  # by request slot: the request_timeout queue
        Ends deadlines  # the requests in submission order (with a request_timeout)

        # The requests waiting for an engine with room, filed by slot, and by slot the
        # QoS of every request: where it waits, if it must (again, when its engine dies).
        Queue queue
        int8_t* priority
        double* wait_deadline  # monotonic() past which it may not wait (INFINITY: none)
        bint dispatch_due  # room may have freed up for them: _dispatch after the message

        # The message at hand, and its entries bound for peers that take batches.
        Message message
        Fanout fanout
        list held_bodies  # frames made on the way (bodies, hop params) a batch points into
        bint holds_bodies  # held_bodies has some

    # the hot path (no GIL)
    cdef bint _serve_for(self, double timeout) noexcept nogil
    cdef bint _woken(self) noexcept nogil
    cdef void _drain(self) noexcept nogil
    cdef void _handle(self) noexcept nogil
    cdef void _from_client(self, int32_t client, int64_t header) noexcept nogil
    cdef void _submit(self, int32_t client, int64_t header) noexcept nogil
    cdef void _submit_single(self, int32_t client, int64_t header) noexcept nogil
    cdef void _submit_batch(self, int32_t client) noexcept nogil
    cdef void _accept(self, int32_t client, int64_t rid, Inbound* inbound) noexcept nogil
    cdef int _send_new(self, uint32_t slot, Inbound* inbound) noexcept nogil
    cdef bint _queued(self, uint32_t slot, Inbound* inbound, bint head) noexcept nogil
    cdef int _route(self, uint32_t slot, Inbound* inbound) noexcept nogil
    cdef int _pick_engine(self, Inbound* inbound, int* rank) noexcept nogil
    cdef void _send_batches(self, int64_t header) noexcept nogil
    cdef void _from_engine(self, int32_t engine, int64_t header) noexcept nogil
    cdef void _forward_replies(self, int32_t engine) noexcept nogil
    cdef void _forward_single_replies(self, int32_t engine) noexcept nogil
    cdef void _finish(self, uint32_t slot, bint final, double now) noexcept nogil
    cdef bint _deliver(self, int32_t client, int64_t header, int64_t client_rid,
                       const uint8_t* body, size_t size, zmq_msg_t* message) noexcept nogil
    cdef void _admit(self, uint32_t slot, int32_t client) noexcept nogil
    cdef void _forget(self, uint32_t slot) noexcept nogil
    cdef void _unqueue(self, uint32_t slot, int outcome) noexcept nogil
    cdef void _dispatch(self) noexcept nogil
    cdef void _seen(self, int32_t client) noexcept nogil
    cdef int _send_identity(self, ck_ids* table, int32_t index) noexcept nogil
    cdef const uint8_t* _data(self, int part) noexcept nogil
    cdef size_t _size(self, int part) noexcept nogil

    # rare paths (with the GIL)

    # failures

    # answers and malformed input
