# Disaggregated prefill/decode: a request's two hops (its methods: pd.pyx). Included by
# _loop_c.pxd.

cdef enum:  # a hop's stage (_pd's)
    PD_QUEUED_PREFILL = 1
    PD_STAGE_PREFILL = 2
    PD_QUEUED_DECODE = 3
    PD_STAGE_DECODE = 4
    PD_READ = 5


cdef struct Seat:  # an engine with a P/D role, by rank
    bint seated
    int role  # EngineRole: PREFILL takes hop 1, DECODE hop 2 (and whole requests)
    bint megatron  # a #6675 engine (REGISTER_ROLE), else a coordkit one
    int domain  # index into PD.domains: the transfer domain it moves KV within
    uint32_t capacity  # requests it holds at most (a prefill's pinned ones counted)
    uint32_t reserved  # held now: a prefill's prefilling and pinned, a decode's handoffs
    uint32_t ssm_capacity  # a #6675 hybrid's live SSM slots (0: none)
    uint32_t ssm_used
    uint32_t slot_cost  # a hybrid prefill's SSM slots per request
    bint nccl  # a #6675 prefill that pushes on SEND_KV


cdef struct Hop:  # a request of the room, by slot (stage 0: not the room's)
    int stage  # QUEUED_PREFILL 1, PREFILL 2, QUEUED_DECODE 3, DECODE 4, READ 5
    int prefill  # the prefill rank, kept after the read: who to release
    int decode
    int attempts  # re-prefills and re-handoffs after deaths and leases
    bint pins  # its prefill holds its blocks pinned (a handoff, no release yet)
    double lease  # the pins' deadline
    bint final  # its decode sent the final: the read is over
    bint unsafe  # ended while a read may still run: its pins wait (orphans)
    int64_t prefill_work  # the role routers' charges
    int64_t decode_work
    uint32_t ssm  # the SSM slots its handoff takes at the decode
    uint64_t tokens


cdef struct Lease:  # pins handed off: their deadline (leases are taken in time order)
    double deadline
    int64_t rid


cdef struct Release:  # a prefill's pins a KV_READ_DONE of several freed, sent at its end
    int prefill
    int64_t rid
    int64_t work  # the prefill router's charge, released with its seat


cdef class PDMessages


cdef class PD:
    cdef:
        Loop loop  # whose tables it works on
        PDMessages messages  # what its engines send, read
        str mode
        int64_t threshold
        double lease
        int retries
        size_t block_size
        int max_engines
        bint megatron_clients  # megatron_version "pr6675": a client that only CONNECTs is #6675's
        Seat* seats  # by rank
        Hop* hops  # by request slot
        uint32_t slots
        list kept  # by slot: [prompt, params, hashes, kv_meta, blocks, decode_prompt]
        Kept** prompts  # by slot: a multipart request's prompt frame (kept[0] None), or NULL
        Release* releases  # while a KV_READ_DONE of several is read (releasing)
        size_t n_releases, releases_capacity
        bint releasing
        dict transfer  # by rank: a decode's metadata for SEND_KV
        list domains  # the domains' names, by index
        dict registrations  # #6675 engines, by identity
        object prefill_router
        list decode_routers  # by domain index
        object prefill_queue  # deque of server ids waiting for a prefill seat
        list decode_queues  # by domain index
        Lease* leases  # a FIFO ring of the pins handed off, oldest at leases_head
        size_t leases_head, n_leases, leases_capacity
        dict orphans  # by server id: [prefill, decode, deadline, client id or None, rid]
        object orphan_order
        dict counts

    # what the loop calls without the GIL
    cdef bint whole(self, int rank) noexcept nogil
    cdef void finished(self, uint32_t slot) noexcept nogil
    # with the GIL
    cdef seat(self, int rank, int role, bint megatron, str domain, uint32_t capacity)
    cdef unseat(self, int rank)
    cdef sync(self, int rank)
    cdef drain(self)
    cdef bint takes(self, uint32_t slot, Inbound* inbound) except -1
    cdef forget(self, uint32_t slot)
    cdef abort(self, uint32_t slot)
    cdef time_out(self, uint32_t slot)
    cdef client_release(self, int32_t client, int64_t rid)
    cdef engine_gone(self, int rank)
    cdef bint reported(self, int rank, int64_t rid, bint final) except -1
    cdef tick(self, double now)
    cdef dict stats(self)

    # its own steps
    cdef object _new_router(self)
    cdef int _domain(self, str name)
    cdef bint _usable(self, int rank)
    cdef bint _free(self, int rank, int role)
    cdef _place(self, Router router, int rank, bint accepting)
    cdef bint _live(self, int role, int domain)
    cdef bint _hops_only(self)
    cdef int _choose(self, Router router, uint32_t slot) except -2
    cdef _reserve(self, int rank, uint32_t ssm)
    cdef _release_seat(self, int rank, int role, int64_t work, uint32_t ssm)
    cdef int64_t _cached_depth(self, bytes hashes) except -1
    cdef bint _hop1(self, uint32_t slot, bint head, bint batched=*) except -1
    cdef bint _join_batch(self, int rank, uint32_t slot) except -1
    cdef bint _hop2(self, uint32_t slot, bint head) except -1
    cdef list _trailer(self, int rank, uint32_t slot)
    cdef void _origin(self, uint32_t slot, Origin* origin) noexcept
    cdef _learn(self, int rank, uint32_t slot)
    cdef bint _send_to(self, int rank, list frames)
    cdef bytes _prompt(self, uint32_t slot)
    cdef bint _str_prompt(self, uint32_t slot)
    cdef bint _send_single(self, int rank, uint32_t slot, int64_t header, uint32_t length,
                           bytes prompt, bytes params, bytes pairs, uint32_t n_pairs,
                           bytes kv_meta, bytes blocks)
    cdef bint _open(self, int rank)
    cdef bint _send_rid(self, int rank, int64_t header, int64_t rid)
    cdef _lease(self, double deadline, int64_t rid)
    cdef _release(self, int prefill, int64_t rid, int64_t work)
    cdef _send_releases(self)
    cdef bint _send_hop(self, int rank, uint32_t slot, int64_t header, bytes head, bytes last)
    cdef _handed(self, int rank, int64_t rid, bytes kv_meta, bytes blocks, uint32_t ssm,
                 object tokens)
    cdef _release_pins(self, uint32_t slot)
    cdef _orphan(self, uint32_t slot)
    cdef _free_orphan(self, int64_t rid)
    cdef bint _megatron_client(self, int32_t client)
    cdef _tell(self, bytes identity, list frames)
    cdef _end(self, uint32_t slot, int code, str reason, bint safe, bint aborted=*)
    cdef _again(self, uint32_t slot, str reason, bint prefill)
    cdef _fail_stranded(self)
