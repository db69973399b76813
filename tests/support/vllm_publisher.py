"""A KV-cache event publisher written to vLLM's wire format, apart from coordkit's own.

What vLLM's ``ZmqEventPublisher`` (vllm/distributed/kv_events.py) puts on the wire,
and what the coordinator must read: a PUB socket sending ``[topic, seq (8 bytes
big-endian), payload]``, the payload the msgpack of a ``KVEventBatch``; a ROUTER
that replays its bounded buffer from the seq a DEALER asks (``[b"", start]``), each
batch as ``[b"", seq, payload]`` (vLLM) or ``[b"", topic, seq, payload]`` (a shape
of later releases), then ``[b"", -1, b""]``.

``events`` (array or map) picks the event encoding: msgspec's ``array_like`` tagged
arrays of older releases (``["BlockStored", ...]``, trailing defaults left out), or
maps with a ``"type"`` (``omit_defaults``: fields at their default left out);
``batch`` likewise for the batch.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import msgpack
import zmq

END = (-1).to_bytes(8, "big", signed=True)


def stored(
    hashes: list[Any], parent: Any, tokens: list[int], block_size: int, **extra: Any
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        **extra,
    }


def removed(hashes: list[Any], **extra: Any) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", **extra}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


ORDER = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def encode_event(event: dict[str, Any], form: str) -> Any:
    if form == "map":
        return {k: v for k, v in event.items() if v is not None or k == "parent_block_hash"}
    fields = [event.get(name) for name in ORDER[event["type"]]]
    while fields and fields[-1] is None and len(fields) > 4:  # trailing defaults omitted
        fields.pop()
    return [event["type"], *fields]


def batch_payload(events: list[dict[str, Any]], form: str, batch: str, rank: int) -> bytes:
    """A KVEventBatch's msgpack: its events in ``form``, itself an array or a map."""
    encoded = [encode_event(e, form) for e in events]
    if batch == "map":
        return msgpack.packb({"ts": 1.5, "events": encoded, "data_parallel_rank": rank})
    return msgpack.packb([1.5, encoded, rank])


class Publisher:
    """One engine's publisher: ``publish`` from the test's thread, replays served on a
    thread of its own."""

    def __init__(
        self,
        ctx: zmq.Context,
        events: str = "array",
        batch: str = "array",
        replay: str | None = "bare",
        buffer_steps: int = 10_000,
        topic: bytes = b"",
        rank: int = 0,
    ):
        self.ctx, self.events, self.batch, self.shape = ctx, events, batch, replay
        self.topic, self.rank = topic, rank
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.seq = 0
        self.lock = threading.Lock()
        self.replay_endpoint: str | None = None
        self.replays: list[int] = []  # the starts asked
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if replay is not None:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            rport = self.router.bind_to_random_port("tcp://127.0.0.1")
            self.replay_endpoint = f"tcp://127.0.0.1:{rport}"
            self._thread = threading.Thread(target=self._serve, daemon=True)
            self._thread.start()

    @property
    def spec(self) -> str:
        """What ``Coordinator(kv_events={rank: spec})`` takes."""
        if self.replay_endpoint is None:
            return self.endpoint
        return f"{self.endpoint},{self.replay_endpoint}"

    def publish(self, *events: dict[str, Any], send: bool = True) -> int:
        """A batch of ``events``, buffered for replay; ``send=False`` drops it on the way
        (a subscriber's missed batch). Its seq."""
        return self.publish_raw(
            batch_payload(list(events), self.events, self.batch, self.rank), send
        )

    def publish_raw(self, payload: bytes, send: bool = True) -> int:
        with self.lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
        if send:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart(self) -> None:
        """The engine process restarts: its sequence from 0, its buffer empty."""
        with self.lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(20):
                continue
            frames = self.router.recv_multipart()
            if len(frames) != 3:
                continue
            identity, _, start = frames
            begin = int.from_bytes(start, "big")
            self.replays.append(begin)
            with self.lock:
                batches = [(s, p) for s, p in self.buffer if s >= begin]
            for s, p in batches:
                head = [identity, b""] + ([self.topic] if self.shape == "topic" else [])
                self.router.send_multipart([*head, s.to_bytes(8, "big"), p])
            self.router.send_multipart([identity, b"", END, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self.router.close(linger=0)
        self.pub.close(linger=0)
