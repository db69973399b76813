"""``c-kv-events``'s engine side: each rank's KV-cache events, published as vLLM does.

Every prompt a rank receives is taken as a miss: its full blocks (BLOCK_SIZE
tokens) are stored under ids of the rank's own, a counter, so that each store is
new (an upper bound of what an engine publishes: it stores only the blocks it
prefills), and the rank's LRU of KV_CACHE_BLOCKS evicts the oldest past it. The
events wait for the rank's next reply and go out with it, one batch per
ENGINE_REPLY as vLLM publishes one per step, through a
:class:`coordkit.kvpublish.KVPublisher` on the endpoints the coordinator was given.
A prompt's token ids are packed once (the bench sends one prompt per point).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import msgpack
import zmq

from ...kvpublish import KVPublisher
from ...protocol import unpackb
from .workload import BLOCK_SIZE, KV_CACHE_BLOCKS

_STORED_HEAD = {"type": "BlockStored", "parent_block_hash": None, "block_size": BLOCK_SIZE}
_STORED_TAIL = {"lora_id": None, "medium": "GPU", "lora_name": None}


def endpoints(directory: str, name: str, ranks: int) -> list[tuple[str, str]]:
    """Each rank's publisher and replay endpoints (ipc, named in ``directory``: known
    before either side starts, no port to reserve)."""
    return [
        (f"ipc://{directory}/{name}-kv{rank}", f"ipc://{directory}/{name}-kv{rank}-replay")
        for rank in range(ranks)
    ]


class RankCache:
    """One rank's cache of block ids, and the events it has not published yet."""

    def __init__(self, publisher: KVPublisher):
        self.publisher = publisher
        self.next_id = 0
        self.held: deque[tuple[int, int]] = deque()  # runs of ids (first, count), oldest first
        self.blocks = 0
        self.pending: list[bytes] = []
        self.batches = 0  # published
        self._prompt = b""  # the last prompt's frame, and its tokens' packed fields
        self._packed = (0, b"")

    def store(self, prompt: bytes, single_frame: bool) -> None:
        """A request's prompt (its frame, or the whole single-frame SUBMIT) prefilled."""
        key = prompt[_after_rid(prompt) :] if single_frame else prompt
        if key != self._prompt:
            self._prompt = key
            tokens = unpackb(prompt)[2] if single_frame else unpackb(prompt)
            n = len(tokens) // BLOCK_SIZE
            self._packed = (n, _fields({"token_ids": tokens[: n * BLOCK_SIZE], **_STORED_TAIL}))
        n, tail = self._packed
        if not n:
            return
        first, self.next_id = self.next_id, self.next_id + n
        hashes = _fields({"block_hashes": list(range(first, first + n))})
        self.pending.append(_map_head(8) + _fields(_STORED_HEAD) + hashes + tail)
        self.held.append((first, n))
        self.blocks += n
        evicted: list[int] = []
        while self.blocks > KV_CACHE_BLOCKS:
            start, count = self.held.popleft()
            drop = min(count, self.blocks - KV_CACHE_BLOCKS)
            evicted.extend(range(start, start + drop))
            self.blocks -= drop
            if drop < count:
                self.held.appendleft((start + drop, count - drop))
        if evicted:
            removed = {"type": "BlockRemoved", "block_hashes": evicted, "medium": "GPU"}
            self.pending.append(msgpack.packb(removed))

    def flush(self) -> None:
        """The events since the last reply, as one batch."""
        if self.pending:
            self.publisher.publish_packed(self.pending)
            self.pending = []
            self.batches += 1


def publishers(context: zmq.Context, where: list[tuple[str, str]]) -> list[RankCache]:
    """A cache and its publisher per rank, bound at ``where``."""
    caches: list[RankCache] = []
    try:
        for rank, (endpoint, replay) in enumerate(where):
            publisher = KVPublisher(
                endpoint, replay, block_size=BLOCK_SIZE, rank=rank, context=context
            )
            caches.append(RankCache(publisher))
    except BaseException:
        close(caches)
        raise
    return caches


def close(caches: list[RankCache]) -> None:
    for cache in caches:
        cache.publisher.close()


def _after_rid(frame: bytes) -> int:
    """Where a single-frame ``[20, rid, ...]`` goes on after its rid (a fixint or a uint,
    as the bench's client writes it; another encoding: 3, the key then differs by rid)."""
    return 3 + _UINT_SIZES.get(frame[2], 0)


_UINT_SIZES = {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8}


def _map_head(n: int) -> bytes:
    return msgpack.Packer().pack_map_header(n)


def _fields(fields: Mapping[str, object]) -> bytes:
    """A map's key-value pairs, packed, without the map's head (spliced into one)."""
    packed = msgpack.packb(fields)
    return packed[len(_map_head(len(fields))) :]
