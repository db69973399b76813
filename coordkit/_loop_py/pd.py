"""Disaggregated prefill/decode (loop/pd.pyx)."""

from __future__ import annotations

import struct
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from .. import _codec_py as codec
from .. import _pd, protocol
from .._shared import Counter, GoneReason, Options
from ..protocol import Buffer, EngineRole, ErrorCode, Header, ProtocolError, packb, unpackb
from .dialect import Inbound
from .pdmessages import PDMessages
from .tables import ABORTED, ALIVE, GONE, PRODUCED, UNCONFIRMED, _Client, _Engine, _Request

if TYPE_CHECKING:
    from .._routing_py import Router
    from .loop import Loop


class Seat:
    """An engine with a P/D role (PD.seats, by rank): what it takes and holds."""

    __slots__ = (
        "role",
        "megatron",
        "domain",
        "capacity",
        "reserved",
        "ssm_capacity",
        "ssm_used",
        "slot_cost",
        "nccl",
        "transfer",
    )

    def __init__(self, role: int, megatron: bool, domain: str, capacity: int):
        self.role = role  # EngineRole: PREFILL takes hop 1, DECODE hop 2 (and whole requests)
        self.megatron = megatron  # a #6675 engine (REGISTER_ROLE), else a coordkit one
        self.domain = domain  # the transfer domain it moves KV within
        self.capacity = capacity  # requests it holds at most (a prefill's pinned ones counted)
        self.reserved = 0  # held now: a prefill's prefilling and pinned, a decode's handoffs
        self.ssm_capacity = 0  # a #6675 hybrid's live SSM slots (0: none)
        self.ssm_used = 0
        self.slot_cost = 0  # a hybrid prefill's SSM slots per request
        self.nccl = False  # a #6675 prefill that pushes on SEND_KV
        self.transfer: Any = None  # a decode's metadata for SEND_KV


class Hop:
    """A request of the room (PD.hops): where its two hops stand."""

    __slots__ = (
        "stage",
        "prefill",
        "decode",
        "attempts",
        "pins",
        "lease",
        "final",
        "unsafe",
        "prefill_work",
        "decode_work",
        "ssm",
        "prompt",
        "params",
        "hashes",
        "tokens",
        "kv_meta",
        "blocks",
        "decode_prompt",
    )

    def __init__(self, prompt: bytes, params: bytes, hashes: bytes | None, tokens: int):
        self.stage = 0  # QUEUED_PREFILL, PREFILL, QUEUED_DECODE, DECODE, READ (_pd)
        self.prefill = -1  # the prefill rank, kept after the read: who to release
        self.decode = -1
        self.attempts = 0  # re-prefills and re-handoffs after deaths and leases
        self.pins = False  # its prefill holds its blocks pinned (a handoff, no release yet)
        self.lease = 0.0  # the pins' deadline
        self.final = False  # its decode sent the final: the read is over
        self.unsafe = False  # ended while a read may still run: its pins wait (orphans)
        self.prefill_work = self.decode_work = 0  # the role routers' charges
        self.ssm = 0  # the SSM slots its handoff takes at the decode
        # What re-sends it: the prompt and the client's params (packed), its block
        # hashes and tokens; the handoff kept from the prefill's answer to the read.
        self.prompt, self.params, self.hashes, self.tokens = prompt, params, hashes, tokens
        self.kv_meta = self.blocks = b""
        self.decode_prompt: bytes | None = None  # a str prompt's tokens, for a #6675 decode


class Orphan:
    """Pins that outlive their request (ended while its decode may still read them)."""

    __slots__ = ("prefill", "decode", "deadline", "client", "client_rid")

    def __init__(self, prefill: int, decode: int, deadline: float, client: bytes | None, rid: int):
        self.prefill, self.decode, self.deadline = prefill, decode, deadline
        self.client = client  # a #6675 client told [31, rid, True] once they go, else None
        self.client_rid = rid


class PD:
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

    def __init__(self, loop: Loop, options: Options):
        self._loop = loop
        self.messages = PDMessages(self)
        self.mode = options.pd_mode
        self.threshold = options.pd_threshold
        self.lease = options.pd_lease
        self.retries = options.pd_retries
        self.block_size = options.block_size
        self.max_engines = options.max_engines
        self.megatron_clients = options.megatron_version == "pr6675"
        self.seats: dict[int, Seat] = {}
        self.registrations: dict[bytes, _pd.Registration] = {}  # #6675 engines, by identity
        self.prefill_router = self._new_router()
        self.decode_routers: dict[str, Router] = {}
        self.hops: dict[int, Hop] = {}  # by server id
        self.prefill_queue: deque[int] = deque()  # server ids waiting for a prefill seat
        self.decode_queues: dict[str, deque[int]] = {}  # by domain
        self.leases: deque[tuple[float, int]] = deque()  # (deadline, server id): pinned
        self.orphans: dict[int, Orphan] = {}  # by server id
        self.orphan_order: deque[tuple[float, int]] = deque()
        # while a KV_READ_DONE of several is read: by prefill, (server id, work) released
        self.releasing: dict[int, list[tuple[int, int]]] | None = None
        self.counts = dict.fromkeys(_pd.PD_COUNTS, 0)

    def _new_router(self) -> Router:
        router = self._loop._router
        return type(router)(
            router.policy, self.max_engines, block_size=self.block_size, prefix_decode_tokens=0
        )

    # -- seats ---------------------------------------------------------------------------

    def seat(self, engine: _Engine, role: int, megatron: bool, domain: str, capacity: int) -> Seat:
        """An engine takes a role (its hello, or a #6675 REGISTER_ROLE): seated, out of
        the whole-request pool unless it runs whole requests, into its role's pools."""
        self.unseat(engine.rank)
        seat = self.seats[engine.rank] = Seat(role, megatron, domain, capacity)
        if domain not in self.decode_routers:
            self.decode_routers[domain] = self._new_router()
            self.decode_queues[domain] = deque()
        if not self.whole(engine.rank):
            self._loop._router.remove_rank(engine.rank)
        self.sync(engine.rank)
        return seat

    def unseat(self, rank: int) -> None:
        """A rank leaves its role (gone, or a new engine under it)."""
        seat = self.seats.pop(rank, None)
        if seat is None:
            return
        self.prefill_router.remove_rank(rank)
        self.decode_routers[seat.domain].remove_rank(rank)

    def whole(self, rank: int) -> bool:
        """Whether a rank runs whole requests: no role, a coordkit decode (a short prompt
        prefilled where it decodes); never a #6675 engine, which registered for one hop
        (its replies would not be a decode's: #6675 gives every request both hops)."""
        seat = self.seats.get(rank)
        if seat is None:
            return True
        return not seat.megatron and bool(seat.role & EngineRole.DECODE)

    def _usable(self, rank: int) -> bool:
        engine = self._loop._engines[rank]
        return engine.state == ALIVE and engine.quarantined_until <= time.monotonic()

    def _free(self, seat: Seat, role: int) -> bool:
        if seat.reserved >= seat.capacity:
            return False
        if not seat.ssm_capacity:
            return True
        cost = seat.slot_cost if role == EngineRole.PREFILL else 1
        return seat.ssm_used + cost <= seat.ssm_capacity

    def sync(self, rank: int) -> None:
        """A rank in its role routers when it is usable with a free seat, else out."""
        seat = self.seats[rank]
        usable = self._usable(rank)
        for role, router in (
            (EngineRole.PREFILL, self.prefill_router),
            (EngineRole.DECODE, self.decode_routers[seat.domain]),
        ):
            if seat.role & role and usable and self._free(seat, role):
                router.add_rank(rank)
            else:
                router.remove_rank(rank)

    def _live(self, role: int, domain: str | None = None) -> bool:
        """Whether an engine of ``role`` (of ``domain``) is up, full or not."""
        return any(
            seat.role & role and (domain is None or seat.domain == domain) and self._usable(rank)
            for rank, seat in self.seats.items()
        )

    def _choose(self, router: Router, hop: Hop) -> int:
        """A rank of a role pool with a free seat for ``hop`` (-1: none); a rank found
        unusable since (away, quarantined) leaves the pool until the tick's sync."""
        while True:
            rank = router.choose(hop.hashes, time.monotonic(), hop.tokens)
            if rank < 0 or self._usable(rank):
                return rank
            router.release(rank, router.charged)
            router.remove_rank(rank)

    def _reserve(self, rank: int, ssm: int) -> None:
        seat = self.seats[rank]
        seat.reserved += 1
        seat.ssm_used += ssm
        self.sync(rank)

    def _release_seat(self, rank: int, role: int, work: int, ssm: int) -> None:
        """A hop's seat free again: its router's charge released, its queue drained."""
        seat = self.seats.get(rank)
        if seat is None:  # gone: its seat went with it
            return
        seat.reserved -= 1
        seat.ssm_used -= ssm
        if role == EngineRole.PREFILL:
            self.prefill_router.release(rank, work)
        else:
            self.decode_routers[seat.domain].release(rank, work)
        self.sync(rank)
        self.drain()

    def drain(self) -> None:
        """The queues' heads out while a seat of their pool is free, oldest first."""
        loop = self._loop
        while self.prefill_queue and self.prefill_router.n_accepting:
            rid = self.prefill_queue.popleft()
            request, hop = loop._find(rid), self.hops.get(rid)
            if request is not None and hop is not None and hop.stage == _pd.QUEUED_PREFILL:
                if not self._hop1(request, hop, True):
                    break
        for domain, queue in self.decode_queues.items():
            while queue and self.decode_routers[domain].n_accepting:
                rid = queue.popleft()
                request, hop = loop._find(rid), self.hops.get(rid)
                if request is not None and hop is not None and hop.stage == _pd.QUEUED_DECODE:
                    if not self._hop2(request, hop, True):
                        break

    # -- a request's hops ----------------------------------------------------------------

    def takes(self, request: _Request, inbound: Inbound) -> bool:
        """A new request: both hops (the first sent or queued), or False: it runs whole,
        as any request (no prefill or no decode engine up, and an engine that runs whole
        requests is; conditional P/D and a prompt short enough, or cached enough where
        it would run whole). Where only engines of one hop are up, it ends here with the
        missing role named, nothing prefilled."""
        if inbound.header != Header.SUBMIT_REQUEST:
            return False
        decode_up = self._live(EngineRole.DECODE)
        if (not self._live(EngineRole.PREFILL) or not decode_up) and not self._hops_only():
            return False
        hashes = None if inbound.hashes is None else bytes(inbound.hashes)
        if self.mode == "conditional" and self._loop._router.n_accepting:
            depth = self._cached_depth(hashes)
            if _pd.uncached_tokens(inbound.tokens, depth, self.block_size) <= self.threshold:
                self.counts["whole"] += 1
                return False
        params = inbound.params
        prompt: Buffer = inbound.prompt
        if params is None:  # a single frame read as far as its rid
            _, _, _, start, middle, end = codec.read_single_submit(inbound.payload[0].buffer)
            data = inbound.payload[0].buffer
            prompt, params = data[start:middle], data[middle:end]
        hop = self.hops[request.server_rid] = Hop(
            bytes(prompt), bytes(params), hashes, inbound.tokens
        )
        request.rank = -1
        if self._megatron_client(request.client) and _pd.refuses_prompt_log_probs(
            _params_map(hop.params)
        ):
            self._end(request, ErrorCode.ENGINE_FAILED, _pd.PROMPT_LOG_PROBS, True)
            return True
        if _pd.map_head(hop.params) is None:  # the room cannot add its key: a clear error
            self._end(request, ErrorCode.MALFORMED, _pd.PARAMS_NOT_A_MAP, True)
            return True
        if not decode_up and self._live(EngineRole.PREFILL):  # nothing prefilled for nothing
            self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("decode"), True)
            return True
        self.counts["requests"] += 1
        self._hop1(request, hop, False, inbound.batched)
        return True

    def _hops_only(self) -> bool:
        """Whether only role engines that run no whole request are up: a #6675 fleet
        missing a role (its requests end: the room says which role is missing)."""
        engines = self._loop._engines
        if any(self._usable(e.rank) and self.whole(e.rank) for e in engines):
            return False
        return bool(self.seats)

    def _cached_depth(self, hashes: bytes | None) -> int:
        """The leading blocks of a prompt the most cached whole-request engine holds."""
        if not hashes:
            return 0
        router, now = self._loop._router, time.monotonic()
        ranks: set[int] | None = None
        depth = 0
        for (value,) in struct.iter_unpack("<Q", hashes):
            held = {rank for rank in router.prefix_ranks(value, now) if router.accepting(rank)}
            ranks = held if ranks is None else ranks & held
            if not ranks:
                break
            depth += 1
        return depth

    def _hop1(self, request: _Request, hop: Hop, head: bool, batched: bool = False) -> bool:
        """Hop 1 to a prefill with a free seat; queued when every seat is taken (at the
        head: it was the queue's), ended when no prefill is up. True when sent. A
        request of a client's batch joins the batch a prefill granted batches is sent."""
        hop.stage = _pd.QUEUED_PREFILL
        request.rank = -1
        rank = self._choose(self.prefill_router, hop)
        if rank < 0:
            if not self._live(EngineRole.PREFILL):
                self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("prefill"), True)
            elif head:
                self.prefill_queue.appendleft(request.server_rid)
            else:
                self.prefill_queue.append(request.server_rid)
            return False
        seat = self.seats[rank]
        hop.prefill_work = self.prefill_router.charged
        self._reserve(rank, seat.slot_cost)
        hop.prefill, hop.stage, request.rank = rank, _pd.PREFILL, rank
        self._learn(rank, hop)
        engine = self._loop._engines[rank]
        if batched and engine.batch and not seat.megatron:
            # its entry in the ENGINE_SUBMIT_BATCH the loop sends once the client's
            # batch is handled
            params = _pd.with_keys(hop.params, _pd.PREFILL_OVERRIDES["coordkit"])
            frames = [hop.prompt, *self._trailer(rank, request)]
            self._loop._fanout.add(engine, request.server_rid, params, frames)
            return True
        megatron_str = seat.megatron and _pd.str_prompt(hop.prompt)
        frames = _pd.prefill_frames(
            seat.megatron, request.server_rid, hop.prompt, hop.params, megatron_str
        )
        self._send_to(rank, frames + self._trailer(rank, request))
        return True

    def _hop2(self, request: _Request, hop: Hop, head: bool) -> bool:
        """Hop 2, the handoff kept, to a decode of the prefill's domain with a free seat;
        queued when each is full; ended (its pins released) when none is up."""
        hop.stage = _pd.QUEUED_DECODE
        request.rank = -1
        domain = self.seats[hop.prefill].domain
        router = self.decode_routers[domain]
        rank = self._choose(router, hop)
        if rank < 0:
            if not self._live(EngineRole.DECODE, domain):
                self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("decode"), True)
            elif head:
                self.decode_queues[domain].appendleft(request.server_rid)
            else:
                self.decode_queues[domain].append(request.server_rid)
            return False
        seat = self.seats[rank]
        hop.decode_work = router.charged
        self._reserve(rank, hop.ssm)
        hop.decode, hop.stage, request.rank = rank, _pd.DECODE, rank
        prompt = hop.decode_prompt if seat.megatron and hop.decode_prompt else hop.prompt
        frames = _pd.decode_frames(
            seat.megatron, request.server_rid, prompt, hop.params, hop.kv_meta, hop.blocks
        )
        self._learn(rank, hop)
        self._send_to(rank, frames + self._trailer(rank, request))
        return True

    def _trailer(self, rank: int, request: _Request) -> list[bytes]:
        """A rebuild engine's trailer: no client id (a hop is not rebuilt: docs/pd.md)."""
        if not self._loop._engines[rank].rebuild:
            return []
        return [protocol.pack_trailer(request.client_rid, None, False)]

    def _learn(self, rank: int, hop: Hop) -> None:
        """A hop sent to an engine that runs whole requests too: the whole-request router
        learns the prefix it now caches (conditional P/D then finds it)."""
        if hop.hashes and self.whole(rank) and self._loop._router.policy == "prefix":
            self._loop._router.learn(rank, hop.hashes, time.monotonic())

    def _send_to(self, rank: int, frames: list[Any]) -> bool:
        engine = self._loop._engines[rank]
        if engine.state == GONE:
            return False
        if self._loop._answers.send(engine.identity, frames):
            return True
        self._loop._faults.lost(engine, GoneReason.UNREACHABLE)  # settled: engine_gone
        return False

    def _handed(
        self, rank: int, rid: int, kv_meta: bytes, blocks: bytes, ssm: int, tokens: Any
    ) -> None:
        """A prefill hop's handoff: its blocks pinned at ``rank``; on to hop 2. A handoff
        of no request of that prefill's (late, ended) is released at once."""
        request = self._loop._find(rid)
        hop = self.hops.get(rid)
        if request is None or hop is None or hop.stage != _pd.PREFILL or hop.prefill != rank:
            self.counts["stray"] += 1
            self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
            return
        hop.pins = True
        hop.kv_meta, hop.blocks, hop.ssm = kv_meta, blocks, ssm
        hop.lease = time.monotonic() + self.lease
        self.leases.append((hop.lease, rid))
        if isinstance(tokens, list):
            hop.decode_prompt = packb(tokens)
        self.counts["handoffs"] += 1
        if request.flags & ABORTED:  # its client aborted it meanwhile: nothing reads them
            self._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        self._hop2(request, hop, False)

    def _release_pins(self, rid: int, hop: Hop) -> None:
        """RELEASE_KV to the owning prefill, its seat free, the handoff dropped."""
        hop.pins = False
        hop.kv_meta = hop.blocks = b""
        self.counts["pins_released"] += 1
        self._release(hop.prefill, rid, hop.prefill_work)

    def _release(self, prefill: int, rid: int, work: int) -> None:
        """RELEASE_KV of ``rid`` to its prefill, then its seat free: at once, or, while a
        KV_READ_DONE of several is read, with the others of that coordkit prefill at its
        end (_send_releases: a seat is freed after its release is sent)."""
        seat = self.seats.get(prefill)
        if self.releasing is not None and seat is not None and not seat.megatron:
            self.releasing.setdefault(prefill, []).append((rid, work))
            return
        self._send_to(prefill, [protocol.rids_message(Header.RELEASE_KV, rid)])
        if seat is not None:
            self._release_seat(prefill, EngineRole.PREFILL, work, seat.slot_cost)

    def _send_releases(self, releases: dict[int, list[tuple[int, int]]]) -> None:
        """The releases a KV_READ_DONE of several made: one RELEASE_KV per prefill, its
        rids in order, then their seats freed."""
        for prefill, pins in releases.items():
            rids = (rid for rid, _ in pins)
            self._send_to(prefill, [protocol.rids_message(Header.RELEASE_KV, *rids)])
            for _, work in pins:
                seat = self.seats.get(prefill)
                if seat is not None:
                    self._release_seat(prefill, EngineRole.PREFILL, work, seat.slot_cost)

    # -- what the loop calls -------------------------------------------------------------

    def finished(self, request: _Request) -> None:
        """Its final arrived: at a decode, its read is over."""
        self.hops[request.server_rid].final = True

    def forget(self, request: _Request) -> None:
        """The request leaves the tables (its final, its error, its abort): what it holds
        goes, but pins a read may still use, which wait (orphans). Its rank is -1 after:
        the loop releases nothing of the whole-request router for it."""
        rid = request.server_rid
        hop = self.hops.pop(rid)
        stage = hop.stage
        request.rank = -1
        if stage == _pd.QUEUED_PREFILL:
            _discard(self.prefill_queue, rid)
        elif stage == _pd.QUEUED_DECODE and hop.prefill in self.seats:
            _discard(self.decode_queues[self.seats[hop.prefill].domain], rid)
        elif stage in (_pd.DECODE, _pd.READ):
            self._release_seat(hop.decode, EngineRole.DECODE, hop.decode_work, hop.ssm)
        # The prefill's seat is held from hop 1 until its pins go.
        if hop.pins and stage == _pd.DECODE and not hop.final:
            self._orphan(request, hop)
        elif hop.pins:
            self._release_pins(rid, hop)
        elif stage == _pd.PREFILL:
            seat = self.seats.get(hop.prefill)
            self._release_seat(
                hop.prefill,
                EngineRole.PREFILL,
                hop.prefill_work,
                0 if seat is None else seat.slot_cost,
            )

    def _orphan(self, request: _Request, hop: Hop) -> None:
        client = request.client
        notify = client.identity if hop.unsafe and self._megatron_client(client) else None
        deadline = time.monotonic() + self.lease
        self.orphans[request.server_rid] = Orphan(
            hop.prefill, hop.decode, deadline, notify, request.client_rid
        )
        self.orphan_order.append((deadline, request.server_rid))
        # the prefill's seat stays held until they go (_free_orphan)
        hop.pins = False

    def _free_orphan(self, rid: int) -> None:
        orphan = self.orphans.pop(rid)
        self.counts["pins_released"] += 1
        self._release(orphan.prefill, rid, 0)
        if orphan.client is not None:
            self._tell(orphan.client, protocol.REQUEST_ABORTED.pack(orphan.client_rid, True))

    def reported(self, rank: int, rid: int, final: bool) -> bool:
        """An entry naming no client in the HELD of a rebuild engine at ``rank``: one of
        the room's hops there (confirmed), or pins there that their read or lease
        releases (kept); pins the room does not know of (a handoff made under a
        coordinator before this one, or by ``rank`` before it was seen gone) are
        released now. False for anything else: the loop aborts it at the engine."""
        hop = self.hops.get(rid)
        if hop is not None and hop.stage:
            if hop.pins and hop.prefill == rank:
                return True
            request = self._loop._find(rid)
            if request is not None and request.rank == rank and not final:
                request.flags &= ~UNCONFIRMED
                return True
        orphan = self.orphans.get(rid)
        if orphan is not None and orphan.prefill == rank:
            return True
        if not final:
            return False
        self.counts["pins_released"] += 1
        self._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
        return True

    def _megatron_client(self, client: _Client) -> bool:
        return self.megatron_clients and not client.coordkit

    def _tell(self, identity: bytes, frames: list[bytes]) -> None:
        client = self._loop._clients.get(identity)
        if client is not None and client.present and not self._loop._answers.send(identity, frames):
            self._loop._peers.client_gone(client)

    def _end(
        self, request: _Request, code: int, reason: str, safe: bool, aborted: bool = False
    ) -> None:
        """The room ends a request: its one terminal reply (a #6675 client's REQUEST_ERROR
        or, aborted, REQUEST_ABORTED; ERROR(code) for others), and what it holds goes
        (``safe`` False: its pins wait for the read, orphans)."""
        hop = self.hops.get(request.server_rid)
        if hop is not None and safe and hop.stage == _pd.DECODE:
            hop.final = True  # the decode reads nothing more: its pins go now
        # Not safe only while pins wait for a read: a safe REQUEST_ABORTED follows then.
        safe = safe or hop is None or not (hop.pins and hop.stage == _pd.DECODE and not hop.final)
        if hop is not None:
            hop.unsafe = not safe
        client = request.client
        if not self._megatron_client(client):
            self._loop._refusals.fail_request(request, ErrorCode(code), Header.SUBMIT_REQUEST)
            return
        self._loop._forget(request)
        self._loop._failed[code] += 1
        if aborted:
            frames = protocol.REQUEST_ABORTED.pack(request.client_rid, True)
        else:
            frames = protocol.REQUEST_ERROR.pack(request.client_rid, reason, safe)
        self._tell(client.identity, frames)

    def abort(self, request: _Request) -> None:
        """A client's abort: a waiting request ends at once; one at a hop is aborted there
        (its engine's answer, or a handoff, ends it)."""
        hop = self.hops[request.server_rid]
        if hop.stage in (_pd.QUEUED_PREFILL, _pd.QUEUED_DECODE):
            self._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        abort = protocol.rids_message(Header.ABORT_REQUEST, request.server_rid)
        self._send_to(request.rank, [abort])

    def time_out(self, request: _Request) -> None:
        """Past request_timeout: ERROR(TIMED_OUT) (a #6675 client's REQUEST_ERROR), ABORT at
        the hop holding it; pins at a decode wait for its read (orphans)."""
        rank = request.rank
        if rank >= 0 and not request.flags & ABORTED:
            self._send_to(rank, [protocol.rids_message(Header.ABORT_REQUEST, request.server_rid)])
        self._end(request, ErrorCode.TIMED_OUT, _pd.TIMED_OUT_TEXT, False)

    def client_release(self, client: _Client, rid: int) -> None:
        """A client's RELEASE_KV of one of its requests: its pins go, to their prefill only
        (never broadcast: no client frees another's blocks)."""
        request = client.requests.get(rid)
        hop = None if request is None else self.hops.get(request.server_rid)
        if request is not None and hop is not None and hop.pins:
            self._release_pins(request.server_rid, hop)
            return
        for server_rid, orphan in list(self.orphans.items()):
            if orphan.client_rid == rid and self._orphan_of(orphan, server_rid, client):
                self._free_orphan(server_rid)
                return
        self._loop._counters[Counter.UNKNOWN_REQUEST] += 1

    def _orphan_of(self, orphan: Orphan, server_rid: int, client: _Client) -> bool:
        return orphan.client == client.identity

    def intercepts(self, request: _Request) -> bool:
        """A single-frame reply of this request is the prefill's answer (never shown)."""
        hop = self.hops.get(request.server_rid)
        return hop is not None and hop.stage == _pd.PREFILL

    # -- deaths, leases ------------------------------------------------------------------

    def engine_gone(self, engine: _Engine) -> None:
        """An engine is gone (before the loop's walk over its requests): every request of
        the room it touched goes on or ends here, orphans it held or read are freed, and
        its seat goes."""
        rank = engine.rank
        if rank not in self.seats:
            return
        name = engine.identity
        for rid in sorted(self.hops):
            hop = self.hops.get(rid)
            request = self._loop._find(rid)
            if hop is None or request is None:
                continue
            if hop.prefill == rank and hop.stage in (_pd.PREFILL, _pd.QUEUED_DECODE, _pd.DECODE):
                if hop.stage == _pd.DECODE:  # its KV is gone: the import stops
                    self._send_to(hop.decode, [protocol.rids_message(Header.ABORT_REQUEST, rid)])
                    self._release_seat(hop.decode, EngineRole.DECODE, hop.decode_work, hop.ssm)
                    hop.decode = -1  # its seat is free: not freed again if it ends here
                elif hop.stage == _pd.QUEUED_DECODE:
                    _discard(self.decode_queues[self.seats[rank].domain], rid)
                hop.pins = False
                hop.kv_meta = hop.blocks = b""
                self._again(request, hop, _pd.removed(name), prefill=True)
            elif hop.decode == rank and hop.stage == _pd.DECODE:
                self._release_seat(rank, EngineRole.DECODE, hop.decode_work, hop.ssm)
                hop.decode = -1
                self._again(request, hop, _pd.removed(name), prefill=False)
            elif hop.decode == rank and hop.stage == _pd.READ:
                if request.flags & PRODUCED:
                    self._end(request, ErrorCode.ENGINE_FAILED, _pd.removed(name), True)
                else:
                    self._release_seat(rank, EngineRole.DECODE, hop.decode_work, hop.ssm)
                    hop.stage = 0
                    self._again(request, hop, _pd.removed(name), prefill=True)
            elif hop.prefill == rank and hop.stage == _pd.READ:
                hop.prefill = -1  # the decode's import is whole: nothing to release
        for rid, orphan in list(self.orphans.items()):
            if orphan.decode == rank:
                self._free_orphan(rid)  # a dead process reads nothing more
            elif orphan.prefill == rank:
                del self.orphans[rid]
        self.unseat(rank)
        self.registrations.pop(name, None)
        self._fail_stranded()

    def _again(self, request: _Request, hop: Hop, reason: str, prefill: bool) -> None:
        """After a death or a lease: prefilled again (the prompt kept), or handed off
        again (the handoff kept, the prefill still pinning), up to ``retries`` times;
        then ended with ``reason``."""
        hop.attempts += 1
        if hop.attempts > self.retries:
            self._end(request, ErrorCode.ENGINE_FAILED, reason, True)
            return
        if prefill:
            self.counts["reprefilled"] += 1
            self._hop1(request, hop, True)
        else:
            self.counts["rehanded"] += 1
            self._hop2(request, hop, True)

    def _fail_stranded(self) -> None:
        """Requests waiting for a pool that no engine serves any more end."""
        loop = self._loop
        if self.prefill_queue and not self._live(EngineRole.PREFILL):
            for rid in list(self.prefill_queue):
                request = loop._find(rid)
                if request is not None:
                    self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("prefill"), True)
        for domain, queue in self.decode_queues.items():
            if queue and not self._live(EngineRole.DECODE, domain):
                for rid in list(queue):
                    request = loop._find(rid)
                    if request is not None:
                        self._end(request, ErrorCode.NO_ENGINES, _pd.cannot_route("decode"), True)

    def tick(self, now: float) -> None:
        """Leases due (pins a read never came for), orphans' leases, and the seats synced
        (an engine back, or out of quarantine, takes hops again)."""
        loop = self._loop
        while self.leases and self.leases[0][0] <= now:
            deadline, rid = self.leases.popleft()
            hop = self.hops.get(rid)
            request = loop._find(rid)
            if hop is None or request is None or not hop.pins or hop.lease != deadline:
                continue
            self.counts["leases_expired"] += 1
            if hop.stage == _pd.DECODE:
                self._send_to(hop.decode, [protocol.rids_message(Header.ABORT_REQUEST, rid)])
                self._release_seat(hop.decode, EngineRole.DECODE, hop.decode_work, hop.ssm)
                hop.decode = -1  # its seat is free: not freed again if it ends here
            elif hop.stage == _pd.QUEUED_DECODE:
                _discard(self.decode_queues[self.seats[hop.prefill].domain], rid)
            self._release_pins(rid, hop)
            self._again(request, hop, _pd.LEASE_EXPIRED, prefill=True)
        while self.orphan_order and self.orphan_order[0][0] <= now:
            _, rid = self.orphan_order.popleft()
            if rid in self.orphans and self.orphans[rid].deadline <= now:
                self.counts["leases_expired"] += 1
                self._free_orphan(rid)
        for rank in list(self.seats):
            self.sync(rank)
        self.drain()

    def stats(self) -> dict[str, Any]:
        """What stats()["pd"] shows: the counts, each seat, the queues, pins held."""
        pinned: dict[int, int] = {}
        for hop in self.hops.values():
            if hop.pins:
                pinned[hop.prefill] = pinned.get(hop.prefill, 0) + 1
        for orphan in self.orphans.values():
            pinned[orphan.prefill] = pinned.get(orphan.prefill, 0) + 1
        return {
            "mode": self.mode,
            "threshold": self.threshold,
            "counts": dict(self.counts),
            "engines": {
                rank: {
                    "role": protocol.role_name(seat.role),
                    "megatron": seat.megatron,
                    "capacity": seat.capacity,
                    "reserved": seat.reserved,
                    "pinned": pinned.get(rank, 0),
                }
                for rank, seat in sorted(self.seats.items())
            },
            "queued": {
                "prefill": len(self.prefill_queue),
                "decode": sum(len(queue) for queue in self.decode_queues.values()),
            },
            "orphans": len(self.orphans),
        }


def _discard(queue: deque[int], rid: int) -> None:
    try:
        queue.remove(rid)
    except ValueError:
        pass


def _params_map(params: bytes) -> Any:
    try:
        return unpackb(params)
    except ProtocolError:
        return None
