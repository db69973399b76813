# The requests waiting at the coordinator (loop/queue.pxd): requests that find no
# engine with room wait here until one has it, each in the flow of its (priority,
# tenant). A lower priority is always dispatched first (strict: nothing ages into a
# better one); within a priority the flow with the lowest pass goes next, and each
# dispatch moves that pass on by its tenant's stride, STRIDE_SCALE / weight: virtual
# time, by requests (start-time fair queueing). A flow that starts waiting starts at
# its priority's virtual time, the pass of the last dispatch there. Within a flow,
# first come first served, but for a request re-queued at its head (its engine died
# before it produced anything). A request with a deadline is also in a heap by
# deadline. Every operation is O(log n) in the flows or the deadlines waiting, and
# allocates nothing: the tables are sized by the limit once. _loop_py/queue.py's Queue
# is the twin (the comment above it says why requests, not tokens). Included by _loop_c.pyx,
# after latency.pyx (histogram_observe).


cdef int queue_init(Queue* self, uint32_t limit, uint32_t handles, int32_t tenants,
                    tuple weights) except -1:
    """At most ``limit`` waiting, handles below ``handles``, ``tenants`` tenants (and one
    for the clients past them), ``weights`` the (name, weight) of those given one:
    they are made now, labelled first. MemoryError when memory is short."""
    cdef int i
    cdef bytes name
    cdef int32_t tenant
    self.limit = limit
    self.handles = handles
    self.free_entry = self.dispatched = self.free_flow = UINT32_MAX
    self.capacity = tenants + 1
    self.free_tenant = -1
    self.default_stride = tenant_stride(1.0)
    for i, bound in enumerate(LATENCY_BUCKETS):
        self.bounds[i] = bound
    self.mask = ck_cells_for(limit) - 1
    # calloc maps pages as they are touched: what this costs grows with what waits
    self.entry_of = <uint32_t*>calloc(handles + 1, sizeof(uint32_t))
    self.entries = <Waiting*>calloc(2 * <size_t>limit + 1, sizeof(Waiting))
    self.flows = <Flow*>calloc(<size_t>limit + 1, sizeof(Flow))
    self.cells = <uint32_t*>calloc(self.mask + 1, sizeof(uint32_t))
    self.heap = <uint32_t*>malloc((<size_t>limit + 1) * sizeof(uint32_t))
    self.due = <uint32_t*>malloc((<size_t>limit + 1) * sizeof(uint32_t))
    self.vtime = <uint64_t*>calloc(N_PRIORITIES, sizeof(uint64_t))
    self.tenants = <Tenant*>calloc(self.capacity, sizeof(Tenant))
    self.by_priority = <WaitTally*>calloc(N_PRIORITIES, sizeof(WaitTally))
    self.by_label = <WaitTally*>calloc(QUEUE_TENANTS + 1, sizeof(WaitTally))
    if (
        self.entry_of == NULL or self.entries == NULL or self.flows == NULL
        or self.cells == NULL or self.heap == NULL or self.due == NULL or self.vtime == NULL
        or self.tenants == NULL or self.by_priority == NULL or self.by_label == NULL
        or ck_ids_init(&self.names, self.capacity) != 0
    ):
        raise MemoryError()
    # tenant 0: the clients past the table (it cannot fill while each holds one)
    self.tenants[0].used = self.tenants[0].kept = True
    self.tenants[0].stride = self.default_stride
    self.tenants[0].label = QUEUE_TENANTS
    self.tenants_used = 1  # n_tenants does not count it
    for name_text, weight in weights:
        name = name_text.encode()
        tenant = queue_tenant(self, name, len(name))
        self.tenants[tenant].stride = tenant_stride(weight)
        self.tenants[tenant].kept = True
    return 0


cdef void queue_free(Queue* self) noexcept nogil:
    cdef uint32_t i
    if self.entries != NULL:
        for i in range(self.entries_used):
            _release(self, &self.entries[i].held)
    free(self.entry_of)
    free(self.entries)
    free(self.flows)
    free(self.cells)
    free(self.heap)
    free(self.due)
    free(self.vtime)
    free(self.tenants)
    free(self.by_priority)
    free(self.by_label)
    ck_ids_free(&self.names)
    self.entries = NULL


# -- tenants ------------------------------------------------------------------------------

cdef int32_t queue_tenant(Queue* self, const uint8_t* name, size_t n) noexcept nogil:
    """The tenant named ``name[:n]`` (found, or made), or (n 0) a new one of its own; one
    more client refers to it (queue_leave when it goes)."""
    cdef int32_t index = ck_ids_find(&self.names, name, n) if n else -1
    if index < 0:
        index = _new_tenant(self, name, n)
    self.tenants[index].refs += 1
    return index


cdef int32_t _new_tenant(Queue* self, const uint8_t* name, size_t n) noexcept nogil:
    cdef int32_t index
    cdef Tenant* tenant
    if self.free_tenant >= 0:
        index = self.free_tenant
        self.free_tenant = self.tenants[index].next_free
    elif self.tenants_used < self.capacity:
        index = self.tenants_used
        self.tenants_used += 1
    else:
        return 0
    tenant = &self.tenants[index]
    memset(tenant, 0, sizeof(Tenant))
    tenant.used = True
    tenant.stride = self.default_stride
    tenant.label = QUEUE_TENANTS
    if n and self.n_labels < QUEUE_TENANTS:
        tenant.label = self.n_labels
        tenant.kept = True
        self.labelled[self.n_labels] = index
        self.n_labels += 1
    if n:
        ck_ids_insert(&self.names, index, name, n)
        tenant.named = True
    self.n_tenants += 1
    return index


cdef void queue_leave(Queue* self, int32_t tenant) noexcept nogil:
    """A client that referred to ``tenant`` is gone."""
    self.tenants[tenant].refs -= 1
    _forget_if_unused(self, tenant)


cdef void _forget_if_unused(Queue* self, int32_t index) noexcept nogil:
    cdef Tenant* tenant = &self.tenants[index]
    if tenant.refs or tenant.depth or tenant.kept:
        return
    if tenant.named:
        ck_ids_remove(&self.names, index)
    tenant.used = False
    tenant.next_free = self.free_tenant
    self.free_tenant = index
    self.n_tenants -= 1


# -- requests -----------------------------------------------------------------------------

cdef inline bint queue_holds(Queue* self, uint32_t handle) noexcept nogil:
    return self.entry_of[handle] != 0


cdef bint queue_push(Queue* self, uint32_t handle, int32_t tenant, int priority, double now,
                     double deadline, bint head, Inbound* inbound,
                     zmq_msg_t* meta) noexcept nogil:
    """``handle`` waits in its (priority, tenant) flow, last (first with ``head``: a
    request whose engine died before it produced anything), until ``deadline`` (a
    monotonic(); INFINITY: none), keeping what ``inbound`` was read from (``meta``: the
    frame its params are a span of; NULL ``inbound``: nothing, see queue_inbound).
    False when the queue is full: it is refused (counted so)."""
    cdef int level = priority - PRIORITY_MIN
    cdef int label = self.tenants[tenant].label
    cdef uint32_t flow, entry
    cdef Flow* f
    cdef Waiting* w
    if self.depth >= self.limit or (
        self.free_entry == UINT32_MAX and self.entries_used == 2 * self.limit
    ):
        _observe(self, level, label, OUTCOME_REFUSED, 0.0)
        return False
    flow = _find_flow(self, priority, tenant)
    if flow == UINT32_MAX:
        flow = _new_flow(self, priority, tenant)
    f = &self.flows[flow]
    entry = _new_entry(self)
    w = &self.entries[entry]
    w.handle = handle
    w.flow = flow
    if f.oldest == UINT32_MAX:
        w.older = w.newer = UINT32_MAX
        f.oldest = f.newest = entry
    elif head:
        w.older = UINT32_MAX
        w.newer = f.oldest
        self.entries[f.oldest].older = entry
        f.oldest = entry
    else:
        w.newer = UINT32_MAX
        w.older = f.newest
        self.entries[f.newest].newer = entry
        f.newest = entry
    self.arrivals += 1
    w.order = self.arrivals
    w.since = now
    w.deadline = deadline
    w.due_at = UINT32_MAX
    if deadline < INFINITY:
        _due_push(self, entry)
    self.entry_of[handle] = entry + 1
    _hold(self, &w.held, inbound, meta)
    _count(self, f, 1)
    return True


cdef inline int64_t queue_peek(Queue* self) noexcept nogil:
    """The request dispatched next (-1: none waits): the oldest of the flow of the
    lowest priority, then the lowest pass."""
    if self.n_heap == 0:
        return -1
    return self.entries[self.flows[self.heap[0]].oldest].handle


cdef int64_t queue_pop(Queue* self, double now) noexcept nogil:
    """Dispatch queue_peek's request: it stops waiting (its wait counted DISPATCHED) and
    its flow's pass moves on by its tenant's stride; -1 when none waits. What it holds
    stays until queue_sent: the messages of its batch go once every entry is routed."""
    cdef Flow* f
    cdef int64_t handle
    cdef bint last
    if self.n_heap == 0:
        return -1
    f = &self.flows[self.heap[0]]
    handle = self.entries[f.oldest].handle
    last = f.oldest == f.newest  # its flow stops waiting with it
    self.vtime[f.priority - PRIORITY_MIN] = f.pass_
    _take(self, f.oldest, now, OUTCOME_DISPATCHED, True)
    if not last:
        f.pass_ += self.tenants[f.tenant].stride
        self.seq += 1
        f.seq = self.seq
        _heap_down(self, f.at)
    return handle


cdef void queue_remove(Queue* self, uint32_t handle, double now, int outcome) noexcept nogil:
    """A waiting request leaves without a dispatch, its wait counted as ``outcome``:
    aborted, its client gone, timed out, failed."""
    _take(self, self.entry_of[handle] - 1, now, outcome, False)


cdef int64_t queue_expired(Queue* self, double now) noexcept nogil:
    """The waiting request whose deadline is the earliest, if it is past ``now``: taken
    out (TIMED_OUT); -1 when none is due."""
    cdef uint32_t entry
    cdef int64_t handle
    if self.n_due == 0:
        return -1
    entry = self.due[0]
    if self.entries[entry].deadline > now:
        return -1
    handle = self.entries[entry].handle
    _take(self, entry, now, OUTCOME_TIMED_OUT, False)
    return handle


cdef bint queue_inbound(Queue* self, uint32_t handle, Inbound* out) noexcept nogil:
    """The waiting request's Inbound, as it came, over the messages it holds, marked
    ``batched`` when a batch can carry it (a dispatch goes to a batched engine in its
    batch: a multipart SUBMIT_REQUEST, its one payload frame); False when it holds
    nothing (re-queued: what keep() kept re-sends it)."""
    cdef Held* held
    cdef const uint8_t* frame
    if self.entry_of[handle] == 0:
        return False
    held = &self.entries[self.entry_of[handle] - 1].held
    if held.n_msgs == 0:
        return False
    frame = <const uint8_t*>zmq_msg_data(&held.msgs[0])
    out[0] = held.inbound
    out.meta = NULL
    out.payload = &held.msgs[held.payload_at]
    out.prompt = <const uint8_t*>zmq_msg_data(out.payload) + held.prompt_at
    if held.inbound.params != NULL:
        out.params = frame + held.params_at
    if held.inbound.extra != NULL:
        out.extra = frame + held.extra_at
    if held.hashes_at >= 0:
        out.hashes = <const uint8_t*>zmq_msg_data(&held.msgs[held.hashes_at])
        if held.inbound.hash_msg != NULL:
            out.hash_msg = &held.msgs[held.hashes_at]
    out.batched = not out.single and out.header == HEADER_SUBMIT_REQUEST  # a whole one
    out.carriers = 0
    return True


cdef void queue_sent(Queue* self) noexcept nogil:
    """The requests dispatched since the last call are sent (their batches too): what
    they held goes."""
    cdef uint32_t entry
    while self.dispatched != UINT32_MAX:
        entry = self.dispatched
        self.dispatched = self.entries[entry].older
        _release(self, &self.entries[entry].held)
        _free_entry(self, entry)


# -- its steps ----------------------------------------------------------------------------

cdef void _take(Queue* self, uint32_t entry, double now, int outcome,
                bint dispatched) noexcept nogil:
    """``entry`` stops waiting; dispatched, it goes to the dispatched list (what it
    holds kept until queue_sent), else it is let go."""
    cdef Waiting* w = &self.entries[entry]
    cdef Flow* f = &self.flows[w.flow]
    cdef int32_t tenant = f.tenant
    if w.older != UINT32_MAX:
        self.entries[w.older].newer = w.newer
    else:
        f.oldest = w.newer
    if w.newer != UINT32_MAX:
        self.entries[w.newer].older = w.older
    else:
        f.newest = w.older
    if w.due_at != UINT32_MAX:
        _due_remove(self, w.due_at)
    self.entry_of[w.handle] = 0
    _count(self, f, -1)
    _observe(self, f.priority - PRIORITY_MIN, self.tenants[tenant].label, outcome,
             now - w.since)
    if f.oldest == UINT32_MAX:
        _heap_remove(self, f.at)
        _unfile_flow(self, w.flow)
    if dispatched:
        w.older = self.dispatched
        self.dispatched = entry
    else:
        _release(self, &w.held)
        _free_entry(self, entry)
    _forget_if_unused(self, tenant)


cdef inline void _count(Queue* self, Flow* f, int change) noexcept nogil:
    cdef Tenant* tenant = &self.tenants[f.tenant]
    self.depth += change
    tenant.depth += change
    self.by_priority[f.priority - PRIORITY_MIN].depth += change
    self.by_label[tenant.label].depth += change


cdef inline void _observe(Queue* self, int level, int label, int outcome,
                          double seconds) noexcept nogil:
    histogram_observe(&self.by_priority[level].waits[outcome], self.bounds, seconds)
    histogram_observe(&self.by_label[label].waits[outcome], self.bounds, seconds)


cdef inline uint32_t _new_entry(Queue* self) noexcept nogil:
    cdef uint32_t entry = self.free_entry
    if entry != UINT32_MAX:
        self.free_entry = self.entries[entry].older
        return entry
    self.entries_used += 1
    return self.entries_used - 1


cdef inline void _free_entry(Queue* self, uint32_t entry) noexcept nogil:
    self.entries[entry].older = self.free_entry
    self.free_entry = entry


# -- what a waiting request holds: its messages --------------------------------------------

cdef void _hold(Queue* self, Held* held, Inbound* inbound, zmq_msg_t* meta) noexcept nogil:
    """What rebuilds ``inbound`` at its dispatch: its messages (msgs[0] the frame its
    params are a span of: a multipart request's metadata, or its one frame), its spans
    as offsets into them. Block hashes the loop computed (a single frame's) are copied
    into a message of their own."""
    cdef int i
    cdef const uint8_t* frame
    held.n_msgs = held.small = 0
    held.hashes_at = -1
    if inbound == NULL:
        return
    held.inbound = inbound[0]
    held.payload_at = 0 if inbound.single else 1
    if not inbound.single:
        _hold_msg(self, held, meta)
    for i in range(1 if inbound.single else inbound.n_payload):  # a single frame: itself
        _hold_msg(self, held, &inbound.payload[i])
    held.prompt_at = inbound.prompt - <const uint8_t*>zmq_msg_data(inbound.payload)
    frame = <const uint8_t*>zmq_msg_data(inbound.payload if inbound.single else meta)
    if inbound.params != NULL:
        held.params_at = inbound.params - frame
    if inbound.extra != NULL:
        held.extra_at = inbound.extra - frame
    if inbound.hashes == NULL:
        return
    held.hashes_at = held.n_msgs
    if inbound.hash_msg != NULL:
        _hold_msg(self, held, inbound.hash_msg)
        return
    zmq_msg_init_size(&held.msgs[held.n_msgs], inbound.n_hashes * BLOCK_HASH_SIZE)
    memcpy(zmq_msg_data(&held.msgs[held.n_msgs]), inbound.hashes,
           inbound.n_hashes * BLOCK_HASH_SIZE)
    held.n_msgs += 1


cdef void _hold_msg(Queue* self, Held* held, zmq_msg_t* message) noexcept nogil:
    """A message held: shared, as keep() shares a prompt (COPY_BELOW bytes or more, or
    while fewer than SHARED_SMALL_MAX small ones are: a small one shared pins the whole
    receive buffer libzmq decoded it from), else copied."""
    cdef zmq_msg_t* into = &held.msgs[held.n_msgs]
    cdef size_t size = zmq_msg_size(message)
    held.n_msgs += 1
    if size >= COPY_BELOW or self.small_shared < SHARED_SMALL_MAX:
        zmq_msg_init(into)
        zmq_msg_copy(into, message)
        if size < COPY_BELOW:
            self.small_shared += 1
            held.small += 1
        return
    zmq_msg_init_size(into, size)
    memcpy(zmq_msg_data(into), zmq_msg_data(message), size)


cdef void _release(Queue* self, Held* held) noexcept nogil:
    cdef int i
    for i in range(held.n_msgs):
        zmq_msg_close(&held.msgs[i])
    self.small_shared -= held.small
    held.n_msgs = held.small = 0


# -- the flows: by (priority, tenant), and in a heap by (priority, pass, seq) -----------------

cdef inline uint64_t _flow_key(int32_t priority, int32_t tenant) noexcept nogil:
    return (<uint64_t>(priority - PRIORITY_MIN) << 32) | <uint32_t>tenant


cdef uint64_t _flow_home(const void* table, uint32_t cell) noexcept nogil:
    cdef const Queue* self = <const Queue*>table
    cdef const Flow* f = &self.flows[cell - 1]
    return ck_mix64(_flow_key(f.priority, f.tenant)) & self.mask


cdef uint32_t _find_flow(Queue* self, int32_t priority, int32_t tenant) noexcept nogil:
    cdef uint64_t pos = ck_mix64(_flow_key(priority, tenant)) & self.mask
    cdef uint32_t cell
    while True:
        cell = self.cells[pos]
        if cell == 0:
            return UINT32_MAX
        if self.flows[cell - 1].priority == priority and self.flows[cell - 1].tenant == tenant:
            return cell - 1
        pos = (pos + 1) & self.mask


cdef uint32_t _new_flow(Queue* self, int32_t priority, int32_t tenant) noexcept nogil:
    """A flow that starts waiting, at its priority's virtual time."""
    cdef uint32_t flow = self.free_flow
    cdef Flow* f
    if flow != UINT32_MAX:
        self.free_flow = self.flows[flow].oldest
    else:
        flow = self.flows_used
        self.flows_used += 1
    f = &self.flows[flow]
    f.priority = priority
    f.tenant = tenant
    f.oldest = f.newest = UINT32_MAX
    f.pass_ = self.vtime[priority - PRIORITY_MIN]
    self.seq += 1
    f.seq = self.seq
    self.cells[ck_cells_vacant(self.cells, self.mask, ck_mix64(_flow_key(priority, tenant))
                               & self.mask)] = flow + 1
    self.heap[self.n_heap] = flow
    f.at = self.n_heap
    self.n_heap += 1
    _heap_up(self, f.at)
    return flow


cdef void _unfile_flow(Queue* self, uint32_t flow) noexcept nogil:
    """A flow left empty (out of the heap already) leaves the table."""
    cdef uint64_t pos = _flow_home(self, flow + 1)
    while self.cells[pos] != flow + 1:
        pos = (pos + 1) & self.mask
    ck_cells_remove(self.cells, self.mask, pos, _flow_home, self)
    self.flows[flow].oldest = self.free_flow
    self.free_flow = flow


cdef inline bint _flow_first(Queue* self, uint32_t a, uint32_t b) noexcept nogil:
    """Whether flow ``a`` goes before flow ``b``."""
    cdef Flow* x = &self.flows[a]
    cdef Flow* y = &self.flows[b]
    if x.priority != y.priority:
        return x.priority < y.priority
    if x.pass_ != y.pass_:
        return <int64_t>(x.pass_ - y.pass_) < 0
    return x.seq < y.seq


cdef inline void _heap_set(Queue* self, uint32_t at, uint32_t flow) noexcept nogil:
    self.heap[at] = flow
    self.flows[flow].at = at


cdef void _heap_up(Queue* self, uint32_t at) noexcept nogil:
    cdef uint32_t flow = self.heap[at], parent
    while at > 0:
        parent = (at - 1) // 2
        if not _flow_first(self, flow, self.heap[parent]):
            break
        _heap_set(self, at, self.heap[parent])
        at = parent
    _heap_set(self, at, flow)


cdef void _heap_down(Queue* self, uint32_t at) noexcept nogil:
    cdef uint32_t flow = self.heap[at], child
    while True:
        child = 2 * at + 1
        if child >= self.n_heap:
            break
        if child + 1 < self.n_heap and _flow_first(self, self.heap[child + 1], self.heap[child]):
            child += 1
        if not _flow_first(self, self.heap[child], flow):
            break
        _heap_set(self, at, self.heap[child])
        at = child
    _heap_set(self, at, flow)


cdef void _heap_remove(Queue* self, uint32_t at) noexcept nogil:
    cdef uint32_t moved
    self.n_heap -= 1
    if at == self.n_heap:
        return
    moved = self.heap[self.n_heap]
    _heap_set(self, at, moved)
    _heap_down(self, at)
    _heap_up(self, self.flows[moved].at)


# -- the deadlines: the entries with one, in a heap by (deadline, order) ---------------------

cdef inline bint _due_first(Queue* self, uint32_t a, uint32_t b) noexcept nogil:
    cdef Waiting* x = &self.entries[a]
    cdef Waiting* y = &self.entries[b]
    if x.deadline != y.deadline:
        return x.deadline < y.deadline
    return x.order < y.order


cdef inline void _due_set(Queue* self, uint32_t at, uint32_t entry) noexcept nogil:
    self.due[at] = entry
    self.entries[entry].due_at = at


cdef void _due_up(Queue* self, uint32_t at) noexcept nogil:
    cdef uint32_t entry = self.due[at], parent
    while at > 0:
        parent = (at - 1) // 2
        if not _due_first(self, entry, self.due[parent]):
            break
        _due_set(self, at, self.due[parent])
        at = parent
    _due_set(self, at, entry)


cdef void _due_down(Queue* self, uint32_t at) noexcept nogil:
    cdef uint32_t entry = self.due[at], child
    while True:
        child = 2 * at + 1
        if child >= self.n_due:
            break
        if child + 1 < self.n_due and _due_first(self, self.due[child + 1], self.due[child]):
            child += 1
        if not _due_first(self, self.due[child], entry):
            break
        _due_set(self, at, self.due[child])
        at = child
    _due_set(self, at, entry)


cdef void _due_push(Queue* self, uint32_t entry) noexcept nogil:
    self.due[self.n_due] = entry
    self.n_due += 1
    _due_up(self, self.n_due - 1)


cdef void _due_remove(Queue* self, uint32_t at) noexcept nogil:
    cdef uint32_t moved
    self.n_due -= 1
    if at == self.n_due:
        return
    moved = self.due[self.n_due]
    _due_set(self, at, moved)
    _due_down(self, at)
    _due_up(self, self.entries[moved].due_at)


# -- what stats() and metrics() give (with the GIL) ------------------------------------------

cdef bint _waits_used(WaitTally* tally) noexcept:
    """Whether a row has anything to say: requests waiting, or waits counted."""
    cdef int outcome, i
    if tally.depth:
        return True
    for outcome in range(N_OUTCOMES):
        for i in range(N_LATENCY_BUCKETS + 1):
            if tally.waits[outcome].buckets[i]:
                return True
    return False


cdef dict _waits_stats(WaitTally* tally):
    return {
        "depth": tally.depth,
        "outcomes": {
            o.name.lower(): sum([tally.waits[<int>o].buckets[i]
                                 for i in range(N_LATENCY_BUCKETS + 1)])
            for o in QueueOutcome
        },
    }


cdef dict _waits_metrics(WaitTally* tally):
    return {
        o.name.lower(): {
            "buckets": list(tally.waits[<int>o].buckets),
            "sum": tally.waits[<int>o].sum,
        }
        for o in QueueOutcome
    }


cdef list _rows(Queue* self):
    """(key, row) of the rows with anything to say: the priorities waited in, the
    labelled tenants by name, then "other"."""
    cdef int level, label
    cdef size_t n
    cdef const uint8_t* name
    rows = []
    for level in range(N_PRIORITIES):
        if _waits_used(&self.by_priority[level]):
            rows.append(("priority", level + PRIORITY_MIN, level))
    for label in range(self.n_labels):
        name = ck_ids_get(&self.names, self.labelled[label], &n)
        rows.append(("tenant", name[:n].decode(), label))
    if _waits_used(&self.by_label[QUEUE_TENANTS]):
        rows.append(("tenant", OTHER_TENANTS, QUEUE_TENANTS))
    return rows


cdef dict queue_stats(Queue* self):
    """Waiting now and ended so far, by priority and by tenant (its label)."""
    cdef int index
    by_priority = {}
    by_tenant = {}
    for kind, key, index in _rows(self):
        if kind == "priority":
            by_priority[key] = _waits_stats(&self.by_priority[index])
        else:
            by_tenant[key] = _waits_stats(&self.by_label[index])
    return {
        "depth": self.depth,
        "limit": self.limit,
        "tenants": self.n_tenants,
        "by_priority": by_priority,
        "by_tenant": by_tenant,
    }


cdef dict queue_metrics(Queue* self):
    """The wait histograms (buckets of LATENCY_BUCKETS and one more), by outcome."""
    cdef int index
    by_priority = {}
    by_tenant = {}
    for kind, key, index in _rows(self):
        if kind == "priority":
            by_priority[key] = _waits_metrics(&self.by_priority[index])
        else:
            by_tenant[key] = _waits_metrics(&self.by_label[index])
    return {"by_priority": by_priority, "by_tenant": by_tenant}
