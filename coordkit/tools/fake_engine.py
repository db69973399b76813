"""A fake engine for demos and tests, as a class and as a process.

:class:`FakeEngine` is a complete engine rank built on
:class:`coordkit.engine.Engine` that "generates" deterministic tokens. It runs
in a thread (``FakeEngine(...).run(stop_event)``) or as a process:
``coordkit fake-engine --address ADDR --rank N`` (also ``python -m coordkit
fake-engine``), whose options :mod:`coordkit.tools.cli` parses for :func:`run`.

With a cost model it also takes the time a real engine would: prefill time
in proportion to the prompt tokens its prefix cache does not hold, decode
steps that grow with the running batch, KV transfers in proportion to the
blocks moved (see :data:`H100`). With a role it takes part in disaggregated
prefill/decode (docs/pd.md): a prefill hands each prefill hop's KV off and
pins it, a decode imports a handoff and generates (``--role``).
"""

from __future__ import annotations

import argparse
import heapq
import logging
import math
import os
import signal
import struct
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeGuard

import zmq

from .._held import DEFAULT_HELD_HASHES
from .._liveness import DEFAULT_COORDINATOR_TIMEOUT
from .._shared import logger
from ..curve import KeySource, ServerKey
from ..engine import Abort, Control, Engine, Event, ReleaseKV, Request, SendKV
from ..kvpublish import KVPublisher, block_stored
from ..protocol import BLOCK_HASH_SIZE, Header, block_hashes, unpackb
from ..tracing import asked, configure, end_span, engine_span, tracer_of

__all__ = [
    "FakeEngine",
    "CostModel",
    "H100",
    "COST_MODELS",
    "DEFAULT_CACHE_BLOCKS",
    "DEFAULT_PREFIX_BLOCK_SIZE",
    "run",
]

RUNNING, PAUSED, SUSPENDED, STOPPED = "running", "paused", "suspended", "stopped"

#: The simulated prefix cache's defaults: its capacity, and tokens per block (the
#: ``block_size`` a client should hash with, so that routing and cache agree).
DEFAULT_CACHE_BLOCKS = 4096
DEFAULT_PREFIX_BLOCK_SIZE = 16


class CostModel(NamedTuple):
    """What a step of a FakeEngine costs, in seconds of model time.

    A step's time is ``step_time + decode_per_seq * (sequences decoding) +
    (tokens prefilled in it) / prefill_rate``; it prefills at most
    ``prefill_chunk`` tokens (chunked prefill, first come first served) and
    runs at most ``max_batch`` requests (continuous batching).
    ``prefill_rate == 0`` makes prefill take no time. A decode engine's import of
    a handoff takes ``transfer_latency + (tokens moved) / transfer_rate``, the
    tokens of the blocks it does not cache already, one transfer at a time on its
    link (``transfer_rate == 0``: only the latency).
    """

    step_time: float
    prefill_rate: float
    decode_per_seq: float
    prefill_chunk: int
    max_batch: int
    transfer_rate: float = 0.0
    transfer_latency: float = 0.0


#: No cost: steps of ``latency`` seconds (0 by default), prefill free. The default.
NO_COST = CostModel(0.0, 0.0, 0.0, 8192, 64)
#: An H100-class engine, from public specs and back-of-envelope arithmetic
#: (docs/routing.md, "FakeEngine's cost model"): a ~70B model in BF16 on four H100s,
#: tensor parallel. Prefill is compute-bound: 2 * 70e9 FLOP a token against
#: 4 * 989 TFLOPS at ~40% utilisation is ~1e4 tokens/s. A decode step reads
#: the 140 GB of weights once (4 * 3.35 TB/s: ~10 ms, ~20 ms with the
#: all-reduces and kernel launches) plus each sequence's KV cache (~0.3 MB a
#: token: ~0.1 ms a step for a 4 000-token context). 8 192 tokens a step and 256
#: sequences are the order of vLLM's max_num_batched_tokens and max_num_seqs. A KV
#: transfer between engines moves ~0.3 MB a token: at ~33 GB/s (a 400 Gb/s RDMA NIC at
#: about two thirds of its line rate) that is 100 000 tokens/s, after ~2 ms of setup
#: (registering the blocks, the first round trip).
H100 = CostModel(
    step_time=0.020,
    prefill_rate=10_000.0,
    decode_per_seq=0.0001,
    prefill_chunk=8192,
    max_batch=256,
    transfer_rate=100_000.0,
    transfer_latency=0.002,
)
COST_MODELS = {"none": NO_COST, "h100": H100}

_IDLE_WAIT = 0.1  # seconds an idle step waits for messages; bounds how late a stop_event is seen
_STATE_AFTER = {
    Header.PAUSE: PAUSED,
    Header.UNPAUSE: RUNNING,
    Header.SUSPEND: SUSPENDED,
    Header.RESUME: PAUSED,
    Header.STOP: STOPPED,
}


@dataclass(slots=True)
class _Job:
    server_rid: int
    context: int  # the sum of its context's tokens (prompt, then generated)
    context_tokens: int  # its context's length
    stream: bool
    detokenize: bool
    blocks: list[Any] | None  # its block keys: chained hashes or block ids; None: unknown
    output_tokens: int
    prompt_tokens: int  # its size for the cost model
    max_partials: int | None  # None: a partial every step while streaming
    cached_blocks: int = 0  # leading blocks found in the prefix cache on admission
    prefill_left: int = 0  # tokens still to prefill before its first token
    partials: int = 0
    tokens: list[int] = field(default_factory=list)
    streamed: int = 0  # tokens sent in partials so far
    span: Any = None  # its trace span when its client traced it: from arrival to its final
    handoff: bool = False  # a prefill hop: its KV handed off, pinned, after its first token
    imported: bool = False  # a decode hop: its KV imported, not prefilled
    prompt: list[int] | None = None  # its token ids, when the engine publishes what it caches


#: A P/D role's FakeEngine counters (FakeEngine.stats()).
_PD_COUNTERS = ("handoffs", "releases", "send_kv", "imports", "blocks_moved", "read_done")


class FakeEngine(Engine):
    """An engine that "generates" deterministic tokens, for demos and tests.

    Each step admits waiting requests up to ``max_batch``, takes ``latency``
    seconds, and gives every running request one more token, a function of its
    context as a model's is: after a context of ``n`` tokens summing to ``s`` (the
    prompt's, a str's UTF-8 bytes, then those generated) it is
    ``(s * 31 + n) % vocab_size`` (see :meth:`generate`), ``output_tokens`` of
    them; a prompt extended by the first tokens generates the rest. All requests
    finishing in a step share one ENGINE_REPLY. The reply body is a msgpack map
    shaped like Megatron's: ``request_id`` (the server rid), ``rank``, ``status`` ("finished",
    "aborted", or "generating" in partials), ``generated_tokens``,
    ``logprobs`` (one per token) and ``generated_text`` (None).

    A simulated prefix (KV) cache holds the chained hashes (see
    :func:`coordkit.protocol.block_hashes`) of up to ``cache_blocks``
    prompt blocks of ``prefix_block_size`` tokens, least recently used
    evicted first. When a request with a token-id prompt is admitted, its
    leading blocks already cached (up to the first miss) are its hits, and
    then all its blocks are cached. Its bodies add ``cached_blocks`` (the
    hits) and ``prompt_blocks`` (its full blocks); other prompts get neither.
    A request whose sampling params carry ``"block_ids"`` (a list of ints,
    one per block, equal ids at a position meaning equal prefixes, as in a
    replayed trace: the coordinator consumes the block-hash frame, so the
    ids travel in the params) is cached by those ids instead, whatever its
    prompt.

    The ``cost`` model (:class:`CostModel`; default :data:`NO_COST`) sets
    what a step costs; every duration is divided by ``speedup``, for
    replaying a trace in compressed time. With a prefill rate, a request's
    prompt tokens (the length of a token-id prompt, else its bytes / 4) minus
    the ``prefix_block_size`` tokens of each cached block, at least 1, are
    prefilled in chunks before its first token. With a prefill rate or a
    per-sequence decode time, bodies also carry ``engine_busy``: the seconds
    of model time this engine has spent in steps so far.
    Sampling params may set ``"output_tokens"`` (this request's length) and
    ``"max_partials"`` (at most that many partials when streaming: 1 gives
    the first token's time without a message per token).

    Requests whose sampling params have ``"stream": True`` get one
    ENGINE_REPLY_PARTIAL per step with the tokens so far (``generated_tokens``)
    and those since the last partial (``new_tokens``) before their final;
    ``"detokenize": True`` flags the final ``needs_detokenize``. An abort is
    answered with a final of status "aborted". PAUSE and SUSPEND stop
    generation (requests still queue up) until UNPAUSE; STOP, like a set
    ``stop_event``, answers what is left as aborted, sends DISCONNECT and
    ends :meth:`run`. HEARTBEATs go out every ``heartbeat_interval`` seconds
    (default 1; None turns them off). A ``max_batch`` given (``--batch N``) is
    declared as the engine's capacity at registration: a coordinator that queues
    sends it no more than that at once, and the rest waits there; without it the
    cost model's bound runs inside the engine, which declares none.
    Like every Engine it asks for batched SUBMITs (ENGINE_HELLO) unless
    ``batch`` is False, and takes them as they come; ``implementation`` picks
    the Engine's core; ``coordinator_timeout``, ``curve_server_key``,
    ``curve_keys`` and ``held_hashes`` are the Engine's.

    A request its client traced (:attr:`Request.traceparent
    <coordkit.engine.Request.traceparent>`) gets a span ``fake-engine.request`` in that
    trace, from its arrival to its final (:func:`coordkit.tracing.engine_span`), made
    with ``tracer_provider`` or the global provider the application set; none without.

    ``role`` (``"prefill"``, ``"decode"``, ``"both"``; None: aggregated) and
    ``domain`` are the Engine's too, its capacity ``max_batch``; whatever its role,
    it runs a whole request (a SUBMIT that is not a hop) as above. A prefill hop
    (:meth:`Request.prefill_hop <coordkit.engine.Request.prefill_hop>`) is prefilled
    as any request and gets its first token; then, instead of generating, the
    engine pins ``ceil(prompt tokens / prefix_block_size)`` new block ids for it and
    sends :meth:`~coordkit.engine.Engine.handoff` with ``kv_meta`` ``{"engine",
    "resume_tokens" (the first token), "cached_blocks" (its prefix-cache hits),
    "block_size"}``; the pins stay until a RELEASE_KV names the request. A hop whose
    request wants one token only is ended whole, with a final. A decode hop (a
    handoff) is first imported: its blocks, less the leading ones this engine's
    prefix cache holds, take ``transfer_latency + blocks * prefix_block_size /
    transfer_rate`` (one transfer at a time, FIFO), then it sends KV_READ_DONE (and,
    streaming, a partial with the first token), joins the batch without a prefill
    and generates from the prefill's first token: a request's tokens are the same
    whole or disaggregated. Its bodies' ``cached_blocks`` are the prefill's hits.
    It imports by reading (NIXL's way): a SEND_KV is counted, nothing more.
    :meth:`stats` counts the pins, handoffs, releases and transfers.

    With ``kv_events`` it publishes its prefix cache's events in vLLM's wire format
    (:class:`coordkit.kvpublish.KVPublisher` on free ports of ``kv_events_host``,
    announced in its hello): a BlockStored, the block's chained hash as its own hash,
    for each block of a token-id prompt it caches, a BlockRemoved for each it evicts;
    a coordinator reading events then knows exactly what it caches.
    """

    def __init__(
        self,
        address: str,
        rank: int = 0,
        *,
        latency: float | None = None,
        max_batch: int | None = None,
        output_tokens: int = 8,
        vocab_size: int = 32000,
        cache_blocks: int = DEFAULT_CACHE_BLOCKS,
        prefix_block_size: int = DEFAULT_PREFIX_BLOCK_SIZE,
        heartbeat_interval: float | None = 1.0,
        identity: bytes | str | None = None,
        context: zmq.Context | None = None,
        cost: CostModel = NO_COST,
        speedup: float = 1.0,
        batch: bool = True,
        implementation: str | None = None,
        coordinator_timeout: float | None = DEFAULT_COORDINATOR_TIMEOUT,
        curve_server_key: ServerKey | None = None,
        curve_keys: KeySource | None = None,
        held_hashes: int = DEFAULT_HELD_HASHES,
        tracer_provider: Any = None,
        role: str | None = None,
        domain: str = "",
        kv_events: bool = False,
        kv_events_host: str = "127.0.0.1",
    ):
        # latency and max_batch, when given, override the cost model's.
        cost = cost._replace(
            step_time=cost.step_time if latency is None else latency,
            max_batch=cost.max_batch if max_batch is None else max_batch,
        )
        if min(output_tokens, cost.max_batch, cache_blocks, prefix_block_size) < 1:
            raise ValueError(
                "output_tokens, max_batch, cache_blocks and prefix_block_size must be at least 1"
            )
        rates = (cost.prefill_rate, cost.transfer_rate, cost.transfer_latency)
        if min(cost.step_time, cost.decode_per_seq, *rates) < 0:
            raise ValueError("the cost model's times and rates must be >= 0")
        if cost.prefill_chunk < 1 or not speedup > 0:
            raise ValueError("prefill_chunk must be at least 1 and speedup above 0")
        self._kv_publisher: KVPublisher | None = None
        if kv_events:
            address_host = f"tcp://{kv_events_host}:0"
            self._kv_publisher = KVPublisher(
                address_host, address_host, block_size=prefix_block_size, rank=rank
            )
        super().__init__(
            address,
            rank,
            identity,
            heartbeat_interval=heartbeat_interval,
            # its batch given, or with a P/D role (which needs one): declared
            capacity=max_batch or (cost.max_batch if role else 0),
            context=context,
            batch=batch,
            implementation=implementation,
            coordinator_timeout=coordinator_timeout,
            curve_server_key=curve_server_key,
            curve_keys=curve_keys,
            held_hashes=held_hashes,
            role=role,
            domain=domain,
            kv_events=self._kv_publisher,
        )
        self.cost = cost
        self.speedup = speedup
        self.latency = cost.step_time
        self.max_batch = cost.max_batch
        self.output_tokens = output_tokens
        self.vocab_size = vocab_size
        self.cache_blocks = cache_blocks
        self.prefix_block_size = prefix_block_size
        self.state = RUNNING
        self.epoch: int | None = None
        self._waiting: dict[int, _Job] = {}  # dicts: arrival order and O(1) removal on abort
        self._active: dict[int, _Job] = {}
        self._prefix_cache: OrderedDict[Any, None] = OrderedDict()  # block keys, LRU first
        #: Seconds of model time spent in steps (wall time * speedup).
        self.busy = 0.0
        self._tracer = tracer_of(tracer_provider)
        # P/D: a prefill's pinned block ids by request, the next id to pin; a decode's
        # imports in flight, by when their transfer ends (wall clock), and when its
        # link is free.
        self._pins: dict[int, list[int]] = {}
        self._next_block = 1
        self._importing: dict[int, _Job] = {}
        self._transfers: list[tuple[float, int]] = []  # a heap of (done, rid)
        self._link_free = 0.0
        self._pd = dict.fromkeys(_PD_COUNTERS, 0)

    def stats(self) -> dict[str, Any]:
        """What the engine holds and did in P/D: ``pinned`` (requests whose blocks
        stay pinned), ``pinned_blocks``, ``importing``, and the counts of handoffs,
        releases, SEND_KVs, imports, blocks moved and KV_READ_DONEs."""
        return {
            "role": self.role or "aggregated",
            "pinned": len(self._pins),
            "pinned_blocks": sum(len(ids) for ids in self._pins.values()),
            "importing": len(self._importing),
            **self._pd,
        }

    @staticmethod
    def generate(prompt: Sequence[int] | str | bytes, n: int, vocab_size: int = 32000) -> list[int]:
        """The ``n`` tokens a FakeEngine generates for ``prompt`` (a str counts its UTF-8
        bytes): each a function of the context so far, so ``prompt`` followed by the
        first k of them generates the rest."""
        context, length, tokens = _seed(prompt), _context_tokens(prompt), []
        for _ in range(n):
            tokens.append(_next_token(context, length, vocab_size))
            context, length = context + tokens[-1], length + 1
        return tokens

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Step until STOP arrives or ``stop_event`` is set; then abort what is left."""
        while self.step():
            if stop_event is not None and stop_event.is_set():
                break
        self._abort_all()
        self.disconnect()

    def step(self) -> bool:
        """One engine step; False once STOP has arrived."""
        self._land_imports()
        if not self._generating():
            self._take(self.poll(self._idle_wait()))
            return self.state != STOPPED
        self._take(self.poll(0))
        if not self._generating():  # aborted or paused meanwhile
            return self.state != STOPPED
        # Admit and schedule at the step's start, then wait out its compute time in
        # poll, so that arrivals are taken in meanwhile (they join the next step).
        duration = self._schedule()
        self.busy += duration
        deadline = time.monotonic() + duration / self.speedup
        while self.state != STOPPED and (left := deadline - time.monotonic()) > 0:
            self._take(self.poll(left))
        if self.state == STOPPED:
            return False
        if self.state == RUNNING:  # a PAUSE may have come during the step
            self._advance()
        return True

    def _generating(self) -> bool:
        return self.state == RUNNING and bool(self._waiting or self._active)

    def _take(self, events: list[Event]) -> None:
        aborted = []
        for event in events:
            if isinstance(event, Request):
                params = event.sampling_params if isinstance(event.sampling_params, dict) else {}
                prompt = _decode_prompt(event.prompt)
                ids = params.get("block_ids")
                job = _Job(
                    event.server_rid,
                    _seed(prompt),
                    _context_tokens(prompt),
                    bool(params.get("stream")),
                    bool(params.get("detokenize")),
                    list(ids) if _int_list(ids) else self._blocks(prompt),
                    _positive(params.get("output_tokens")) or self.output_tokens,
                    _prompt_tokens(prompt),
                    _positive(params.get("max_partials")),
                )
                if self._kv_publisher is not None and not _int_list(ids):
                    job.prompt = prompt if _int_list(prompt) else None
                if event.prefill_hop() and job.output_tokens > 1:
                    job.handoff, job.output_tokens = True, 1
                if event.decode_hop():
                    self._import(job, event)
                else:
                    self._waiting[event.server_rid] = job
                if event.traceparent is not None and self._tracer is not None:
                    job.span = engine_span(event, self._tracer, "fake-engine.request")
            elif isinstance(event, Abort):
                rid = event.server_rid
                dropped = (
                    self._waiting.pop(rid, None)
                    or self._active.pop(rid, None)
                    or self._importing.pop(rid, None)  # its transfer is dropped
                )
                if dropped is not None:
                    aborted.append(dropped)
            elif isinstance(event, ReleaseKV):
                self._pd["releases"] += self._pins.pop(event.rid, None) is not None
            elif isinstance(event, SendKV):
                self._pd["send_kv"] += 1  # it imports by reading: nothing is pushed
            elif isinstance(event, Control) and self.state != STOPPED:  # STOP is final
                if event.header == Header.SET_GENERATION_EPOCH:
                    self.epoch = event.epoch
                self.state = _STATE_AFTER.get(event.header, self.state)
        self._finish(aborted, "aborted")

    def _schedule(self) -> float:
        """Admit waiting requests and spend this step's prefill budget; the step's
        duration in model time. Prefill in flight is taken first come first served."""
        while self._waiting and len(self._active) < self.max_batch:
            rid = next(iter(self._waiting))
            self._active[rid] = job = self._waiting.pop(rid)
            self._prefill(job)
        cost = self.cost
        budget = cost.prefill_chunk
        decoding = 0
        for job in self._active.values():
            if job.prefill_left == 0:
                decoding += 1
            elif budget:
                chunk = min(job.prefill_left, budget)
                job.prefill_left -= chunk
                budget -= chunk
        prefilled = cost.prefill_chunk - budget
        duration = cost.step_time + cost.decode_per_seq * decoding
        if cost.prefill_rate:
            duration += prefilled / cost.prefill_rate
        return duration

    def _advance(self) -> None:
        """The step's end: a token for every request whose prefill is done."""
        partial, finished = [], []
        for job in self._active.values():
            if job.prefill_left:
                continue
            token = _next_token(job.context, job.context_tokens, self.vocab_size)
            job.tokens.append(token)
            job.context += token
            job.context_tokens += 1
            if len(job.tokens) >= job.output_tokens:
                finished.append(job)
            elif job.stream and (job.max_partials is None or job.partials < job.max_partials):
                job.partials += 1
                partial.append(job)
        for job in finished:
            del self._active[job.server_rid]
        self.reply_partial((job.server_rid, self._partial(job)) for job in partial)
        self._finish(finished, "finished")

    def _blocks(self, prompt: list[int] | str | bytes) -> list[bytes] | None:
        """The prompt's chained block hashes, as a client computes them; None if not token ids."""
        if not isinstance(prompt, list):
            return None
        try:
            frame = block_hashes(prompt, self.prefix_block_size)
        except struct.error:  # ids outside u32 have no block hashes (a client cannot send them)
            return None
        return [frame[i : i + BLOCK_HASH_SIZE] for i in range(0, len(frame), BLOCK_HASH_SIZE)]

    def _prefill(self, job: _Job) -> None:
        """Count the job's leading cached blocks, cache all of its blocks, and
        set what is left to prefill (with a prefill rate)."""
        if job.blocks is not None:
            cache = self._prefix_cache
            if not job.imported:  # an import reports its prefill's hits
                job.cached_blocks = self._cached_prefix(job.blocks)
            stored = []  # (index in the prompt, block) of those it did not hold
            for i, block in enumerate(job.blocks):
                if block not in cache:
                    stored.append((i, block))
                cache[block] = None
                cache.move_to_end(block)
            evicted = []
            while len(cache) > self.cache_blocks:
                evicted.append(cache.popitem(last=False)[0])
            if self._kv_publisher is not None:
                self._publish(job, stored, evicted)
        if self.cost.prefill_rate and not job.imported:
            cached = job.cached_blocks * self.prefix_block_size
            job.prefill_left = max(job.prompt_tokens - cached, 1)

    def _publish(self, job: _Job, stored: list[tuple[int, Any]], evicted: list[Any]) -> None:
        """The cache's events of one admission: its blocks stored, then those evicted
        (a request longer than the cache evicts some of its own)."""
        assert self._kv_publisher is not None and job.blocks is not None
        size = self.prefix_block_size
        events = []
        if job.prompt is not None:
            for i, block in stored:  # chained hashes, as the protocol's: parent, then tokens
                parent = None if i == 0 else _key(job.blocks[i - 1])
                tokens = job.prompt[i * size : (i + 1) * size]
                events.append(block_stored([_key(block)], parent, tokens, size))
        gone = [_key(block) for block in evicted if isinstance(block, bytes)]
        if gone:
            events.append({"type": "BlockRemoved", "block_hashes": gone, "medium": "GPU"})
        if events:
            self._kv_publisher.publish(events)

    def close(self) -> None:
        super().close()
        if self._kv_publisher is not None:
            self._kv_publisher.close()

    def _cached_prefix(self, blocks: list[Any]) -> int:
        """The leading blocks the prefix cache holds: a cache reuses KV up to its first miss."""
        cache = self._prefix_cache
        return next((i for i, block in enumerate(blocks) if block not in cache), len(blocks))

    def _abort_all(self) -> None:
        jobs = [*self._active.values(), *self._waiting.values(), *self._importing.values()]
        self._active.clear()
        self._waiting.clear()
        self._importing.clear()
        self._transfers.clear()
        self._finish(jobs, "aborted")

    def _finish(self, jobs: list[_Job], status: str) -> None:
        if status == "finished" and any(job.handoff for job in jobs):
            self._hand_off([job for job in jobs if job.handoff])
            jobs = [job for job in jobs if not job.handoff]
        for job in jobs:  # a span ends as its final leaves, not after its client had it
            if job.span is not None:
                job.span.set_attribute("coordkit.rank", self.rank)
                job.span.set_attribute("coordkit.status", status)
                job.span.set_attribute("coordkit.generated_tokens", len(job.tokens))
                end_span(job.span)
        self.reply((job.server_rid, self._body(job, status), job.detokenize) for job in jobs)

    def _partial(self, job: _Job) -> dict[str, Any]:
        """A partial: the body so far, and ``new_tokens``, those since the last partial
        (as Megatron's partials carry them: what a coordinator migrating the stream to
        another engine needs)."""
        body = self._body(job, "generating")
        body["new_tokens"] = job.tokens[job.streamed :]
        job.streamed = len(job.tokens)
        return body

    # -- P/D --------------------------------------------------------------------------------

    def _hand_off(self, jobs: list[_Job]) -> None:
        """Prefill hops with their first token: their blocks pinned, their KV handed off."""
        handoffs = []
        for job in jobs:
            count = max(math.ceil(job.prompt_tokens / self.prefix_block_size), 1)
            ids = list(range(self._next_block, self._next_block + count))
            self._next_block += count
            self._pins[job.server_rid] = ids
            kv_meta = {
                "engine": self.identity.decode(errors="replace"),
                "resume_tokens": job.tokens[:1],
                "cached_blocks": job.cached_blocks,
                "block_size": self.prefix_block_size,
            }
            handoffs.append((job.server_rid, kv_meta, ids))
        self._pd["handoffs"] += len(handoffs)
        self.handoff(handoffs)

    def _import(self, job: _Job, event: Request) -> None:
        """A decode hop: its transfer starts when this engine's link is free, and takes
        the time the blocks it does not cache take to move."""
        kv_meta = event.kv_meta if isinstance(event.kv_meta, dict) else {}
        resume = kv_meta.get("resume_tokens")
        job.imported = True
        job.tokens = list(resume[:1]) if _int_list(resume) else []
        job.context += sum(job.tokens)  # its context: the prompt, then the prefill's token
        job.context_tokens += len(job.tokens)
        cached = kv_meta.get("cached_blocks")
        job.cached_blocks = cached if type(cached) is int else 0
        try:
            blocks = event.src_blocks()
        except Exception:  # not msgpack: nothing to read
            blocks = None
        here = 0 if job.blocks is None else self._cached_prefix(job.blocks)
        moved = max(len(blocks) - here, 0) if isinstance(blocks, list) else 0
        cost = self.cost
        seconds = cost.transfer_latency
        if cost.transfer_rate:
            seconds += moved * self.prefix_block_size / cost.transfer_rate
        start = max(time.monotonic(), self._link_free)
        self._link_free = done = start + seconds / self.speedup
        heapq.heappush(self._transfers, (done, job.server_rid))
        self._importing[job.server_rid] = job
        self._pd["imports"] += 1
        self._pd["blocks_moved"] += moved

    def _idle_wait(self) -> float:
        """How long an idle step waits for messages: until the next transfer ends, at most."""
        if not self._transfers:
            return _IDLE_WAIT
        return min(max(self._transfers[0][0] - time.monotonic(), 0.0), _IDLE_WAIT)

    def _land_imports(self) -> None:
        """Imports whose transfer ended, together: one KV_READ_DONE, the first token
        when streaming, and into the batch (or ended, when the first token was all it
        wanted)."""
        now = time.monotonic()
        landed = []
        while self._transfers and self._transfers[0][0] <= now:
            _, rid = heapq.heappop(self._transfers)
            job = self._importing.pop(rid, None)
            if job is not None:  # else aborted meanwhile
                landed.append((rid, job))
        if not landed:
            return
        self.kv_read_done(*(rid for rid, _ in landed))
        self._pd["read_done"] += len(landed)
        done = [job for _, job in landed if len(job.tokens) >= job.output_tokens]
        if done:
            self._finish(done, "finished")
        partials = []
        for rid, job in landed:
            if len(job.tokens) >= job.output_tokens:
                continue  # finished above
            if job.tokens and job.stream:  # max_partials is at least 1
                job.partials += 1
                partials.append((rid, self._partial(job)))
            self._waiting[rid] = job
        if partials:
            self.reply_partial(partials)

    def _body(self, job: _Job, status: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "request_id": job.server_rid,
            "rank": self.rank,
            "status": status,
            "generated_tokens": job.tokens,
            "logprobs": [-((t % 1000) + 1) / 1000 for t in job.tokens],
            "generated_text": None,
        }
        if job.blocks is not None:
            body["cached_blocks"] = job.cached_blocks
            body["prompt_blocks"] = len(job.blocks)
        if self.cost.prefill_rate or self.cost.decode_per_seq:
            body["engine_busy"] = self.busy
        return body


def _key(block: bytes) -> int:
    """A block's chained hash as the u64 the engine publishes it under."""
    return int.from_bytes(block, "little")


def _decode_prompt(frame: zmq.Frame) -> list[int] | str | bytes:
    """A prompt frame as token ids or text if it is msgpack of either, else its bytes."""
    try:
        prompt = unpackb(frame.buffer)
    except Exception:  # not msgpack: a raw-bytes prompt
        return frame.bytes
    if isinstance(prompt, str) or (
        isinstance(prompt, list) and all(type(t) is int for t in prompt)
    ):
        return prompt
    return frame.bytes


def _seed(prompt: Sequence[int] | str | bytes) -> int:
    return sum(prompt.encode() if isinstance(prompt, str) else prompt)


def _context_tokens(prompt: Sequence[int] | str | bytes) -> int:
    return len(prompt.encode() if isinstance(prompt, str) else prompt)


def _next_token(context: int, length: int, vocab_size: int) -> int:
    """The token after a context of ``length`` tokens summing to ``context``."""
    return (context * 31 + length) % vocab_size


def _prompt_tokens(prompt: list[int] | str | bytes) -> int:
    """A prompt's size in tokens, as the coordinator counts it (codec.prompt_tokens)."""
    if isinstance(prompt, list):
        return len(prompt)
    return -(-len(prompt.encode() if isinstance(prompt, str) else prompt) // 4)


def _int_list(value: object) -> TypeGuard[list[int]]:
    return isinstance(value, list) and all(type(v) is int for v in value)


def _positive(value: object) -> int | None:
    return value if type(value) is int and value > 0 else None


def run(args: argparse.Namespace) -> int:
    """``coordkit fake-engine``: run one FakeEngine rank until STOP, SIGTERM or SIGINT.

    The engine's log goes to stderr, one line each: registered (acknowledged by
    the coordinator), not registered after a few seconds, the coordinator lost;
    warnings only with ``--quiet``.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING if args.quiet else logging.INFO)
    provider = None
    if asked(os.environ):  # the OTEL_* variables: it continues its clients' traces
        try:
            provider = configure("coordkit-fake-engine")
        except ImportError as exc:
            logger.warning("%s (the OTEL_* variables ask for traces)", exc)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    cost = COST_MODELS[args.cost_model]
    overrides = {
        "prefill_rate": args.prefill_rate,
        "decode_per_seq": args.decode_per_seq,
        "prefill_chunk": args.prefill_chunk,
        "transfer_rate": args.transfer_rate,
        "transfer_latency": args.transfer_latency,
    }
    cost = cost._replace(**{k: v for k, v in overrides.items() if v is not None})
    with FakeEngine(
        args.address,
        args.rank,
        latency=args.latency,
        max_batch=args.batch,
        output_tokens=args.output_tokens,
        cache_blocks=args.cache_blocks,
        prefix_block_size=args.prefix_block_size,
        heartbeat_interval=args.heartbeat or None,
        cost=cost,
        speedup=args.speedup,
        coordinator_timeout=args.coordinator_timeout or None,
        curve_server_key=args.curve_server_key,
        curve_keys=args.curve_keys,
        held_hashes=args.held_hashes,
        tracer_provider=provider,
        role=args.role,
        domain=args.domain,
        kv_events=args.kv_events,
    ) as engine:
        engine.run(stop)
    if provider is not None:
        provider.shutdown()  # its last spans exported
    return 0
