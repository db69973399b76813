"""The engine side: an engine rank's endpoint, and a fake engine for demos and tests.

:class:`Engine` is what an inference engine's step loop talks to: it
registers with the coordinator, hands out what arrived as small event
objects, and sends each step's finished requests as one batched reply::

    with Engine("ipc:///tmp/coordkit.sock", rank=0) as engine:
        while True:
            for event in engine.poll(timeout=0.01):
                ...  # Request, Abort, ReleaseKV or Control
            engine.reply([(rid, body) for rid, body in finished_this_step])

It is synchronous (engine step loops are) and not thread-safe: use one
Engine from one thread. :class:`FakeEngine` is a complete engine built on it
that "generates" deterministic tokens; ``python -m coordkit.engine`` runs one
as a process.
"""

from __future__ import annotations

import argparse
import logging
import math
import signal
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq

from . import protocol
from .protocol import BLOCK_HASH_SIZE, Header, ProtocolError, block_hashes, packb, unpackb

__all__ = ["Engine", "FakeEngine", "Request", "Abort", "ReleaseKV", "Control", "Event", "main"]

log = logging.getLogger(__name__)

_MAX_DRAIN = 4096  # messages taken per poll, so a flood cannot starve the step loop
_CLOSE_LINGER_MS = 1000  # lets the last replies and DISCONNECT leave on close()


@dataclass(frozen=True, slots=True)
class Request:
    """A new request: SUBMIT_REQUEST, or SUBMIT_REQUEST_WITH_KV when ``kv_meta`` is set.

    ``prompt`` (and ``src_block_ids``) are the received frames, not copies.
    """

    server_rid: int
    sampling_params: Any
    prompt: zmq.Frame
    kv_meta: Any = None
    src_block_ids: zmq.Frame | None = None

    def prompt_tokens(self) -> Any:
        """The prompt msgpack-decoded: token ids (or a str, as the client sent it)."""
        return unpackb(self.prompt.buffer)


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort ``server_rid``; the engine still owes it a final reply."""

    server_rid: int


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """RELEASE_KV, broadcast to every engine; ``rid`` is the id the client sent."""

    rid: int


@dataclass(frozen=True, slots=True)
class Control:
    """A control signal (PAUSE ... STOP_CUDA_PROFILER); ``epoch`` for SET_GENERATION_EPOCH."""

    header: Header
    epoch: int | None = None


Event = Request | Abort | ReleaseKV | Control

#: A reply entry: (server_rid, body) or (server_rid, body, needs_detokenize).
#: A body that is not bytes-like is msgpack-packed.
ReplyEntry = tuple[int, Any] | tuple[int, Any, bool]


class Engine:
    """One engine rank's connection to the coordinator (a DEALER with an identity).

    ``pending`` counts requests received and not yet answered with a final
    reply. With ``heartbeat_interval`` set, :meth:`poll` sends
    HEARTBEAT ``[91, pending, capacity]`` that often (the first at once), so
    the coordinator can declare the engine gone when they stop.
    """

    def __init__(
        self,
        address: str,
        rank: int = 0,
        identity: bytes | str | None = None,
        *,
        heartbeat_interval: float | None = None,
        capacity: int = 0,
        context: zmq.Context | None = None,
    ):
        if identity is None:
            identity = f"engine-{rank}"
        self.address = address
        self.rank = rank
        self.identity = identity.encode() if isinstance(identity, str) else identity
        self.heartbeat_interval = heartbeat_interval
        self.capacity = capacity
        self.pending = 0
        self._next_heartbeat = time.monotonic() if heartbeat_interval else math.inf
        # An own context, so close() can wait (up to the linger) for the last replies to leave.
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        # No high-water marks: the coordinator's max_inflight bounds what can queue here.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.connect(address)
        self._socket.send(b"")  # registration

    def poll(self, timeout: float = 0.0) -> list[Event]:
        """Wait up to ``timeout`` seconds for messages and return their events.

        Returns as soon as something arrived, with everything that is queued;
        an empty list on timeout. Sends a HEARTBEAT whenever one is due.
        """
        deadline = time.monotonic() + timeout
        while True:
            now = time.monotonic()
            if now >= self._next_heartbeat:
                self._send_heartbeat(now)
            wait = min(deadline, self._next_heartbeat) - now
            if self._socket.poll(math.ceil(max(wait, 0.0) * 1000), zmq.POLLIN):
                return self._drain()
            if time.monotonic() >= deadline:
                return []

    def reply(self, finished: Iterable[ReplyEntry]) -> None:
        """Send the final replies of one step as ONE batched ENGINE_REPLY."""
        entries, bodies = [], []
        for rid, body, *detokenize in finished:
            entries.append([rid, bool(detokenize and detokenize[0])])
            bodies.append(_encode_body(body))
        if entries:
            self._socket.send_multipart(protocol.ENGINE_REPLY.pack(entries, bodies), copy=False)
            self.pending = max(self.pending - len(entries), 0)

    def reply_partial(self, partial: Iterable[tuple[int, Any]]) -> None:
        """Send the partial replies of one step as ONE batched ENGINE_REPLY_PARTIAL."""
        entries, bodies = [], []
        for rid, body in partial:
            entries.append(rid)
            bodies.append(_encode_body(body))
        if entries:
            frames = protocol.ENGINE_REPLY_PARTIAL.pack(entries, bodies)
            self._socket.send_multipart(frames, copy=False)

    def disconnect(self) -> None:
        """Tell the coordinator this rank takes no new work (send finals for what it holds)."""
        self._socket.send_multipart(protocol.DISCONNECT.pack())

    def close(self) -> None:
        self._socket.close(linger=_CLOSE_LINGER_MS)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send_heartbeat(self, now: float) -> None:
        self._socket.send(packb([Header.HEARTBEAT, self.pending, self.capacity]))
        self._next_heartbeat = now + (self.heartbeat_interval or math.inf)

    def _drain(self) -> list[Event]:
        events = []
        for _ in range(_MAX_DRAIN):
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            try:
                events.append(self._parse(frames))
            except ProtocolError as exc:
                log.warning("engine %s: dropped a malformed message: %s", self.rank, exc)
        return events

    def _parse(self, frames: list[zmq.Frame]) -> Event:
        try:
            header = unpackb(frames[0].buffer)[0]
        except Exception as exc:  # msgpack raises several unrelated types
            raise ProtocolError(f"unreadable metadata frame ({exc!r})") from None
        if header == Header.SUBMIT_REQUEST:
            submit = protocol.SUBMIT_REQUEST.parse(frames)
            self.pending += 1
            return Request(submit.rid, submit.sampling_params, submit.prompt)
        if header == Header.SUBMIT_REQUEST_WITH_KV:
            submit = protocol.SUBMIT_REQUEST_WITH_KV.parse(frames)
            self.pending += 1
            return Request(
                submit.rid,
                submit.sampling_params,
                submit.prompt,
                submit.kv_meta,
                submit.src_block_ids,
            )
        if header == Header.ABORT_REQUEST:
            return Abort(protocol.ABORT_REQUEST.parse(frames).rid)
        if header == Header.RELEASE_KV:
            return ReleaseKV(protocol.RELEASE_KV.parse(frames).rid)
        if header in protocol.CONTROL:
            message = protocol.CONTROL[header].parse(frames)
            return Control(Header(header), getattr(message, "epoch", None))
        raise ProtocolError(f"unexpected header {header!r}")


def _encode_body(body: Any) -> Any:
    return body if isinstance(body, (bytes, bytearray, memoryview, zmq.Frame)) else packb(body)


# -- the fake engine -----------------------------------------------------------------

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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m coordkit.engine``: run one FakeEngine rank until STOP, SIGTERM or SIGINT."""
    parser = argparse.ArgumentParser(
        prog="python -m coordkit.engine", description="Run a fake coordkit engine rank."
    )
    parser.add_argument("--address", required=True, help="the coordinator's endpoint")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.0, help="seconds per step")
    parser.add_argument("--batch", type=int, default=64, help="max requests per step")
    parser.add_argument("--output-tokens", type=int, default=8, help="tokens per request")
    parser.add_argument(
        "--cache-blocks",
        type=int,
        default=DEFAULT_CACHE_BLOCKS,
        help="prefix cache capacity in blocks",
    )
    parser.add_argument(
        "--prefix-block-size",
        type=int,
        default=DEFAULT_PREFIX_BLOCK_SIZE,
        help="tokens per prefix cache block (the clients' block_size)",
    )
    parser.add_argument(
        "--heartbeat", type=float, default=1.0, help="seconds between heartbeats (0: none)"
    )
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
