"""A fake engine for demos and tests, as a class and as a process.

:class:`FakeEngine` is a complete engine rank built on
:class:`coordkit.engine.Engine` that "generates" deterministic tokens. It runs
in a thread (``FakeEngine(...).run(stop_event)``) or as a process:
``coordkit fake-engine --address ADDR --rank N`` (also ``python -m coordkit
fake-engine``), whose options :mod:`coordkit.tools.cli` parses for :func:`run`.
"""

from __future__ import annotations

import argparse
import signal
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from coordkit.engine import Abort, Control, Engine, Event, Request
from coordkit.protocol import BLOCK_HASH_SIZE, Header, block_hashes, unpackb

__all__ = ["FakeEngine", "DEFAULT_CACHE_BLOCKS", "DEFAULT_PREFIX_BLOCK_SIZE", "run"]

RUNNING, PAUSED, SUSPENDED, STOPPED = "running", "paused", "suspended", "stopped"

#: The simulated prefix cache's defaults: its capacity, and tokens per block (the
#: ``block_size`` a client should hash with, so that routing and cache agree).
DEFAULT_CACHE_BLOCKS = 4096
DEFAULT_PREFIX_BLOCK_SIZE = 16

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
    seed: int
    stream: bool
    detokenize: bool
    blocks: list[bytes] | None  # the prompt's chained block hashes; None: not token ids
    cached_blocks: int = 0  # leading blocks found in the prefix cache on admission
    tokens: list[int] = field(default_factory=list)


class FakeEngine(Engine):
    """An engine that "generates" deterministic tokens, for demos and tests.

    Each step admits waiting requests up to ``max_batch``, takes ``latency``
    seconds, and gives every running request one more token: token ``k`` of a
    prompt is ``(sum(prompt) * 31 + k) % vocab_size`` (see :meth:`generate`),
    ``output_tokens`` of them. All requests finishing in a step share one
    ENGINE_REPLY. The reply body is a msgpack map shaped like Megatron's:
    ``request_id`` (the server rid), ``rank``, ``status`` ("finished",
    "aborted", or "generating" in partials), ``generated_tokens``,
    ``logprobs`` (one per token) and ``generated_text`` (None).

    A simulated prefix (KV) cache holds the chained hashes (see
    :func:`coordkit.protocol.block_hashes`) of up to ``cache_blocks``
    prompt blocks of ``prefix_block_size`` tokens, least recently used
    evicted first. When a request with a token-id prompt is admitted, its
    leading blocks already cached (up to the first miss) are its hits, and
    then all its blocks are cached. Its bodies add ``cached_blocks`` (the
    hits) and ``prompt_blocks`` (its full blocks); other prompts get neither.

    Requests whose sampling params have ``"stream": True`` get one
    ENGINE_REPLY_PARTIAL per step with the tokens so far before their final;
    ``"detokenize": True`` flags the final ``needs_detokenize``. An abort is
    answered with a final of status "aborted". PAUSE and SUSPEND stop
    generation (requests still queue up) until UNPAUSE; STOP, like a set
    ``stop_event``, answers what is left as aborted, sends DISCONNECT and
    ends :meth:`run`. HEARTBEATs go out every ``heartbeat_interval`` seconds
    (default 1; None turns them off), advertising ``max_batch`` as capacity.
    Like every Engine it asks for batched SUBMITs (ENGINE_HELLO) unless
    ``batch`` is False, and takes them as they come; ``implementation`` picks
    the Engine's core.
    """

    def __init__(
        self,
        address: str,
        rank: int = 0,
        *,
        latency: float = 0.0,
        max_batch: int = 64,
        output_tokens: int = 8,
        vocab_size: int = 32000,
        cache_blocks: int = DEFAULT_CACHE_BLOCKS,
        prefix_block_size: int = DEFAULT_PREFIX_BLOCK_SIZE,
        heartbeat_interval: float | None = 1.0,
        identity: bytes | str | None = None,
        context: zmq.Context | None = None,
        batch: bool = True,
        implementation: str | None = None,
    ):
        if min(output_tokens, max_batch, cache_blocks, prefix_block_size) < 1:
            raise ValueError(
                "output_tokens, max_batch, cache_blocks and prefix_block_size must be at least 1"
            )
        super().__init__(
            address,
            rank,
            identity,
            heartbeat_interval=heartbeat_interval,
            capacity=max_batch,
            context=context,
            batch=batch,
            implementation=implementation,
        )
        self.latency = latency
        self.max_batch = max_batch
        self.output_tokens = output_tokens
        self.vocab_size = vocab_size
        self.cache_blocks = cache_blocks
        self.prefix_block_size = prefix_block_size
        self.state = RUNNING
        self.epoch: int | None = None
        self._waiting: dict[int, _Job] = {}  # dicts: arrival order and O(1) removal on abort
        self._active: dict[int, _Job] = {}
        self._prefix_cache: OrderedDict[bytes, None] = OrderedDict()  # block hashes, LRU first

    @staticmethod
    def generate(prompt: Sequence[int] | str | bytes, n: int, vocab_size: int = 32000) -> list[int]:
        """The ``n`` tokens a FakeEngine generates for ``prompt`` (a str counts its UTF-8 bytes)."""
        seed = _seed(prompt)
        return [(seed * 31 + k) % vocab_size for k in range(n)]

    def run(self, stop_event: threading.Event | None = None) -> None:
        """Step until STOP arrives or ``stop_event`` is set; then abort what is left."""
        while self.step():
            if stop_event is not None and stop_event.is_set():
                break
        self._abort_all()
        self.disconnect()

    def step(self) -> bool:
        """One engine step; False once STOP has arrived."""
        if not self._generating():
            self._take(self.poll(_IDLE_WAIT))
            return self.state != STOPPED
        self._take(self.poll(0))
        # The step's compute time: wait it out in poll, so arrivals are taken in meanwhile.
        deadline = time.monotonic() + self.latency
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
                self._waiting[event.server_rid] = _Job(
                    event.server_rid,
                    _seed(prompt),
                    bool(params.get("stream")),
                    bool(params.get("detokenize")),
                    self._blocks(prompt),
                )
            elif isinstance(event, Abort):
                rid = event.server_rid
                job = self._waiting.pop(rid, None) or self._active.pop(rid, None)
                if job is not None:
                    aborted.append(job)
            elif isinstance(event, Control) and self.state != STOPPED:  # STOP is final
                if event.header == Header.SET_GENERATION_EPOCH:
                    self.epoch = event.epoch
                self.state = _STATE_AFTER.get(event.header, self.state)
        self._finish(aborted, "aborted")

    def _advance(self) -> None:
        while self._waiting and len(self._active) < self.max_batch:
            rid = next(iter(self._waiting))
            self._active[rid] = job = self._waiting.pop(rid)
            self._prefill(job)
        partial, finished = [], []
        for job in self._active.values():
            job.tokens.append((job.seed * 31 + len(job.tokens)) % self.vocab_size)
            if len(job.tokens) >= self.output_tokens:
                finished.append(job)
            elif job.stream:
                partial.append(job)
        for job in finished:
            del self._active[job.server_rid]
        self.reply_partial((job.server_rid, self._body(job, "generating")) for job in partial)
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
        """Count the job's leading cached blocks, then cache all of its blocks."""
        if job.blocks is None:
            return
        cache = self._prefix_cache
        # A prefix cache reuses KV only up to the first missing block.
        job.cached_blocks = next(
            (i for i, block in enumerate(job.blocks) if block not in cache), len(job.blocks)
        )
        for block in job.blocks:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > self.cache_blocks:
            cache.popitem(last=False)

    def _abort_all(self) -> None:
        jobs = [*self._active.values(), *self._waiting.values()]
        self._active.clear()
        self._waiting.clear()
        self._finish(jobs, "aborted")

    def _finish(self, jobs: list[_Job], status: str) -> None:
        self.reply((job.server_rid, self._body(job, status), job.detokenize) for job in jobs)

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
        return body


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


def run(args: argparse.Namespace) -> int:
    """``coordkit fake-engine``: run one FakeEngine rank until STOP, SIGTERM or SIGINT."""
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with FakeEngine(
        args.address,
        args.rank,
        latency=args.latency,
        max_batch=args.batch,
        output_tokens=args.output_tokens,
        cache_blocks=args.cache_blocks,
        prefix_block_size=args.prefix_block_size,
        heartbeat_interval=args.heartbeat or None,
    ) as engine:
        engine.run(stop)
    return 0
