# Disaggregated prefill/decode (loop/pd.pxd). Included by _loop_c.pyx.

# A coordkit prefill's overrides as with_keys appends them: their packed pairs.
cdef bytes COORDKIT_OVERRIDES = b"".join(
    packb(key) + packb(value) for key, value in PREFILL_OVERRIDES["coordkit"].items()
)
cdef uint32_t N_COORDKIT_OVERRIDES = len(PREFILL_OVERRIDES["coordkit"])
# A #6675 prefill's, as prefill_frames splices them; a str prompt's ask its tokens back.
cdef bytes MEGATRON_OVERRIDES = b"".join(
    packb(key) + packb(value) for key, value in PREFILL_OVERRIDES["megatron"].items()
)
cdef bytes MEGATRON_TOKENS_BACK = MEGATRON_OVERRIDES + packb("return_prompt_tokens") + packb(True)
cdef uint32_t N_MEGATRON_OVERRIDES = len(PREFILL_OVERRIDES["megatron"])


cdef inline bint map_head(bytes params, size_t* count, size_t* head):
    """The msgpack map head ``params`` starts with, as _pd.map_head reads it: its
    ``count`` of pairs and its ``head`` size; False when it starts with none."""
    cdef const uint8_t* p = <const uint8_t*><const char*>params
    cdef size_t n = len(params)
    if n >= 1 and 0x80 <= p[0] <= 0x8F:
        count[0], head[0] = p[0] & 0x0F, 1
    elif n >= 3 and p[0] == 0xDE:
        count[0], head[0] = ck_load_be16(p + 1), 3
    elif n >= 5 and p[0] == 0xDF:
        count[0], head[0] = ck_load_be32(p + 1), 5
    else:
        return False
    return True


cdef object hop_head(int64_t header, int64_t rid, bytes params, bytes extra,
                     uint32_t n_keys):
    """A coordkit hop's first frame: ``[header, rid, params, ...]`` with ``extra``'s
    bytes after the params; with a negative ``header`` the params alone (a batch
    entry's tail). With ``n_keys``, ``extra`` is that many packed key-value pairs
    spliced into the params map (with_keys's bytes: hop 1's overrides), else the
    hop's last field (hop 2's kv_meta). None when the params are not a map's head."""
    cdef const uint8_t* p = <const uint8_t*><const char*>params
    cdef size_t n = len(params), head, count, size
    cdef uint8_t prefix[3 * CK_INT_MAX]
    cdef size_t n_prefix = 0
    cdef uint8_t* out
    if header >= 0:
        n_prefix = ck_write_array(prefix, 3 if n_keys else 4)
        n_prefix += ck_write_int(prefix + n_prefix, header)
        n_prefix += ck_write_int(prefix + n_prefix, rid)
    head = count = 0
    if n_keys:
        if not map_head(params, &count, &head):
            return None
        count += n_keys
    size = n_prefix + (0 if not n_keys else 1 if count <= 0x0F else 3 if count <= 0xFFFF else 5)
    frame = PyBytes_FromStringAndSize(NULL, size + n - head + len(extra))
    out = <uint8_t*>PyBytes_AS_STRING(frame)
    memcpy(out, prefix, n_prefix)
    if n_keys and count <= 0x0F:
        out[n_prefix] = 0x80 | count
    elif n_keys and count <= 0xFFFF:
        out[n_prefix] = 0xDE
        ck_store_be16(out + n_prefix + 1, <uint16_t>count)
    elif n_keys:
        out[n_prefix] = 0xDF
        ck_store_be32(out + n_prefix + 1, <uint32_t>count)
    memcpy(out + size, p + head, n - head)
    memcpy(out + size + n - head, <const char*>extra, len(extra))
    return frame


cdef inline bint str_head(const uint8_t* p, size_t n) noexcept nogil:
    """Whether a packed prompt is a msgpack str (_pd.str_prompt)."""
    return n > 0 and (0xA0 <= p[0] <= 0xBF or 0xD9 <= p[0] <= 0xDB)


cdef class PD:
    """Disaggregated prefill/decode (docs/pd.md): a request's two hops, chained here.

    Hop 1 to a prefill engine chosen by the prefill pool's router (its cached prefix
    against its queued work), its answer (a coordkit HANDOFF, a #6675 reply) never
    shown to the client; hop 2, the same server id, to a decode engine of the
    prefill's transfer domain chosen by its router (the blocks it would have to move
    against its load); KV_TRANSFER_READY then SEND_KV for pushing prefills; RELEASE_KV
    to the owning prefill once the decode read the blocks. Every engine with a role
    holds a seat of ``capacity`` requests; a hop that finds every seat of its pool
    full waits in its role's FIFO (the decode's per domain), and goes out when a seat
    frees. The request's ``rank`` is the engine holding its present hop (-1 while it
    waits), so the loop's rank checks take a late reply of an earlier hop's engine for
    an unknown request. Deaths, leases, aborts and time-outs: docs/pd.md's table.
    """

    def __cinit__(self, Loop loop not None, options):
        self.loop = loop
        self.messages = PDMessages(self)
        self.mode = options.pd_mode
        self.threshold = options.pd_threshold
        self.lease = options.pd_lease
        self.retries = options.pd_retries
        self.block_size = options.block_size
        self.max_engines = options.max_engines
        self.megatron_clients = options.megatron_version == "pr6675"
        self.slots = options.max_inflight
        self.seats = <Seat*>calloc(self.max_engines, sizeof(Seat))
        self.hops = <Hop*>calloc(self.slots, sizeof(Hop))
        self.prompts = <Kept**>calloc(self.slots, sizeof(Kept*))
        if self.seats == NULL or self.hops == NULL or self.prompts == NULL:
            raise MemoryError()
        self.kept = [None] * self.slots
        self.transfer = {}
        self.domains = []
        self.registrations = {}
        self.prefill_router = self._new_router()
        self.decode_routers = []
        self.prefill_queue = deque()
        self.decode_queues = []
        self.orphans = {}
        self.orphan_order = deque()
        self.counts = dict.fromkeys(PD_COUNTS, 0)

    def __dealloc__(self):
        cdef uint32_t slot, small_shared = 0  # the loop's count: it may be gone first
        if self.prompts != NULL:
            for slot in range(self.slots):
                release_kept(self.prompts[slot], &small_shared)
        free(self.seats)
        free(self.hops)
        free(self.prompts)
        free(self.releases)
        free(self.leases)

    cdef object _new_router(self):
        router = self.loop.router
        return type(router)(
            router.policy, self.max_engines, block_size=self.block_size, prefix_decode_tokens=0
        )

    cdef int _domain(self, str name):
        if name not in self.domains:
            self.domains.append(name)
            self.decode_routers.append(self._new_router())
            self.decode_queues.append(deque())
        return self.domains.index(name)

    # -- seats ---------------------------------------------------------------------------

    cdef seat(self, int rank, int role, bint megatron, str domain, uint32_t capacity):
        """An engine takes a role (its hello, or a #6675 REGISTER_ROLE): seated, out of
        the whole-request pool unless it runs whole requests, into its role's pools."""
        cdef Seat* seat = &self.seats[rank]
        self.unseat(rank)
        self.messages.readers.pop(rank, None)  # a new registration: read anew at its handoff
        memset(seat, 0, sizeof(Seat))
        seat.seated = True
        seat.role = role
        seat.megatron = megatron
        seat.domain = self._domain(domain)
        seat.capacity = capacity
        if not self.whole(rank):
            self.loop.router.remove_rank(rank)
        self.sync(rank)

    cdef unseat(self, int rank):
        """A rank leaves its role (gone, or a new engine under it)."""
        if not self.seats[rank].seated:
            return
        self.seats[rank].seated = False
        self.messages.readers.pop(rank, None)
        self.prefill_router.remove_rank(rank)
        self.decode_routers[self.seats[rank].domain].remove_rank(rank)
        self.transfer.pop(rank, None)

    cdef bint whole(self, int rank) noexcept nogil:
        """Whether a rank runs whole requests: no role, a coordkit decode (a short prompt
        prefilled where it decodes); never a #6675 engine, which registered for one hop
        (its replies would not be a decode's: #6675 gives every request both hops)."""
        cdef Seat* seat = &self.seats[rank]
        if not seat.seated:
            return True
        return not seat.megatron and (seat.role & PD_DECODE) != 0

    cdef bint _usable(self, int rank):
        return self.loop.engines[rank].state == ENGINE_ALIVE and (
            self.loop.engines[rank].quarantined_until <= 0  # never quarantined: no clock read
            or self.loop.engines[rank].quarantined_until <= monotonic()
        )

    cdef bint _free(self, int rank, int role):
        cdef Seat* seat = &self.seats[rank]
        cdef uint32_t cost
        if seat.reserved >= seat.capacity:
            return False
        if not seat.ssm_capacity:
            return True
        cost = seat.slot_cost if role == PD_PREFILL else 1
        return seat.ssm_used + cost <= seat.ssm_capacity

    cdef sync(self, int rank):
        """A rank in its role routers when it is usable with a free seat, else out."""
        cdef Seat* seat = &self.seats[rank]
        cdef bint usable = self._usable(rank)
        self._place(self.prefill_router, rank, usable and seat.role & PD_PREFILL
                    and self._free(rank, PD_PREFILL))
        self._place(self.decode_routers[seat.domain], rank, usable and seat.role & PD_DECODE
                    and self._free(rank, PD_DECODE))

    cdef _place(self, Router router, int rank, bint accepting):
        """``rank`` in ``router``'s pool or out, a Python call only to join it."""
        if not accepting:
            router.remove_rank_c(rank)
        elif not router.is_accepting[rank]:
            router.add_rank(rank)

    cdef bint _live(self, int role, int domain):
        """Whether an engine of ``role`` (of ``domain``, -1: any) is up, full or not."""
        cdef int rank
        for rank in range(self.loop.n_engines):
            if (
                self.seats[rank].seated
                and self.seats[rank].role & role
                and (domain < 0 or self.seats[rank].domain == domain)
                and self._usable(rank)
            ):
                return True
        return False

    cdef int _choose(self, Router router, uint32_t slot) except -2:
        """A rank of a role pool with a free seat for the request (-1: none); a rank found
        unusable since (away, quarantined) leaves the pool until the tick's sync."""
        cdef int rank
        cdef bytes hashes = self.kept[slot][2]
        cdef const uint8_t* data = NULL
        cdef size_t n_hashes = 0
        if hashes:
            data = <const uint8_t*><const char*>hashes
            n_hashes = len(hashes) // BLOCK_HASH_SIZE
        while True:
            rank = router.choose_c(data, n_hashes, self.hops[slot].tokens, monotonic())
            if rank < 0 or self._usable(rank):
                return rank
            router.release_c(rank, router.charged)
            router.remove_rank_c(rank)

    cdef _reserve(self, int rank, uint32_t ssm):
        self.seats[rank].reserved += 1
        self.seats[rank].ssm_used += ssm
        self.sync(rank)

    cdef _release_seat(self, int rank, int role, int64_t work, uint32_t ssm):
        """A hop's seat free again: its router's charge released, its queue drained."""
        cdef Seat* seat = &self.seats[rank]
        if rank < 0 or not seat.seated:  # gone: its seat went with it
            return
        seat.reserved -= 1
        seat.ssm_used -= ssm
        router = self.prefill_router if role == PD_PREFILL else self.decode_routers[seat.domain]
        (<Router>router).release_c(rank, work)
        self.sync(rank)
        self.drain()

    cdef drain(self):
        """The queues' heads out while a seat of their pool is free, oldest first."""
        cdef int64_t slot
        cdef int domain
        while self.prefill_queue and self.prefill_router.n_accepting:
            slot = ck_requests_find(&self.loop.requests, self.prefill_queue.popleft())
            if slot >= 0 and self.hops[slot].stage == PD_QUEUED_PREFILL:
                if not self._hop1(<uint32_t>slot, True):
                    break
        for domain in range(len(self.domains)):
            queue = self.decode_queues[domain]
            while queue and self.decode_routers[domain].n_accepting:
                slot = ck_requests_find(&self.loop.requests, queue.popleft())
                if slot >= 0 and self.hops[slot].stage == PD_QUEUED_DECODE:
                    if not self._hop2(<uint32_t>slot, True):
                        break

    # -- a request's hops ----------------------------------------------------------------

    cdef bint takes(self, uint32_t slot, Inbound* inbound) except -1:
        """A new request: both hops (the first sent or queued), or False: it runs whole,
        as any request (no prefill or no decode engine up, and an engine that runs whole
        requests is; conditional P/D and a prompt short enough, or cached enough where
        it would run whole). Where only engines of one hop are up, it ends here with the
        missing role named, nothing prefilled."""
        cdef Hop* hop = &self.hops[slot]
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef const uint8_t* data
        cdef size_t count, head
        cdef ck_single_submit single
        if inbound.header != HEADER_SUBMIT_REQUEST:
            return False
        cdef bint decode_up = self._live(PD_DECODE, -1)
        if (not self._live(PD_PREFILL, -1) or not decode_up) and not self._hops_only():
            return False
        hashes = None
        if inbound.hashes != NULL:
            hashes = (<const char*>inbound.hashes)[:inbound.n_hashes * BLOCK_HASH_SIZE]
        if self.mode == "conditional" and self.loop.router.n_accepting:
            depth = self._cached_depth(hashes)
            if uncached_tokens(inbound.tokens, depth, self.block_size) <= self.threshold:
                self.counts["whole"] += 1
                return False
        if inbound.params != NULL:
            params = (<const char*>inbound.params)[:inbound.params_size]
            if not inbound.single:  # its prompt frame kept as the loop keeps one: shared
                self.prompts[slot] = keep(NULL, inbound.payload, False,
                                          &self.loop.small_shared)
            prompt = None
            if self.prompts[slot] == NULL:
                prompt = (<const char*>inbound.prompt)[:inbound.prompt_size]
        else:  # a single frame read as far as its rid: its prompt and params found
            data = <const uint8_t*>zmq_msg_data(inbound.payload)
            if ck_read_single_submit(data, zmq_msg_size(inbound.payload), &single) != CK_OK:
                return False  # (the loop read it whole: not met)
            prompt = (<const char*>data + single.prompt)[:single.params - single.prompt]
            params = (<const char*>data + single.params)[:single.extra - single.params]
        memset(hop, 0, sizeof(Hop))
        hop.prefill = hop.decode = -1
        hop.tokens = inbound.tokens
        self.kept[slot] = [prompt, params, hashes, b"", b"", None]
        request.rank = -1
        if (
            self._megatron_client(request.client)
            and ck_pd_may_refuse(<const uint8_t*><const char*>params, len(params))
            and refuses_prompt_log_probs(_params_map(params))
        ):
            hop.stage = PD_QUEUED_PREFILL
            self._end(slot, ERROR_ENGINE_FAILED, PROMPT_LOG_PROBS, True)
            return True
        if not map_head(params, &count, &head):  # the room cannot add its key: a clear error
            hop.stage = PD_QUEUED_PREFILL
            self._end(slot, ERROR_MALFORMED, PARAMS_NOT_A_MAP, True)
            return True
        if not decode_up and self._live(PD_PREFILL, -1):  # nothing prefilled for nothing
            hop.stage = PD_QUEUED_PREFILL
            self._end(slot, ERROR_NO_ENGINES, cannot_route("decode"), True)
            return True
        self.counts["requests"] += 1
        self._hop1(slot, False, inbound.batched)
        return True

    cdef bint _hops_only(self):
        """Whether only role engines that run no whole request are up: a #6675 fleet
        missing a role (its requests end: the room says which role is missing)."""
        cdef int rank
        cdef bint seated = False
        for rank in range(self.loop.n_engines):
            if self.seats[rank].seated:
                seated = True
            if self._usable(rank) and self.whole(rank):
                return False
        return seated

    cdef int64_t _cached_depth(self, bytes hashes) except -1:
        """The leading blocks of a prompt the most cached whole-request engine holds."""
        cdef int64_t depth = 0
        if not hashes:
            return 0
        router, now = self.loop.router, monotonic()
        ranks = None
        for (value,) in struct.iter_unpack("<Q", hashes):
            held = {rank for rank in router.prefix_ranks(value, now) if router.accepting(rank)}
            ranks = held if ranks is None else ranks & held
            if not ranks:
                break
            depth += 1
        return depth

    cdef bint _hop1(self, uint32_t slot, bint head, bint batched=False) except -1:
        """Hop 1 to a prefill with a free seat; queued when every seat is taken (at the
        head: it was the queue's), ended when no prefill is up. True when sent. A
        request of a client's batch joins the batch a prefill granted batches is sent."""
        cdef Hop* hop = &self.hops[slot]
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef int rank
        cdef int64_t rid = request.server_rid
        hop.stage = PD_QUEUED_PREFILL
        request.rank = -1
        rank = self._choose(self.prefill_router, slot)
        if rank < 0:
            if not self._live(PD_PREFILL, -1):
                self._end(slot, ERROR_NO_ENGINES, cannot_route("prefill"), True)
            elif head:
                self.prefill_queue.appendleft(rid)
            else:
                self.prefill_queue.append(rid)
            return False
        hop.prefill_work = self.prefill_router.charged
        self._reserve(rank, self.seats[rank].slot_cost)
        hop.prefill = rank
        hop.stage = PD_STAGE_PREFILL
        request.rank = rank
        kept = self.kept[slot]
        self._learn(rank, slot)
        if not self.seats[rank].megatron:
            if batched and self.loop.engines[rank].batch and self._join_batch(rank, slot):
                return True
            first = hop_head(HEADER_SUBMIT_REQUEST, rid, kept[1], COORDKIT_OVERRIDES,
                             N_COORDKIT_OVERRIDES)
            self._send_hop(rank, slot, HEADER_SUBMIT_REQUEST, first, None)
            return True
        # a #6675 engine's single frame (prefill_frames's bytes)
        if self._str_prompt(slot):
            self._send_single(rank, slot, HEADER_SUBMIT_REQUEST, 4, self._prompt(slot), kept[1],
                              MEGATRON_TOKENS_BACK, N_MEGATRON_OVERRIDES + 1, None, None)
        else:
            self._send_single(rank, slot, HEADER_SUBMIT_REQUEST, 4, self._prompt(slot), kept[1],
                              MEGATRON_OVERRIDES, N_MEGATRON_OVERRIDES, None, None)
        return True

    cdef bint _join_batch(self, int rank, uint32_t slot) except -1:
        """Hop 1 as an entry of the ENGINE_SUBMIT_BATCH the loop sends ``rank`` once the
        client's batch is handled: its params with the override (held until sent), its
        prompt copied (the kept frame stays the room's). False when memory is short."""
        cdef Loop loop = self.loop
        cdef Origin origin
        cdef size_t tail_size, size
        cdef const uint8_t* tail
        cdef const uint8_t* prompt
        params = hop_head(-1, 0, self.kept[slot][1], COORDKIT_OVERRIDES, N_COORDKIT_OVERRIDES)
        if not fanout_grow(&loop.fanout, len(params)):
            return False
        tail = loop.answers.held_body(params, &tail_size)
        if self.prompts[slot] == NULL:
            prompt = <const uint8_t*><const char*>self.kept[slot][0]
            size = len(self.kept[slot][0])
        else:
            prompt = kept_prompt(self.prompts[slot], &size)
        fanout_add(&loop.fanout, rank, loop.requests.pool[slot].server_rid, tail, tail_size,
                   NULL, prompt, size)
        if loop.engines[rank].rebuild:
            self._origin(slot, &origin)
            fanout_trail(&loop.fanout, &origin)
        return True

    cdef bint _hop2(self, uint32_t slot, bint head) except -1:
        """Hop 2, the handoff kept, to a decode of the prefill's domain with a free seat;
        queued when each is full; ended (its pins released) when none is up."""
        cdef Hop* hop = &self.hops[slot]
        cdef ck_request* request = &self.loop.requests.pool[slot]
        cdef int rank
        cdef int domain = self.seats[hop.prefill].domain
        cdef int64_t rid = request.server_rid
        hop.stage = PD_QUEUED_DECODE
        request.rank = -1
        router = self.decode_routers[domain]
        rank = self._choose(router, slot)
        if rank < 0:
            if not self._live(PD_DECODE, domain):
                self._end(slot, ERROR_NO_ENGINES, cannot_route("decode"), True)
            elif head:
                self.decode_queues[domain].appendleft(rid)
            else:
                self.decode_queues[domain].append(rid)
            return False
        hop.decode_work = router.charged
        self._reserve(rank, hop.ssm)
        hop.decode = rank
        hop.stage = PD_STAGE_DECODE
        request.rank = rank
        kept = self.kept[slot]
        self._learn(rank, slot)
        if self.seats[rank].megatron:  # decode_frames's bytes
            self._send_single(rank, slot, HEADER_SUBMIT_REQUEST_WITH_KV, 6,
                              kept[5] or self._prompt(slot), kept[1], None, 0, kept[3], kept[4])
        else:
            self._send_hop(rank, slot, HEADER_SUBMIT_REQUEST_WITH_KV,
                           hop_head(HEADER_SUBMIT_REQUEST_WITH_KV, rid, kept[1], kept[3], 0),
                           kept[4])
        return True

    cdef list _trailer(self, int rank, uint32_t slot):
        """A rebuild engine's trailer: no client id (a hop is not rebuilt: docs/pd.md)."""
        cdef Origin origin
        cdef uint8_t out[TRAILER_MAX]
        if not self.loop.engines[rank].rebuild:
            return []
        self._origin(slot, &origin)
        return [(<char*>out)[:write_trailer(out, &origin)]]

    cdef void _origin(self, uint32_t slot, Origin* origin) noexcept:
        origin.client_rid = self.loop.requests.pool[slot].client_rid
        origin.client_id = NULL
        origin.hashes = NULL

    cdef _learn(self, int rank, uint32_t slot):
        """A hop sent to an engine that runs whole requests too: the whole-request router
        learns the prefix it now caches (conditional P/D then finds it)."""
        hashes = self.kept[slot][2]
        if hashes and self.whole(rank) and self.loop.router.policy == "prefix":
            self.loop.router.learn(rank, hashes, monotonic())

    cdef bint _send_to(self, int rank, list frames):
        if rank < 0 or self.loop.engines[rank].state == ENGINE_GONE:
            return False
        if self.loop.answers.send_frames(&self.loop.engine_ids, rank, frames):
            return True
        self.loop.faults.lost(rank, GONE_UNREACHABLE)  # settled: engine_gone
        return False

    cdef bint _open(self, int rank):
        """A message to an engine started (its routing id sent); False when it is gone,
        as _send_to."""
        if rank < 0 or self.loop.engines[rank].state == ENGINE_GONE:
            return False
        if self.loop._send_identity(&self.loop.engine_ids, rank) != 0:
            self.loop.faults.lost(rank, GONE_UNREACHABLE)  # settled: engine_gone
            return False
        return True

    cdef bint _send_rid(self, int rank, int64_t header, int64_t rid):
        """``[header, rid]`` (rids_message's bytes: RELEASE_KV, ABORT_REQUEST) to an
        engine, written in C; as _send_to."""
        cdef uint8_t out[CK_HEADER_INT_MAX]
        cdef size_t size
        if not self._open(rank):
            return False
        size = ck_write_header_int(out, header, rid)
        send_bytes(self.loop.sock, out, size, 0)
        traffic_count(&self.loop.traffic, SENT, header, size)
        return True

    cdef bytes _prompt(self, uint32_t slot):
        """The request's prompt frame as bytes (a #6675 engine's frame splices it in)."""
        cdef size_t size
        cdef const uint8_t* data
        if self.prompts[slot] == NULL:
            return self.kept[slot][0]
        data = kept_prompt(self.prompts[slot], &size)
        return (<const char*>data)[:size]

    cdef bint _str_prompt(self, uint32_t slot):
        cdef size_t size
        cdef const uint8_t* data
        if self.prompts[slot] == NULL:
            prompt = self.kept[slot][0]
            return str_head(<const uint8_t*><const char*>prompt, len(prompt))
        data = kept_prompt(self.prompts[slot], &size)
        return str_head(data, size)

    cdef bint _send_single(self, int rank, uint32_t slot, int64_t header, uint32_t length,
                           bytes prompt, bytes params, bytes pairs, uint32_t n_pairs,
                           bytes kv_meta, bytes blocks):
        """A #6675 engine's hop, one frame written in C into the message sent:
        ``[header, rid, prompt, params, ...]`` of ``length`` fields, ``n_pairs`` packed
        pairs spliced into the params map (hop 1's overrides: with_keys's bytes), else
        kv_meta and the block ids after the params (hop 2); a rebuild engine's trailer;
        as _send_to."""
        cdef Loop loop = self.loop
        cdef zmq_msg_t msg
        cdef Origin origin
        cdef uint8_t* out
        cdef const uint8_t* p = <const uint8_t*><const char*>params
        cdef size_t count = 0, head = 0, size = 0, n_head, total
        cdef bint trailed = loop.engines[rank].rebuild if rank >= 0 else False
        cdef uint8_t prefix[3 * CK_INT_MAX]
        cdef size_t n_prefix = ck_write_array(prefix, length)
        n_prefix += ck_write_int(prefix + n_prefix, header)
        n_prefix += ck_write_int(prefix + n_prefix, loop.requests.pool[slot].server_rid)
        if n_pairs:
            map_head(params, &count, &head)  # takes() ended a request whose params are none
            count += n_pairs
        n_head = 0 if not n_pairs else 1 if count <= 0x0F else 3 if count <= 0xFFFF else 5
        total = n_prefix + len(prompt) + n_head + len(params) - head
        for extra in (pairs, kv_meta, blocks):
            if extra is not None:
                total += len(<bytes>extra)
        if not self._open(rank):
            return False
        zmq_msg_init_size(&msg, total)
        out = <uint8_t*>zmq_msg_data(&msg)
        memcpy(out, prefix, n_prefix)
        size = n_prefix
        memcpy(out + size, <const char*>prompt, len(prompt))
        size += len(prompt)
        if n_head == 1:
            out[size] = 0x80 | count
        elif n_head == 3:
            out[size] = 0xDE
            ck_store_be16(out + size + 1, <uint16_t>count)
        elif n_head == 5:
            out[size] = 0xDF
            ck_store_be32(out + size + 1, <uint32_t>count)
        size += n_head
        memcpy(out + size, p + head, len(params) - head)
        size += len(params) - head
        for extra in (pairs, kv_meta, blocks):
            if extra is not None:
                memcpy(out + size, <const char*><bytes>extra, len(<bytes>extra))
                size += len(<bytes>extra)
        if zmq_msg_send(&msg, loop.sock, ZMQ_SNDMORE if trailed else 0) < 0:
            zmq_msg_close(&msg)
        if trailed:
            self._origin(slot, &origin)
            total += send_trailer(loop.sock, &origin, 0)
        traffic_count(&loop.traffic, SENT, header, total)
        return True

    cdef bint _send_hop(self, int rank, uint32_t slot, int64_t header, bytes head, bytes last):
        """A coordkit engine's hop: ``head``, the prompt frame (the kept one shared, not
        copied), ``last`` unless None (hop 2's block ids), and a rebuild engine's trailer;
        as _send_to."""
        cdef Loop loop = self.loop
        cdef zmq_msg_t* shared
        cdef const uint8_t* data
        cdef size_t size
        cdef Origin origin
        cdef bint trailed = loop.engines[rank].rebuild if rank >= 0 else False
        cdef int after_prompt = ZMQ_SNDMORE if last is not None or trailed else 0
        if self.prompts[slot] == NULL:
            frames = [head, self.kept[slot][0]]
            if last is not None:
                frames.append(last)
            return self._send_to(rank, frames + self._trailer(rank, slot))
        if not self._open(rank):
            return False
        send_bytes(loop.sock, <const char*>head, len(head), ZMQ_SNDMORE)
        data = kept_prompt(self.prompts[slot], &size)
        shared = kept_shared(self.prompts[slot])
        if shared != NULL:
            send_shared(loop.sock, shared, after_prompt)
        else:
            send_bytes(loop.sock, data, size, after_prompt)
        size += len(head)
        if last is not None:
            size += len(last)
            send_bytes(loop.sock, <const char*>last, len(last), ZMQ_SNDMORE if trailed else 0)
        if trailed:
            self._origin(slot, &origin)
            size += send_trailer(loop.sock, &origin, 0)
        traffic_count(&loop.traffic, SENT, header, size)
        return True

    cdef _handed(self, int rank, int64_t rid, bytes kv_meta, bytes blocks, uint32_t ssm,
                 object tokens):
        """A prefill hop's handoff: its blocks pinned at ``rank``; on to hop 2. A handoff
        of no request of that prefill's (late, ended) is released at once."""
        cdef int64_t slot = ck_requests_find(&self.loop.requests, rid)
        cdef Hop* hop
        if slot < 0 or self.hops[slot].stage != PD_STAGE_PREFILL or self.hops[slot].prefill != rank:
            self.counts["stray"] += 1
            self._send_rid(rank, HEADER_RELEASE_KV, rid)
            return
        hop = &self.hops[slot]
        hop.pins = True
        kept = self.kept[slot]
        kept[3], kept[4] = kv_meta, blocks
        hop.ssm = ssm
        hop.lease = monotonic() + self.lease
        self._lease(hop.lease, rid)
        if isinstance(tokens, list):
            kept[5] = packb(tokens)
        self.counts["handoffs"] += 1
        if self.loop.requests.pool[slot].flags & FLAG_ABORTED:  # nothing reads them
            self._end(<uint32_t>slot, ERROR_ABORTED, ABORTED_TEXT, True, True)
            return
        self._hop2(<uint32_t>slot, False)

    cdef _release_pins(self, uint32_t slot):
        """RELEASE_KV to the owning prefill, its seat free, the handoff dropped."""
        cdef Hop* hop = &self.hops[slot]
        cdef int prefill = hop.prefill
        hop.pins = False
        kept = self.kept[slot]
        kept[3] = kept[4] = b""
        self.counts["pins_released"] += 1
        self._release(prefill, self.loop.requests.pool[slot].server_rid, hop.prefill_work)

    cdef _lease(self, double deadline, int64_t rid):
        """A lease at the ring's tail (grown, oldest first, when full)."""
        cdef Lease* grown
        cdef size_t i, capacity
        if self.n_leases == self.leases_capacity:
            capacity = self.leases_capacity * 2 if self.leases_capacity else 64
            grown = <Lease*>malloc(capacity * sizeof(Lease))
            if grown == NULL:
                raise MemoryError()
            for i in range(self.n_leases):
                grown[i] = self.leases[(self.leases_head + i) % self.leases_capacity]
            free(self.leases)
            self.leases, self.leases_head, self.leases_capacity = grown, 0, capacity
        i = (self.leases_head + self.n_leases) % self.leases_capacity
        self.leases[i].deadline = deadline
        self.leases[i].rid = rid
        self.n_leases += 1

    cdef _release(self, int prefill, int64_t rid, int64_t work):
        """RELEASE_KV of ``rid`` to its prefill, then its seat free: at once, or, while a
        KV_READ_DONE of several is read, with the others of that coordkit prefill at its
        end (_send_releases: a seat is freed after its release is sent)."""
        cdef bint seated = prefill >= 0 and self.seats[prefill].seated
        if self.releasing and seated and not self.seats[prefill].megatron and reserve(
            <void**>&self.releases, &self.releases_capacity, self.n_releases + 1, sizeof(Release)
        ):  # (memory short: sent at once)
            self.releases[self.n_releases].prefill = prefill
            self.releases[self.n_releases].rid = rid
            self.releases[self.n_releases].work = work
            self.n_releases += 1
            return
        self._send_rid(prefill, HEADER_RELEASE_KV, rid)
        if seated:
            self._release_seat(prefill, PD_PREFILL, work, self.seats[prefill].slot_cost)

    cdef _send_releases(self):
        """The releases a KV_READ_DONE of several made: one RELEASE_KV per prefill, its
        rids in order, then their seats freed."""
        cdef size_t i, j, count, size, n = self.n_releases
        cdef int prefill
        cdef uint8_t* out
        cdef bytes frame
        self.n_releases = 0
        for i in range(n):
            prefill = self.releases[i].prefill
            if prefill < 0:
                continue
            count = 0
            for j in range(i, n):
                count += self.releases[j].prefill == prefill
            frame = PyBytes_FromStringAndSize(NULL, CK_ARRAY_MAX + CK_INT_MAX * (1 + count))
            out = <uint8_t*>PyBytes_AS_STRING(frame)
            size = ck_write_array(out, <uint32_t>(1 + count))
            size += ck_write_int(out + size, HEADER_RELEASE_KV)
            for j in range(i, n):
                if self.releases[j].prefill == prefill:
                    size += ck_write_int(out + size, self.releases[j].rid)
            if self._open(prefill):
                send_bytes(self.loop.sock, out, size, 0)
                traffic_count(&self.loop.traffic, SENT, HEADER_RELEASE_KV, size)
            for j in range(i, n):
                if self.releases[j].prefill == prefill:
                    self.releases[j].prefill = -1
                    if self.seats[prefill].seated:
                        self._release_seat(prefill, PD_PREFILL, self.releases[j].work,
                                           self.seats[prefill].slot_cost)

    # -- what the loop calls -------------------------------------------------------------

    cdef void finished(self, uint32_t slot) noexcept nogil:
        """Its final arrived: at a decode, its read is over."""
        self.hops[slot].final = True

    cdef forget(self, uint32_t slot):
        """The request leaves the tables (its final, its error, its abort): what it holds
        goes, but pins a read may still use, which wait (orphans). Its rank is -1 after:
        the loop releases nothing of the whole-request router for it."""
        cdef Hop hop = self.hops[slot]
        cdef int64_t rid = self.loop.requests.pool[slot].server_rid
        self.loop.requests.pool[slot].rank = -1
        self.hops[slot].stage = 0
        if hop.stage == PD_QUEUED_PREFILL:
            _discard(self.prefill_queue, rid)
        elif hop.stage == PD_QUEUED_DECODE and self.seats[hop.prefill].seated:
            _discard(self.decode_queues[self.seats[hop.prefill].domain], rid)
        elif hop.stage == PD_STAGE_DECODE or hop.stage == PD_READ:
            self._release_seat(hop.decode, PD_DECODE, hop.decode_work, hop.ssm)
        # The prefill's seat is held from hop 1 until its pins go.
        if hop.pins and hop.stage == PD_STAGE_DECODE and not hop.final:
            self._orphan(slot)
        elif hop.pins:
            self._release_pins(slot)
        elif hop.stage == PD_STAGE_PREFILL and hop.prefill >= 0:
            self._release_seat(hop.prefill, PD_PREFILL, hop.prefill_work,
                               self.seats[hop.prefill].slot_cost)
        self.kept[slot] = None
        release_kept(self.prompts[slot], &self.loop.small_shared)
        self.prompts[slot] = NULL

    cdef _orphan(self, uint32_t slot):
        cdef Hop* hop = &self.hops[slot]
        cdef ck_request* request = &self.loop.requests.pool[slot]
        notify = None
        if hop.unsafe and self._megatron_client(request.client):
            notify = self.loop.peers.identity(request.client)
        deadline = monotonic() + self.lease
        self.orphans[request.server_rid] = [
            hop.prefill, hop.decode, deadline, notify, request.client_rid
        ]
        self.orphan_order.append((deadline, request.server_rid))
        hop.pins = False  # the prefill's seat stays held until they go (_free_orphan)

    cdef _free_orphan(self, int64_t rid):
        prefill, _, _, client, client_rid = self.orphans.pop(rid)
        self.counts["pins_released"] += 1
        self._release(prefill, rid, 0)
        if client is not None:
            self._tell(client, protocol.REQUEST_ABORTED.pack(client_rid, True))

    cdef bint reported(self, int rank, int64_t rid, bint final) except -1:
        """An entry naming no client in the HELD of a rebuild engine at ``rank``: one of
        the room's hops there (confirmed), or pins there that their read or lease
        releases (kept); pins the room does not know of (a handoff made under a
        coordinator before this one, or by ``rank`` before it was seen gone) are
        released now. False for anything else: the loop aborts it at the engine."""
        cdef int64_t slot = ck_requests_find(&self.loop.requests, rid)
        cdef Hop* hop
        if slot >= 0 and self.hops[slot].stage:
            hop = &self.hops[slot]
            if hop.pins and hop.prefill == rank:
                return True
            if self.loop.requests.pool[slot].rank == rank and not final:
                self.loop.requests.pool[slot].flags &= ~FLAG_UNCONFIRMED
                return True
        orphan = self.orphans.get(rid)
        if orphan is not None and orphan[0] == rank:
            return True
        if not final:
            return False
        self.counts["pins_released"] += 1
        self._send_rid(rank, HEADER_RELEASE_KV, rid)
        return True

    cdef bint _megatron_client(self, int32_t client):
        return self.megatron_clients and not self.loop.clients[client].coordkit

    cdef _tell(self, bytes identity, list frames):
        cdef int32_t client = ck_ids_find(&self.loop.client_ids, identity, len(identity))
        if client < 0 or not self.loop.clients[client].present:
            return
        if not self.loop.answers.send_frames(&self.loop.client_ids, client, frames):
            self.loop.peers.client_gone(client)

    cdef _end(self, uint32_t slot, int code, str reason, bint safe, bint aborted=False):
        """The room ends a request: its one terminal reply (a #6675 client's REQUEST_ERROR
        or, aborted, REQUEST_ABORTED; ERROR(code) for others), and what it holds goes
        (``safe`` False: its pins wait for the read, orphans)."""
        cdef Hop* hop = &self.hops[slot]
        cdef int32_t client = self.loop.requests.pool[slot].client
        cdef int64_t client_rid = self.loop.requests.pool[slot].client_rid
        if hop.stage and safe and hop.stage == PD_STAGE_DECODE:
            hop.final = True  # the decode reads nothing more: its pins go now
        # Not safe only while pins wait for a read: a safe REQUEST_ABORTED follows then.
        safe = safe or not hop.stage or not (
            hop.pins and hop.stage == PD_STAGE_DECODE and not hop.final
        )
        if hop.stage:
            hop.unsafe = not safe
        if not self._megatron_client(client):
            self.loop.refusals.fail_request(slot, code, HEADER_SUBMIT_REQUEST)
            return
        identity = self.loop.peers.identity(client)
        self.loop._forget(slot)
        self.loop.failed[code] += 1
        if aborted:
            frames = protocol.REQUEST_ABORTED.pack(client_rid, True)
        else:
            frames = protocol.REQUEST_ERROR.pack(client_rid, reason, safe)
        self._tell(identity, frames)

    cdef abort(self, uint32_t slot):
        """A client's abort: a waiting request ends at once; one at a hop is aborted there
        (its engine's answer, or a handoff, ends it)."""
        cdef int stage = self.hops[slot].stage
        cdef ck_request* request = &self.loop.requests.pool[slot]
        if stage == PD_QUEUED_PREFILL or stage == PD_QUEUED_DECODE:
            self._end(slot, ERROR_ABORTED, ABORTED_TEXT, True, True)
            return
        self._send_rid(request.rank, HEADER_ABORT_REQUEST, request.server_rid)

    cdef time_out(self, uint32_t slot):
        """Past request_timeout: ERROR(TIMED_OUT) (a #6675 client's REQUEST_ERROR), ABORT at
        the hop holding it; pins at a decode wait for its read (orphans)."""
        cdef ck_request* request = &self.loop.requests.pool[slot]
        if request.rank >= 0 and not request.flags & FLAG_ABORTED:
            self._send_rid(request.rank, HEADER_ABORT_REQUEST, request.server_rid)
        self._end(slot, ERROR_TIMED_OUT, TIMED_OUT_TEXT, False)

    cdef client_release(self, int32_t client, int64_t rid):
        """A client's RELEASE_KV of one of its requests: its pins go, to their prefill only
        (never broadcast: no client frees another's blocks)."""
        cdef int64_t slot = ck_requests_find_client(&self.loop.requests, client, rid)
        if slot >= 0 and self.hops[slot].stage and self.hops[slot].pins:
            self._release_pins(<uint32_t>slot)
            return
        identity = self.loop.peers.identity(client)
        for server_rid, orphan in list(self.orphans.items()):
            if orphan[4] == rid and orphan[3] == identity:
                self._free_orphan(server_rid)
                return
        self.loop.counters[COUNTER_UNKNOWN_REQUEST] += 1

    # -- deaths, leases ------------------------------------------------------------------

    cdef engine_gone(self, int rank):
        """An engine is gone (before the loop's walk over its requests): every request of
        the room it touched goes on or ends here, orphans it held or read are freed, and
        its seat goes."""
        cdef uint32_t i, n, slot
        cdef RequestOrder* order
        cdef Hop* hop
        if not self.seats[rank].seated:
            return
        name = self.loop.peers.engine_identity(rank)
        order = self.loop.faults.in_order(-1, -1, &n)
        try:
            for i in range(n):
                slot = order[i].slot
                hop = &self.hops[slot]
                if self.loop.requests.pool[slot].server_rid != order[i].server_rid or (
                    not hop.stage
                ):
                    continue
                if hop.prefill == rank and (
                    hop.stage == PD_STAGE_PREFILL or hop.stage == PD_QUEUED_DECODE
                    or hop.stage == PD_STAGE_DECODE
                ):
                    if hop.stage == PD_STAGE_DECODE:  # its KV is gone: the import stops
                        self._send_rid(hop.decode, HEADER_ABORT_REQUEST, order[i].server_rid)
                        self._release_seat(hop.decode, PD_DECODE, hop.decode_work, hop.ssm)
                        hop.decode = -1  # its seat is free: not freed again if it ends here
                    elif hop.stage == PD_QUEUED_DECODE:
                        _discard(self.decode_queues[self.seats[rank].domain],
                                 order[i].server_rid)
                    hop.pins = False
                    kept = self.kept[slot]
                    kept[3] = kept[4] = b""
                    self._again(slot, removed(name), True)
                elif hop.decode == rank and hop.stage == PD_STAGE_DECODE:
                    self._release_seat(rank, PD_DECODE, hop.decode_work, hop.ssm)
                    hop.decode = -1
                    self._again(slot, removed(name), False)
                elif hop.decode == rank and hop.stage == PD_READ:
                    if self.loop.requests.pool[slot].flags & FLAG_PRODUCED:
                        self._end(slot, ERROR_ENGINE_FAILED, removed(name), True)
                    else:
                        self._release_seat(rank, PD_DECODE, hop.decode_work, hop.ssm)
                        hop.stage = 0
                        self._again(slot, removed(name), True)
                elif hop.prefill == rank and hop.stage == PD_READ:
                    hop.prefill = -1  # the decode's import is whole: nothing to release
        finally:
            free(order)
        for rid, orphan in list(self.orphans.items()):
            if orphan[1] == rank:
                self._free_orphan(rid)  # a dead process reads nothing more
            elif orphan[0] == rank:
                del self.orphans[rid]
        self.unseat(rank)
        self.registrations.pop(name, None)
        self._fail_stranded()

    cdef _again(self, uint32_t slot, str reason, bint prefill):
        """After a death or a lease: prefilled again (the prompt kept), or handed off
        again (the handoff kept, the prefill still pinning), up to ``retries`` times;
        then ended with ``reason``."""
        self.hops[slot].attempts += 1
        if self.hops[slot].attempts > self.retries:
            self._end(slot, ERROR_ENGINE_FAILED, reason, True)
            return
        if prefill:
            self.counts["reprefilled"] += 1
            self._hop1(slot, True)
        else:
            self.counts["rehanded"] += 1
            self._hop2(slot, True)

    cdef _fail_stranded(self):
        """Requests waiting for a pool that no engine serves any more end."""
        cdef int64_t slot
        cdef int domain
        if self.prefill_queue and not self._live(PD_PREFILL, -1):
            for rid in list(self.prefill_queue):
                slot = ck_requests_find(&self.loop.requests, rid)
                if slot >= 0:
                    self._end(<uint32_t>slot, ERROR_NO_ENGINES, cannot_route("prefill"), True)
        for domain in range(len(self.domains)):
            queue = self.decode_queues[domain]
            if queue and not self._live(PD_DECODE, domain):
                for rid in list(queue):
                    slot = ck_requests_find(&self.loop.requests, rid)
                    if slot >= 0:
                        self._end(<uint32_t>slot, ERROR_NO_ENGINES, cannot_route("decode"), True)

    cdef tick(self, double now):
        """Leases due (pins a read never came for), orphans' leases, and the seats synced
        (an engine back, or out of quarantine, takes hops again)."""
        cdef int64_t slot, rid
        cdef double deadline
        cdef Hop* hop
        cdef int rank
        while self.n_leases and self.leases[self.leases_head].deadline <= now:
            deadline = self.leases[self.leases_head].deadline
            rid = self.leases[self.leases_head].rid
            self.leases_head = (self.leases_head + 1) % self.leases_capacity
            self.n_leases -= 1
            slot = ck_requests_find(&self.loop.requests, rid)
            if slot < 0:
                continue
            hop = &self.hops[slot]
            if not hop.stage or not hop.pins or hop.lease != deadline:
                continue
            self.counts["leases_expired"] += 1
            if hop.stage == PD_STAGE_DECODE:
                self._send_rid(hop.decode, HEADER_ABORT_REQUEST, rid)
                self._release_seat(hop.decode, PD_DECODE, hop.decode_work, hop.ssm)
                hop.decode = -1  # its seat is free: not freed again if it ends here
            elif hop.stage == PD_QUEUED_DECODE:
                _discard(self.decode_queues[self.seats[hop.prefill].domain], rid)
            self._release_pins(<uint32_t>slot)
            self._again(<uint32_t>slot, LEASE_EXPIRED, True)
        while self.orphan_order and self.orphan_order[0][0] <= now:
            _, rid = self.orphan_order.popleft()
            if rid in self.orphans and self.orphans[rid][2] <= now:
                self.counts["leases_expired"] += 1
                self._free_orphan(rid)
        for rank in range(self.loop.n_engines):
            if self.seats[rank].seated:
                self.sync(rank)
        self.drain()

    cdef dict stats(self):
        """What stats()["pd"] shows: the counts, each seat, the queues, pins held."""
        cdef uint32_t slot
        cdef int rank
        pinned = {}
        for slot in range(self.slots):
            if self.hops[slot].stage and self.hops[slot].pins:
                rank = self.hops[slot].prefill
                pinned[rank] = pinned.get(rank, 0) + 1
        for orphan in self.orphans.values():
            pinned[orphan[0]] = pinned.get(orphan[0], 0) + 1
        return {
            "mode": self.mode,
            "threshold": self.threshold,
            "counts": dict(self.counts),
            "engines": {
                rank: {
                    "role": protocol.role_name(self.seats[rank].role),
                    "megatron": self.seats[rank].megatron,
                    "capacity": self.seats[rank].capacity,
                    "reserved": self.seats[rank].reserved,
                    "pinned": pinned.get(rank, 0),
                }
                for rank in range(self.loop.n_engines)
                if self.seats[rank].seated
            },
            "queued": {
                "prefill": len(self.prefill_queue),
                "decode": sum(len(queue) for queue in self.decode_queues),
            },
            "orphans": len(self.orphans),
        }


def _discard(queue, rid):
    try:
        queue.remove(rid)
    except ValueError:
        pass


def _params_map(params):
    try:
        return unpackb(params)
    except ProtocolError:
        return None
