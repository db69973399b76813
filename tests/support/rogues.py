"""The peers of the hostile soak (tests/test_hostile.py), each kind a process of its own.

``python -m tests.support.rogues honest ADDRESS N IMPL`` runs N honest engines
(:class:`coordkit.Engine`, rebuild and heartbeats on): each answers every request at
once with a body that says what it answers, ``{"prompt": <the prompt frame's bytes>}``
(a stream gets a partial first, the same map with ``"partial": 1``), so a client can
tell a true reply from a forged one.

``python -m tests.support.rogues hostile ADDRESS SECONDS SEED`` runs rogue peers for
SECONDS: Megatron main and coordkit clients, coordkit and Megatron engines, on
connections they close and open again (under the same identity or a new one), sending
mutated and forged copies of every message of the protocol, the rebuild's included,
with the server ids they were sent (and their neighbours: those are other peers'),
and the identities of live clients they learned from the trailers. A rogue engine
answers what it is sent truly (an engine that never answers loses requests by its own
fault, which no coordinator can prevent), and every other reply it sends is for a
request it does not hold. No SHUTDOWN: it stops the coordinator, which is not bad input.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import msgpack
import zmq

from tests.support.peers import (
    ABORT,
    CONNECT,
    DISCONNECT,
    ENGINE_HELLO,
    HANDLED,
    HEARTBEAT,
    HELD,
    PARTIAL,
    PAUSE,
    REJOIN,
    RELEASE_KV,
    REPLAY,
    REPLAYED,
    REPLY,
    RESEND,
    SET_GENERATION_EPOCH,
    SHUTDOWN,
    STATS,
    SUBMIT,
    SUBMIT_BATCH,
    SUBMIT_KV,
    UNPAUSE,
    m,
)

#: The sampling-params key a clean client sets to ask for a partial before the final
#: (what coordkit's Client.stream sets: protocol.STREAM_KEY).
STREAM = "stream"


def true_body(prompt: bytes, partial: bool = False) -> dict[str, Any]:
    """What an honest engine answers for a request whose prompt frame is ``prompt``."""
    return {"prompt": prompt, "partial": 1} if partial else {"prompt": prompt}


def honest(address: str, n: int, implementation: str) -> None:
    from coordkit.engine import Engine, Request

    engines = [
        Engine(
            address,
            rank=i,
            identity=f"honest-{i}",
            implementation=implementation,
            heartbeat_interval=0.2,
        )
        for i in range(n)
    ]
    while True:
        for engine in engines:
            finals, partials = [], []
            for event in engine.poll(0.002):
                if isinstance(event, Request):
                    prompt = bytes(event.prompt.buffer)
                    params = event.sampling_params
                    if isinstance(params, dict) and params.get(STREAM):
                        partials.append((event.server_rid, true_body(prompt, True)))
                    finals.append((event.server_rid, true_body(prompt)))
            if partials:
                engine.reply_partial(partials)
            if finals:
                engine.reply(finals)


class Rogue:
    """One rogue peer: a DEALER it closes and opens again, a kind, what it learned."""

    def __init__(self, ctx: zmq.Context, address: str, name: str, kind: str, rng: random.Random):
        self.ctx, self.address, self.name, self.kind, self.rng = ctx, address, name, kind, rng
        self.generation = 0
        self.held: set[int] = set()  # every server id it was sent (an engine)
        self.sock: zmq.Socket | None = None
        self.connect()

    @property
    def identity(self) -> bytes:
        return f"{self.name}-g{self.generation}".encode()

    def connect(self, same: bool | None = None) -> None:
        """A new connection: under the same identity, or a new one (``same`` None: either)."""
        if self.sock is not None:
            self.sock.close(linger=0)
        if not (self.rng.random() < 0.5 if same is None else same):
            self.generation += 1
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.IDENTITY, self.identity)
        self.sock.connect(self.address)
        if self.kind == "coordkit-engine":
            self.send(b"")
            hello = {"coordkit": 1, "ack": 1, "rebuild": 1, "base": 1}
            hello["session"] = self.rng.randrange(1, 1 << 62)
            self.send(m([ENGINE_HELLO, hello]))
        elif self.kind == "megatron-engine":
            self.send(b"")
        elif self.kind == "coordkit-client":
            self.send(m([CONNECT, {"coordkit": 1, "rebuild": 1, "batch": 1, "hold_ms": 2000}]))
        else:
            self.send(m([CONNECT]))

    def send(self, *frames: bytes) -> None:
        assert self.sock is not None
        try:
            self.sock.send_multipart(list(frames), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)


class Hostile:
    """The rogues, their shared knowledge (server ids seen, client ids seen), one loop."""

    def __init__(self, address: str, seed: int):
        self.rng = random.Random(seed)
        self.ctx = zmq.Context()
        kinds = ["megatron-client", "coordkit-client"] * 3 + ["coordkit-engine"] * 2
        kinds += ["megatron-engine"] * 2
        self.rogues = [
            Rogue(self.ctx, address, f"rogue{i}-{kind}", kind, self.rng)
            for i, kind in enumerate(kinds)
        ]
        self.server_ids: list[int] = [0]  # seen by any rogue engine, the latest 256
        self.client_ids: list[bytes] = [b"clean"]
        self.sent = 0

    def run(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for rogue in self.rogues:
                self.answer(rogue)
                for _ in range(4):
                    self.act(rogue)
            time.sleep(0.0005)
        for rogue in self.rogues:
            rogue.close()
        self.ctx.term()

    def answer(self, rogue: Rogue) -> None:
        """What it was sent: a rogue engine learns the ids and answers its requests truly."""
        assert rogue.sock is not None
        while True:
            try:
                frames = rogue.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not rogue.kind.endswith("engine"):
                continue
            try:
                meta = msgpack.unpackb(frames[0], raw=False, strict_map_key=False)
            except Exception:
                continue
            if not isinstance(meta, list) or not meta:
                continue
            if meta[0] not in (SUBMIT, SUBMIT_KV) or len(meta) < 3:
                continue
            server_rid = meta[1]
            self.learn(rogue, server_rid, frames[2:3])
            if len(frames) == 1:  # a Megatron engine's: [20, rid, prompt, params, ...]
                entry = {"request_id": server_rid, **true_body(m(meta[2]))}
                rogue.send(m([REPLY, [entry]]))
            else:
                rogue.send(m([REPLY, [[server_rid, False]]]), m(true_body(frames[1])))

    def learn(self, rogue: Rogue, server_rid: int, trailers: list[bytes]) -> None:
        rogue.held.add(server_rid)
        self.server_ids.append(server_rid)
        del self.server_ids[:-256]
        for trailer in trailers:
            try:
                client_id = msgpack.unpackb(trailer)[1]
            except Exception:
                continue
            if isinstance(client_id, bytes) and client_id not in self.client_ids:
                self.client_ids.append(client_id)

    def live_id(self, rogue: Rogue) -> int:
        """A server id at or below one seen, never one this rogue was sent (it may still
        be on its way to it): most are other peers' requests."""
        while True:
            rid = self.rng.choice(self.server_ids) - self.rng.randint(0, 40)
            if rid not in rogue.held:
                return rid

    def act(self, rogue: Rogue) -> None:
        rng = self.rng
        self.sent += 1
        if rng.random() < 0.01:
            rogue.connect()
            return
        if rng.random() < 0.03:
            rogue.send(b"")  # a registration, whatever the rogue is
            return
        frames = rng.choice(self.messages(rogue))
        if rng.random() < 0.3:
            frames = self.mutated(frames)
        rogue.send(*frames)

    def messages(self, rogue: Rogue) -> list[list[bytes]]:
        rng, sid = self.rng, self.live_id(rogue)
        client_id = rng.choice(self.client_ids)
        rid = rng.randrange(0, 1 << 20)
        junk = rng.randbytes(rng.randrange(0, 24))
        common = [
            [m([CONNECT])],
            [m([CONNECT, {"coordkit": 1, "rebuild": 1}])],
            [m([SUBMIT, rid, {}]), m([1, 2, 3])],
            [m([SUBMIT, rid, [1, 2], {"num_tokens_to_generate": 2}, None])],
            [m([SUBMIT_KV, rid, {}, {"k": 1}]), m([1]), m([2])],
            [m([SUBMIT_BATCH, [[rid, {}, False], [rid + 1, {}, False]]]), m([1]), m([2])],
            [m([ABORT, rng.choice([rid, sid])])],
            [m([RELEASE_KV, sid])],
            [m([rng.choice([PAUSE, UNPAUSE])])],
            [m([SET_GENERATION_EPOCH, rid])],
            [m([STATS])],
            [m([REJOIN, [[sid, 0], [rid, rng.randrange(3)]]])],
            [m([RESEND, [sid]])],
            [m([HANDLED, sid])],
            [m([REPLAY, [[sid, 0]]])],
            [m([DISCONNECT])],
            [m([rng.randrange(62, 256)])],
            [junk],
        ]
        engine = [
            [m([REPLY, [[sid, False]]]), m({"prompt": junk})],
            [m([REPLY, [{"request_id": sid, "generated_tokens": [6]}]])],
            [m([PARTIAL, [sid]]), m({"prompt": junk, "partial": 1})],
            [m([PARTIAL, [{"request_id": sid, "new_tokens": [6]}]])],
            [m([HEARTBEAT, rng.randrange(4), 8])],
            [m([HELD, [[sid, rng.randrange(64), client_id, rng.randrange(2), False]]]), b""],
            [m([HELD, [[rid, rng.randrange(64), client_id, 0, False]]]), b""],
            [m([REPLAYED, [[sid, 0, 1, rng.random() < 0.5]]]), m({"prompt": junk})],
            [m([REPLAYED, [[sid, -1, 0, False]]])],
            [m([ENGINE_HELLO, {"coordkit": 1, "ack": 1, "session": rng.randrange(1, 99)}])],
        ]
        return common + engine if rogue.kind.endswith("engine") else common + engine[:3]

    def mutated(self, frames: list[bytes]) -> list[bytes]:
        """A copy with one frame changed: a byte replaced, cut short or lengthened; never
        into a SHUTDOWN (``[PAUSE]`` with its header byte replaced is one)."""
        while _is_shutdown(mutated := self._mutated(frames)):
            pass
        return mutated

    def _mutated(self, frames: list[bytes]) -> list[bytes]:
        rng = self.rng
        out = [bytearray(f) for f in frames]
        frame = out[rng.randrange(len(out))]
        op = rng.randrange(3)
        if op == 0 and frame:
            frame[rng.randrange(len(frame))] = rng.randrange(256)
        elif op == 1 and frame:
            del frame[rng.randrange(len(frame)) :]
        else:
            frame += rng.randbytes(rng.randrange(1, 5))
        return [bytes(f) for f in out]


def _is_shutdown(frames: list[bytes]) -> bool:
    try:
        message = msgpack.unpackb(frames[0])
    except Exception:
        return False
    return isinstance(message, list) and bool(message) and message[0] == SHUTDOWN


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    run = modes.add_parser("honest")
    run.add_argument("address")
    run.add_argument("n", type=int)
    run.add_argument("implementation")
    run = modes.add_parser("hostile")
    run.add_argument("address")
    run.add_argument("seconds", type=float)
    run.add_argument("seed", type=int)
    args = parser.parse_args()
    if args.mode == "honest":
        honest(args.address, args.n, args.implementation)
    else:
        hostile = Hostile(args.address, args.seed)
        hostile.run(args.seconds)
        print(f"rogue messages sent: {hostile.sent}", flush=True)


if __name__ == "__main__":
    main()
