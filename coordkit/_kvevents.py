"""The engines' own KV-cache events, in vLLM's wire format, for both loop cores.

An engine (vLLM, SGLang, or a coordkit engine's publisher helper) publishes on a
ZeroMQ PUB socket, one message per batch of events: three frames ``[topic, seq,
payload]``, ``seq`` an 8-byte big-endian counter from 0 at the engine process's
start, ``payload`` the msgpack of ``[ts, events, data_parallel_rank]`` (or the
same as a map). An event is an array whose first item is its type
(``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, group_idx, ...]``, ``["BlockRemoved",
block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``), or a map with a
``"type"``; fields after the last one sent are absent, unknown ones ignored. An
optional ROUTER replays its buffered batches from a sequence number asked
(``[b"", start]`` from a DEALER; replies ``[topic, seq, payload]`` or ``[seq,
payload]`` after the empty delimiter, then ``seq == -1`` with an empty payload).

:class:`Subscriber` is a thread of its own: it reads the publishers, keeps each
one's sequence (gaps replayed, restarts and lost history cleared), decodes the
batches into *records* and applies them to the loop's index room
(``loop/kvindex.pyx``, ``_loop_py/kvindex.py``): it counts the blocks there
itself, under the index's lock, and hands the loop only the STATE records, which
the loop applies between two messages (a rank that starts publishing leaves the
router's table). The loop never decodes msgpack, chains nor counts a hash. A
record is little-endian::

    CLEAR   <B I>       op, rank                 the engine's blocks all dropped
    STORE   <B I B Q I I> op, rank, has_parent, parent, n, block_size,
            then n Q (the engine's block keys) and n * block_size I (the tokens)
    REMOVE  <B I I>     op, rank, n, then n Q
    STATE   <B I B>     op, rank, state          NONE, UNKNOWN or KNOWN
    HASHED  <B I I>     op, rank, n, then n Q (the keys) and n Q (coordkit's hashes)

A batch reads into CLEAR, STORE and REMOVE records (:func:`decode_batch`); the
thread then chains each STORE's hashes itself (:class:`Chains`, which keeps each
engine's keys by the same records in the same order as the index does) and counts
a HASHED record instead.

An engine's own block hash (a u64, an i64 or 32 bytes) is opaque: it becomes a
*key*, its value modulo 2**64, or the first 8 bytes of the BLAKE2b of its bytes.
"""

from __future__ import annotations

import collections
import hashlib
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack
import zmq

from ._shared import logger

__all__ = [
    "OP_CLEAR",
    "OP_STORE",
    "OP_REMOVE",
    "OP_STATE",
    "OP_HASHED",
    "STATE_NONE",
    "STATE_UNKNOWN",
    "STATE_KNOWN",
    "Chains",
    "Subscriber",
    "decode_batch",
    "engine_names",
    "parse_endpoints",
]

OP_CLEAR, OP_STORE, OP_REMOVE, OP_STATE, OP_HASHED = 0, 1, 2, 3, 4
#: An engine's index: not published (the approximate table prices it), published
#: but not known (a replay under way: priced as holding nothing), known.
STATE_NONE, STATE_UNKNOWN, STATE_KNOWN = 0, 1, 2

HEAD = struct.Struct("<BI")
STORE = struct.Struct("<BIBQII")
REMOVE = struct.Struct("<BII")
STATE = struct.Struct("<BIB")
HASHED = struct.Struct("<BII")

U64 = (1 << 64) - 1
#: The fields of each event type in the order of their array encoding.
STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
)
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
#: What an engine's events may be about and still count (vLLM's own default medium).
DEFAULT_MEDIA = ("GPU",)
DEFAULT_GROUPS = (0,)
#: Seconds a replay may take to end before its history is taken as lost.
REPLAY_TIMEOUT = 2.0
#: Seconds after subscribing when the replay is asked once more, from the batch after
#: the last one applied: a subscription reaches its publisher a little after it is made,
#: and a batch published in between, the last for a while, would not show as a gap.
RECHECK_AFTER = 0.5
END_SEQ = -1
POLL_MS = 20  # the thread's wait between looks at its commands
THREAD_NAME = "coordkit-kv-events"  # (``coordkit bench`` reads its CPU time by it)


def key_of(h: object) -> int:
    """An engine's block hash as an opaque u64 key."""
    if isinstance(h, bool):
        raise ValueError("a block hash is not a bool")
    if isinstance(h, int):
        if not -(1 << 63) <= h <= U64:
            raise ValueError(f"block hash {h} is not a u64 or an i64")
        return h & U64
    if isinstance(h, bytes):
        return int.from_bytes(hashlib.blake2b(h, digest_size=8).digest(), "little")
    raise ValueError(f"a block hash is an int or bytes, not {type(h).__name__}")


def _fields(event: object, names: tuple[str, ...]) -> tuple[str, dict[str, Any]]:
    """An event's type and its fields by name, from either encoding (absent: None)."""
    if isinstance(event, dict):
        kind = event.get("type")
        values = {name: event.get(name) for name in names}
    elif isinstance(event, list) and event:
        kind = event[0]
        values = dict.fromkeys(names)
        values.update(zip(names, event[1:], strict=False))
    else:
        raise ValueError("an event is an array or a map")
    if not isinstance(kind, str):
        raise ValueError("an event's type is a string")
    return kind, values


@dataclass
class Filter:
    """Which events count: a block size, media and KV-cache groups."""

    block_size: int
    media: tuple[str, ...] = DEFAULT_MEDIA
    groups: tuple[int, ...] = DEFAULT_GROUPS

    def counts(self, medium: object, group: object) -> bool:
        # vLLM leaves medium out (None) on its GPU pool, and group_idx with one group.
        return (medium is None or medium in self.media) and (group or 0) in self.groups


def _store(rank: int, fields: dict[str, Any], keep: Filter) -> bytes | None:
    """A BlockStored's record, None when it does not count; ValueError if malformed."""
    hashes, tokens, size = fields["block_hashes"], fields["token_ids"], fields["block_size"]
    if not isinstance(hashes, list) or not isinstance(tokens, list):
        raise ValueError("BlockStored's block_hashes and token_ids are arrays")
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError("BlockStored's block_size is a positive int")
    keys = [key_of(h) for h in hashes]
    parent = fields["parent_block_hash"]
    parent_key = 0 if parent is None else key_of(parent)
    if len(tokens) != len(keys) * size:
        raise ValueError("BlockStored's token_ids are not its blocks' tokens")
    if not keep.counts(fields["medium"], fields["group_idx"]) or size != keep.block_size:
        return None
    if fields["lora_id"] is not None or fields["lora_name"] is not None:
        return None  # a LoRA's blocks: coordkit's hashes are the base model's
    extra = fields["extra_keys"]
    if isinstance(extra, list):  # the blocks before the first with extra keys (media, salt)
        n = next((i for i, e in enumerate(extra) if e is not None), len(keys))
        keys, tokens = keys[:n], tokens[: n * size]
    if not keys:
        return None
    try:
        packed = struct.pack(f"<{len(keys)}Q{len(tokens)}I", *keys, *tokens)
    except struct.error:
        raise ValueError("BlockStored's token_ids are not u32 ints") from None
    head = STORE.pack(OP_STORE, rank, parent is not None, parent_key, len(keys), size)
    return head + packed


def decode_batch(payload: bytes, rank: int, keep: Filter) -> tuple[list[bytes], int]:
    """A batch's payload as records for ``rank``, and its events that were malformed
    (skipped; ValueError when the batch itself is)."""
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack's errors have no common base
        raise ValueError(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise ValueError("a batch is [ts, events, rank]")
    if not isinstance(events, list):
        raise ValueError("a batch's events are an array")
    records: list[bytes] = []
    bad = 0
    for event in events:
        try:
            kind, fields = _fields(event, STORED_FIELDS)
            if kind == "BlockStored":
                record = _store(rank, fields, keep)
                if record is not None:
                    records.append(record)
            elif kind == "BlockRemoved":
                fields = _fields(event, REMOVED_FIELDS)[1]
                hashes = fields["block_hashes"]
                if not isinstance(hashes, list):
                    raise ValueError("BlockRemoved's block_hashes are an array")
                keys = [key_of(h) for h in hashes]
                if keys and keep.counts(fields["medium"], fields["group_idx"]):
                    records.append(
                        REMOVE.pack(OP_REMOVE, rank, len(keys))
                        + struct.pack(f"<{len(keys)}Q", *keys)
                    )
            elif kind == "AllBlocksCleared":
                records.append(HEAD.pack(OP_CLEAR, rank))
            # another type: a later release's, not about the blocks held
        except ValueError:
            bad += 1
    return records, bad


class Chains:
    """The thread's half of the index: each engine's keys (its block hash, to coordkit's
    chained hash and the times stored), kept by the records handed in the order they
    are handed, by the rules the loop's index keeps its own by; so that the thread, not
    the loop, chains the hashes (a BLAKE2b a block). The twin of
    ``_codec_c.KVChains``."""

    def __init__(self, max_ranks: int):
        self._max_ranks = max_ranks  # a record of another rank: the index ignores it too
        self._keys: dict[int, dict[int, list[int]]] = {}
        #: STOREs whose parent the engine's events never named (not handed)
        self.unresolved = 0

    def hand(self, record: bytes) -> bytes | None:
        """What the loop gets for ``record``: a STORE's HASHED (None: its parent is
        unknown, or it is malformed), any other record as it is."""
        if len(record) < HEAD.size:
            return record
        op, rank = HEAD.unpack_from(record)
        if rank >= self._max_ranks:
            return record
        if op == OP_CLEAR:
            self._keys.pop(rank, None)
        elif op == OP_STORE and len(record) >= STORE.size:
            return self._store(rank, record)
        elif op == OP_REMOVE and len(record) >= REMOVE.size:
            n = REMOVE.unpack_from(record)[2]
            keys = self._keys.get(rank)
            if keys is not None and len(record) == REMOVE.size + 8 * n:
                for key in struct.unpack_from(f"<{n}Q", record, REMOVE.size):
                    node = keys.get(key)
                    if node is not None:
                        node[1] -= 1
                        if node[1] == 0:
                            del keys[key]
        return record

    def _store(self, rank: int, record: bytes) -> bytes | None:
        _, _, has_parent, parent, n, size = STORE.unpack_from(record)
        if len(record) != STORE.size + 8 * n + 4 * n * size:
            return None
        keys = self._keys.setdefault(rank, {})
        prev = 0
        if has_parent:
            node = keys.get(parent)
            if node is None:
                self.unresolved += 1
                return None
            prev = node[0]
        stored = struct.unpack_from(f"<{n}Q", record, STORE.size)
        tokens = memoryview(record)[STORE.size + 8 * n :]
        step = 4 * size
        hashes = []
        for i, key in enumerate(stored):
            block = tokens[i * step : (i + 1) * step]
            digest = hashlib.blake2b(prev.to_bytes(8, "little") + block, digest_size=8).digest()
            prev = int.from_bytes(digest, "little")
            hashes.append(prev)
            node = keys.get(key)
            if node is None:
                keys[key] = [prev, 1]
            else:
                node[1] += 1  # the same key stored again: removed as often
        return HASHED.pack(OP_HASHED, rank, n) + struct.pack(f"<{2 * n}Q", *stored, *hashes)


class Chainer(Protocol):
    """What the Subscriber hands records through: :class:`Chains` or its C twin."""

    unresolved: int

    def hand(self, record: bytes) -> bytes | None: ...


class BlockIndex(Protocol):
    """What the Subscriber counts blocks in: the loop's index room, either core's."""

    def apply_blocks(self, record: bytes) -> None: ...


def kv_stats(index: dict[str, Any], subscriber: dict[str, Any]) -> dict[str, Any]:
    """``stats()["kv_events"]``: the thread's counts, and per engine that publishes its
    state (``"exact"``: its events price it; ``"unknown"``: a replay under way, priced
    as holding nothing), blocks held, publisher and sequence."""
    publishers = subscriber.pop("publishers")
    engines = [
        {"rank": rank, **line, **publishers.get(rank, {})}
        for rank, line in sorted(index["engines"].items())
    ]
    return {
        **subscriber,
        "records": index["applied"],
        "engines": engines,
    }


def parse_endpoints(spec: str) -> tuple[int | str, str, str | None]:
    """``RANK=ENDPOINT[,REPLAY]`` (``coordkit serve --kv-events``): RANK an engine's
    data-parallel rank (an int) or its routing id (a str)."""
    name, sep, rest = spec.partition("=")
    name = name.strip()
    if not sep or not name or not rest:
        raise ValueError(
            f"--kv-events takes RANK=ENDPOINT[,REPLAY] (RANK: an engine's data-parallel "
            f"rank or its routing id), not {spec!r}"
        )
    endpoint, _, replay = rest.partition(",")
    return int(name) if name.isdigit() else name, endpoint, replay or None


def engine_names(name: int | str) -> tuple[bytes, ...]:
    """The routing ids of the engine ``--kv-events`` names: data-parallel rank N is
    the engine that registers as ``engine-N`` (a coordkit Engine's default) or
    ``mp-coord-N`` (Megatron's); any other name is a routing id itself."""
    if isinstance(name, int):
        return (f"engine-{name}".encode(), f"mp-coord-{name}".encode())
    return (name.encode(),)


@dataclass
class _Feed:
    """One publisher: its sockets and where its sequence stands."""

    rank: int
    endpoint: str
    replay: str | None
    announced: bool  # by its engine's hello (not the coordinator's options)
    sub: zmq.Socket
    dealer: zmq.Socket | None = None
    last: int = -1  # the last batch applied (-1: none yet)
    replaying: bool = False
    asked: int = 0  # the replay's start
    replied: bool = False  # a batch of this replay came
    quiet: bool = False  # this replay is the recheck: the engine stays known meanwhile
    recheck: float = 0.0  # when to ask the recheck (0: done, or no replay endpoint)
    until: float = 0.0  # the replay's deadline
    fresh: bool = False  # history lost: the next live batch starts the sequence anew
    buffered: list[tuple[int, bytes]] = field(default_factory=list)  # live, while replaying


class Subscriber:
    """The thread that reads every publisher and hands the loop records.

    ``decode`` reads a batch into records: :func:`decode_batch`, or the C core's
    ``_codec_c.decode_kv_batch``, the same function without the GIL; ``chains`` (a
    :class:`Chains`, or the C core's ``KVChains``) turns each STORE into the HASHED
    record the index counts.

    The records about blocks go to the loop's index (:meth:`attach`) from this
    thread; ``nudge`` is called (from this thread) whenever STATE records wait,
    and the loop then calls :meth:`take`. :meth:`add`, :meth:`unannounce` and
    :meth:`registered` may be called from any thread; the first subscription asks
    its replay endpoint from 0, so that what the engine cached before is known. The
    publishers the coordinator was given (:meth:`configure`) are keyed by the
    engine's routing id, and subscribed for the rank an engine of that id takes when
    it registers (ranks go by registration order, which is nobody's data-parallel
    rank).
    """

    def __init__(
        self,
        context: zmq.Context,
        nudge: Callable[[], None],
        block_size: int,
        topic: bytes = b"",
        media: Iterable[str] = DEFAULT_MEDIA,
        groups: Iterable[int] = DEFAULT_GROUPS,
        *,
        decode: Callable[[bytes, int, Filter], tuple[list[bytes], int]],
        chains: Chainer,
    ):
        self._context = context
        self._decode = decode
        self._chains = chains
        self._nudge = nudge
        self._topic = topic
        self._keep = Filter(block_size, tuple(media), tuple(groups))
        # (rank, endpoint or None: drop, replay, announced by its engine)
        self._commands: collections.deque[tuple[int, str | None, str | None, bool]] = (
            collections.deque()
        )
        self._out: collections.deque[bytes] = collections.deque()  # STATE records
        self._index: BlockIndex | None = None
        self._feeds: dict[int, _Feed] = {}
        self._configured: dict[bytes, tuple[str, str | None]] = {}  # routing id -> endpoints
        self._by_socket: dict[zmq.Socket, _Feed] = {}
        self._poller = zmq.Poller()
        self.counts = {
            "batches": 0,
            "handed": 0,  # records applied or handed to the loop (its index counts both)
            "events_malformed": 0,
            "malformed": 0,
            "gaps": 0,
            "resets": 0,
            "replays": 0,
        }
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    # -- what the loop and the coordinator call ----------------------------------------

    def attach(self, index: BlockIndex) -> None:
        """The loop's index, which this thread counts blocks in (before :meth:`start`)."""
        self._index = index

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        if self._thread.is_alive():
            self._thread.join()

    def add(self, rank: int, endpoint: str, replay: str | None, announced: bool = False) -> None:
        """Subscribe to ``rank``'s publisher (again: its state is then asked anew);
        ``announced`` by its engine's hello."""
        self._commands.append((rank, endpoint, replay, announced))

    def configure(self, name: int | str, endpoint: str, replay: str | None) -> None:
        """The publisher of the engine ``name`` (:func:`engine_names`), read once an
        engine of that routing id registers. ValueError when it was named already."""
        for identity in engine_names(name):
            if identity in self._configured:
                raise ValueError(f"kv_events: engine {name!r} is given twice")
            self._configured[identity] = (endpoint, replay)

    def registered(self, rank: int, identity: bytes) -> None:
        """A new engine took ``rank``: the publisher configured for its routing id is
        read for it; any its rank's earlier engine had goes."""
        endpoint, replay = self._configured.get(identity, (None, None))
        self._commands.append((rank, endpoint, replay, False))

    def unannounce(self, rank: int) -> None:
        """``rank``'s engine said hello without a publisher: one its predecessor
        announced is dropped (one the coordinator was given stays)."""
        self._commands.append((rank, None, None, True))

    def take(self) -> list[bytes]:
        """The STATE records waiting, in order."""
        out = self._out
        return [out.popleft() for _ in range(len(out))]

    def stats(self) -> dict[str, Any]:
        engines = {
            rank: {
                "endpoint": feed.endpoint,
                "replay": feed.replay,
                "seq": feed.last,
                "replaying": feed.replaying,
            }
            for rank, feed in list(self._feeds.items())
        }
        return {**self.counts, "unresolved": self._chains.unresolved, "publishers": engines}

    # -- the thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                while self._commands:
                    self._command(*self._commands.popleft())
                ready = dict(self._poller.poll(POLL_MS))
                for socket in ready:
                    feed = self._by_socket.get(socket)
                    if feed is None:
                        continue  # dropped by a command this pass
                    if socket is feed.sub:
                        self._read_live(feed)
                    else:
                        self._read_replay(feed)
                now = time.monotonic()
                for feed in list(self._feeds.values()):
                    if feed.replaying and now >= feed.until:
                        self._replay_lost(feed)
                    elif feed.recheck and now >= feed.recheck and not feed.replaying:
                        feed.recheck = 0.0
                        self._ask(feed, feed.last + 1, quiet=True)
                if self._out:
                    self._nudge()
        finally:
            for feed in list(self._feeds.values()):
                self._close(feed)

    def _emit(self, record: bytes) -> None:
        handed = self._chains.hand(record)
        if handed is None:
            return
        self.counts["handed"] += 1
        if len(handed) == STATE.size and handed[0] == OP_STATE:
            self._out.append(handed)  # the loop's: it touches the router's table
        else:
            assert self._index is not None, "attach() the loop's index first"
            self._index.apply_blocks(handed)

    def _command(
        self, rank: int, endpoint: str | None, replay: str | None, announced: bool
    ) -> None:
        old = self._feeds.get(rank)
        # No endpoint: drop it (an unannounce: only one its engine announced).
        if endpoint is None and (old is None or (announced and not old.announced)):
            return
        if old is not None:
            del self._feeds[rank]
            self._close(old)
        self._emit(HEAD.pack(OP_CLEAR, rank))
        if endpoint is None:
            self._emit(STATE.pack(OP_STATE, rank, STATE_NONE))
            return
        sub = self._context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        feed = _Feed(rank, endpoint, replay, announced, sub)
        self._feeds[rank] = feed
        self._by_socket[sub] = feed
        self._poller.register(sub, zmq.POLLIN)
        try:
            sub.connect(endpoint)
            if replay is None:
                self._emit(STATE.pack(OP_STATE, rank, STATE_KNOWN))
            else:
                self._ask(feed, 0)
                feed.recheck = time.monotonic() + RECHECK_AFTER
        except zmq.ZMQError as exc:  # an endpoint no socket can connect to: none read
            logger.warning("coordkit: engine %d's KV events at %s: %s", rank, endpoint, exc)
            self.counts["malformed"] += 1
            del self._feeds[rank]
            self._close(feed)
            self._emit(STATE.pack(OP_STATE, rank, STATE_NONE))

    def _close(self, feed: _Feed) -> None:
        for socket in (feed.sub, feed.dealer):
            if socket is not None:
                self._poller.unregister(socket)
                self._by_socket.pop(socket, None)
                socket.close(linger=0)
        feed.dealer = None

    def _ask(self, feed: _Feed, start: int, quiet: bool = False) -> None:
        """Ask ``feed``'s replay from ``start``; live batches wait meanwhile. Unless
        ``quiet`` (the recheck: not counted), the engine is not known until it ends."""
        if feed.dealer is None:
            assert feed.replay is not None
            feed.dealer = self._context.socket(zmq.DEALER)
            feed.dealer.setsockopt(zmq.LINGER, 0)
            self._by_socket[feed.dealer] = feed
            self._poller.register(feed.dealer, zmq.POLLIN)
            feed.dealer.connect(feed.replay)
        feed.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        feed.replaying, feed.asked, feed.replied, feed.quiet = True, start, False, quiet
        feed.until = time.monotonic() + REPLAY_TIMEOUT
        if not quiet:
            self.counts["replays"] += 1
            self._emit(STATE.pack(OP_STATE, feed.rank, STATE_UNKNOWN))

    def _reset(self, feed: _Feed) -> None:
        """``feed``'s history is lost: its engine's entries cleared, counted."""
        self.counts["resets"] += 1
        self._emit(HEAD.pack(OP_CLEAR, feed.rank))

    def _apply(self, feed: _Feed, seq: int, payload: bytes) -> None:
        """The batch ``seq``, next in ``feed``'s sequence, applied."""
        feed.last = seq
        try:
            records, bad = self._decode(payload, feed.rank, self._keep)
        except ValueError:
            # Its events are lost: what it removed may still be listed. Anew, then.
            self.counts["malformed"] += 1
            self._reset(feed)
            return
        self.counts["batches"] += 1
        self.counts["events_malformed"] += bad
        for record in records:
            self._emit(record)

    def _read_live(self, feed: _Feed) -> None:
        while True:
            try:
                frames = feed.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.counts["malformed"] += 1
                continue
            self._live(feed, int.from_bytes(frames[1], "big"), frames[2])

    def _live(self, feed: _Feed, seq: int, payload: bytes) -> None:
        if feed.replaying:
            feed.buffered.append((seq, payload))
            return
        if feed.fresh:
            feed.fresh = False
            self._apply(feed, seq, payload)
        elif seq == feed.last + 1:
            self._apply(feed, seq, payload)
        elif seq == feed.last:
            return  # a duplicate
        elif seq < feed.last:
            # One connection delivers in order: a sequence that goes back is a new
            # process's. Its engine restarted; what it holds is asked anew.
            self._reset(feed)
            feed.last = -1
            self._live(feed, seq, payload)
        else:
            self.counts["gaps"] += 1
            if feed.replay is None:
                self._reset(feed)
                self._apply(feed, seq, payload)
            else:
                feed.buffered.append((seq, payload))
                self._ask(feed, feed.last + 1)

    def _read_replay(self, feed: _Feed) -> None:
        assert feed.dealer is not None
        while feed.dealer is not None:
            try:
                frames = feed.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # [b"", (topic,) seq, payload]: read from the end, the topic may be empty.
            if len(frames) < 2 or len(frames[-2]) != 8 or not feed.replaying:
                self.counts["malformed"] += 1
                continue
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == END_SEQ:
                self._replay_end(feed)
            elif seq >= 0:
                self._replayed(feed, seq, frames[-1])
            else:
                self.counts["malformed"] += 1

    def _replayed(self, feed: _Feed, seq: int, payload: bytes) -> None:
        if not feed.replied:
            feed.replied = True
            if seq > feed.asked:  # its buffer no longer reaches back there: history lost
                self._reset(feed)
                feed.last = seq - 1
        if seq <= feed.last:
            return
        if seq != feed.last + 1:
            self._reset(feed)
        self._apply(feed, seq, payload)

    def _replay_end(self, feed: _Feed) -> None:
        if not feed.replied and feed.asked > 0 and not feed.quiet:
            # Nothing from where it was asked: that history is lost too.
            self._reset(feed)
            feed.fresh = True
        self._merge(feed)

    def _replay_lost(self, feed: _Feed) -> None:
        """The replay never ended: its socket closed (late replies are not read as
        another's), the engine's entries cleared, the live batches taken as they are."""
        assert feed.dealer is not None
        self._poller.unregister(feed.dealer)
        self._by_socket.pop(feed.dealer, None)
        feed.dealer.close(linger=0)
        feed.dealer = None
        self._reset(feed)
        feed.fresh = True
        self._merge(feed)

    def _merge(self, feed: _Feed) -> None:
        """The replay is over: the live batches that waited, in order of seq."""
        feed.replaying = False
        self._emit(STATE.pack(OP_STATE, feed.rank, STATE_KNOWN))
        waiting, feed.buffered = sorted(feed.buffered, key=lambda b: b[0]), []
        for seq, payload in waiting:
            if feed.replaying:
                feed.buffered.append((seq, payload))
            elif feed.fresh or seq > feed.last:
                self._live(feed, seq, payload)
