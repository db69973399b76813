"""A KV-cache event publisher in vLLM's wire format, for engines that do not publish.

An engine adapter whose engine keeps a prefix cache but publishes no events
(coordkit's FakeEngine, or a model server without vLLM's ``--kv-events-config``)
tells a coordinator what it caches with one of these: a PUB socket sending
``[topic, seq (8 bytes big-endian), payload]``, the payload the msgpack of
``[ts, events, data_parallel_rank]``, each event a map with a ``"type"``
(``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``); and a ROUTER that
replays the last ``buffer_steps`` batches from the seq a DEALER asks
(``[b"", start]``), each as ``[seq, payload]``, then ``[-1, b""]``. An
:class:`coordkit.engine.Engine` given one announces its endpoints at its hello
(``Engine(kv_events=publisher)``); :mod:`coordkit._kvevents` is what reads it.

:meth:`publish` is called from one thread (the engine's); replays are served on a
thread of the publisher's own.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

__all__ = ["KVPublisher", "DEFAULT_BUFFER_STEPS", "block_stored"]

DEFAULT_BUFFER_STEPS = 10_000
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_POLL_MS = 50


class KVPublisher:
    """Publishes an engine's KV-cache events; binds ``endpoint`` and ``replay`` (a tcp
    port 0 or ``*``: a free one, :attr:`endpoint` and :attr:`replay_endpoint` say which;
    ``replay=None``: no replay)."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay: str | None = "tcp://127.0.0.1:0",
        *,
        block_size: int = 16,
        rank: int = 0,
        topic: str = "",
        buffer_steps: int = DEFAULT_BUFFER_STEPS,
        context: zmq.Context | None = None,
    ):
        if block_size < 1 or buffer_steps < 1:
            raise ValueError("block_size and buffer_steps must be at least 1")
        self.block_size = block_size
        self.rank = rank
        self._topic = topic.encode()
        self._context = context or zmq.Context.instance()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._lock = threading.Lock()
        self._seq = 0
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 0)
        self._router: zmq.Socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.endpoint = _bind(self._pub, endpoint)
            self.replay_endpoint: str | None = None
            if replay is not None:
                self._router = self._context.socket(zmq.ROUTER)
                self._router.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._router, replay)
        except BaseException:
            self.close()
            raise
        if self._router is not None:
            self._thread = threading.Thread(
                target=self._serve, name="coordkit-kv-replay", daemon=True
            )
            self._thread.start()

    def stored(
        self, hashes: Sequence[int | bytes], parent: int | bytes | None, tokens: Sequence[int]
    ) -> None:
        """Blocks stored: their hashes (the engine's own), the one before the first
        (None: they start a prompt), and their tokens (``block_size`` each)."""
        if len(tokens) != len(hashes) * self.block_size:
            raise ValueError(f"{len(hashes)} blocks hold {len(hashes) * self.block_size} tokens")
        self.publish([block_stored(hashes, parent, tokens, self.block_size)])

    def removed(self, hashes: Sequence[int | bytes]) -> None:
        """Blocks evicted, by the hashes they were stored under."""
        self.publish([{"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}])

    def cleared(self) -> None:
        """Every block dropped (a cache reset)."""
        self.publish([{"type": "AllBlocksCleared"}])

    def publish(self, events: list[dict[str, Any]]) -> None:
        """One batch of events (maps with a ``"type"``), numbered and buffered for replay."""
        self.publish_packed([msgpack.packb(event) for event in events])

    def publish_packed(self, events: Sequence[bytes]) -> None:
        """The same, each event already msgpack (an engine that re-sends the same
        token ids need not pack them again)."""
        packer = msgpack.Packer()
        head = packer.pack_array_header(3) + packer.pack(time.time())
        payload = b"".join((head, packer.pack_array_header(len(events)), *events))
        payload += packer.pack(self.rank)
        with self._lock:
            seq = self._seq
            self._seq += 1
            self._buffer.append((seq, payload))
        self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])

    def _serve(self) -> None:
        assert self._router is not None
        while not self._stop.is_set():
            if not self._router.poll(_POLL_MS):
                continue
            frames = self._router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue  # not a replay request
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            with self._lock:
                batches = [(seq, payload) for seq, payload in self._buffer if seq >= start]
            for seq, payload in batches:
                self._router.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self._router.send_multipart([identity, b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self._router is not None:
            self._router.close(linger=0)
        self._pub.close(linger=0)

    def __enter__(self) -> KVPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def block_stored(
    hashes: Sequence[int | bytes], parent: int | bytes | None, tokens: Sequence[int], size: int
) -> dict[str, Any]:
    """A BlockStored event, for :meth:`KVPublisher.publish`."""
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def _bind(socket: zmq.Socket, endpoint: str) -> str:
    """Bind ``endpoint`` (tcp port 0: a free one); the endpoint bound, as peers name it."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        endpoint = endpoint[:-1] + "*"
    socket.bind(endpoint)
    return str(socket.getsockopt_string(zmq.LAST_ENDPOINT))
