# The requests waiting at the coordinator (their functions: queue.pyx). Included by
# _loop_c.pxd, after latency.pxd (its Histogram) and dialect.pxd (its Inbound).

cdef enum:
    # The messages a waiting request keeps: its metadata frame (the params are a span of
    # it) or its one frame, its payload frames (a prompt, a KV submission's
    # src_block_ids), its block-hash frame.
    HELD_MSGS = 4


cdef struct Held:
    # What rebuilds a waiting request's Inbound when it is dispatched (queue_inbound):
    # its messages, shared (or copied: see queue_push), and the Inbound it came as,
    # whose spans are offsets into them (prompt, extra: into its payload's first
    # message, or its one frame; params: into msgs[0]); n_msgs 0: nothing held (a
    # request re-queued from what keep() kept).
    zmq_msg_t msgs[HELD_MSGS]
    uint8_t n_msgs
    uint8_t payload_at  # msgs[payload_at] is its first payload frame
    int hashes_at  # msgs[hashes_at] its block hashes, -1: none
    uint8_t small  # its messages below COPY_BELOW shared: the queue's small_shared
    size_t prompt_at  # where its spans start in its messages
    size_t params_at
    size_t extra_at
    Inbound inbound


cdef struct Waiting:  # a request waiting, by entry
    uint32_t handle  # the loop's request slot
    uint32_t flow
    uint32_t older  # its neighbours in its flow, UINT32_MAX past its ends (older: the
    uint32_t newer  # free list's link, or the dispatched list's, while not waiting)
    uint32_t due_at  # its place in the deadline heap (UINT32_MAX: it has no deadline)
    uint64_t order  # its arrival's number: deadlines tie by it
    double since  # when it started waiting (monotonic())
    double deadline  # when it times out (INFINITY: never)
    Held held


cdef struct Flow:  # the requests of one tenant at one priority, oldest first
    int32_t priority
    int32_t tenant
    uint32_t oldest  # entries, UINT32_MAX when empty (oldest: the free list's link)
    uint32_t newest
    uint32_t at  # its place in the heap of flows
    uint64_t pass_  # the virtual time its next dispatch starts at (it wraps: passes
    uint64_t seq  # are compared by difference); when its pass was set: a tie's first


cdef struct Tenant:
    uint64_t stride  # its pass moves on this much a dispatch: STRIDE_SCALE / weight
    uint32_t refs  # the clients naming it
    uint32_t depth  # its requests waiting
    int32_t label  # its row of by_label (QUEUE_TENANTS: "other")
    int32_t next_free  # the free list's link while unused
    bint used
    bint named  # in the names table
    bint kept  # given a weight, or labelled: never forgotten


cdef struct WaitTally:  # a row of the stats: requests waiting now, and their waits by outcome
    uint64_t depth
    Histogram waits[N_OUTCOMES]


cdef struct Queue:
    uint32_t limit  # requests waiting at most
    uint32_t depth  # requests waiting now
    uint32_t handles  # the loop's request slots: handles are below it
    uint32_t* entry_of  # by handle: its entry + 1, 0 while it does not wait
    # 2 * limit entries: those waiting, and those dispatched whose messages are not
    # sent yet (a batch goes once every entry is routed: queue_sent lets them go)
    Waiting* entries
    uint32_t entries_used  # entries ever used: above them, calloc's untouched zeros
    uint32_t free_entry  # UINT32_MAX: none below entries_used
    uint32_t dispatched  # the dispatched list, through Waiting.older
    Flow* flows  # limit of them: a flow waits with a request at least
    uint32_t flows_used
    uint32_t free_flow
    uint32_t* cells  # (priority, tenant) -> flow + 1 (tables.h's scheme)
    uint64_t mask
    uint32_t* heap  # the flows waiting, by (priority, pass, seq)
    uint32_t n_heap
    uint32_t* due  # the entries with a deadline, by (deadline, order)
    uint32_t n_due
    uint64_t* vtime  # by priority level: the pass of its last dispatch
    uint64_t default_stride  # a tenant's given no weight (weight 1)
    uint64_t seq
    uint64_t arrivals
    uint32_t small_shared  # held messages below COPY_BELOW shared, not copied
    Tenant* tenants
    int32_t capacity  # tenants at most (tenant 0 takes the clients past them)
    int32_t tenants_used  # indices ever used
    int32_t free_tenant  # -1: none
    int32_t n_tenants  # known now, but for tenant 0
    ck_ids names  # named tenants: name -> index
    int32_t n_labels
    int32_t labelled[QUEUE_TENANTS]  # by label: its tenant
    WaitTally* by_priority  # N_PRIORITIES rows, by priority - PRIORITY_MIN
    WaitTally* by_label  # QUEUE_TENANTS rows and "other"
    double bounds[N_LATENCY_BUCKETS]
