"""``coordkit bench --pd --dialect megatron-core --megatron-version pr6675``'s engines:
Megatron-LM PR #6675's prefill and decode engines as the coordinator sees them, free of
model time, in one process.

Each rank is a ROUTER connection that speaks the PR's single frames: a role engine
registers with ``REGISTER_ROLE`` ``[27, role, "nixl", instance_meta]`` (its
``request_capacity`` above the client's window: nothing waits) and waits for ``[2]``;
an engine without a role (aggregated) registers as main's do, with one empty frame.
Then, for what each poll read, one message per rank: a prefill answers its SUBMITs
with ``[21, [finished_request, ...]]`` whose records carry ``disaggregated_params``
(``kv_meta``: its KV descriptor, NIXL's agent named, its blob left out;
``block_ids``); a decode answers its SUBMIT_REQUEST_WITH_KVs with one ``[28, rid]``
each (the import done), then ``[21, [...]]`` of the finals; an engine without a role
answers SUBMITs with the finals. RELEASE_KV is taken and dropped.
"""

from __future__ import annotations

import base64
import logging
from multiprocessing.connection import Connection
from typing import Any

import zmq

from ...protocol import packb
from .load import _connect_as, _routed, megatron_reply, read_rid, reply_body

REGISTER_ROLE, REGISTER_ROLE_ACK, KV_READ_DONE = 27, 2, 28
SUBMIT, SUBMIT_KV, RELEASE_KV = 20, 24, 25
CAPACITY = 1 << 20  # each engine's request_capacity: nothing waits for a seat
_REGISTER_MS = 10_000


def kv_descriptor(rank: int) -> dict[str, Any]:
    """A one-rank engine's KV ``export_meta()`` as #6675 writes it (its transfer
    backends' geometry schema) with NIXL's agent record, its blob left out as a
    prefill leaves it out of a handoff."""
    return {
        "base_addr": 0x7F0000000000 + rank * 0x100000000,
        "outer_stride_bytes": 512 * 65536,
        "device_id": 0,
        "num_outer": 64,
        "bytes_per_slice": 65536,
        "blocks_axis": 2,
        "num_blocks": 512,
        "heads_per_partition": 8,
        "head_dim": 128,
        "tokens_per_block": 16,
        "element_size": 2,
        "global_rank": rank,
        "tp_size": 1,
        "tp_rank": 0,
        "pp_size": 1,
        "pp_rank": 0,
        "num_layers_global": 32,
        "num_kv_heads_global": 8,
        "layer_start": 0,
        "layer_end": 32,
        "agent_name": f"agent-rank{rank}",
    }


def instance_meta(rank: int) -> list[dict[str, Any]]:
    """A one-rank engine's REGISTER_ROLE metadata (#6675's
    _build_instance_transfer_meta): its descriptor, the agent's blob, its capacity."""
    blob = base64.b64encode(b"nixl-agent-metadata:%d" % rank).decode()
    return [{**kv_descriptor(rank), "agent_metadata_b64": blob, "request_capacity": CAPACITY}]


def prefill_body(body: bytes, rank: int) -> bytes:
    """A prefill's finished request: the reply ``body`` with its handoff added (a fixmap
    of fewer than 15 keys, as megatron_reply takes it): the descriptor and the first
    token for kv_meta, one block (a 16-token prompt's)."""
    kv_meta = {**kv_descriptor(rank), "resume_tokens": [1]}
    handoff = {"kv_meta": kv_meta, "block_ids": [1]}
    return bytes([body[0] + 1]) + body[1:] + packb("disaggregated_params") + packb(handoff)


def megatron_pd_engines_child(
    conn: Connection, address: str, roles: tuple[str | None, ...]
) -> None:
    """One #6675 engine per role (None: an engine without one) on ``address``, until the
    bench says stop (the Session's engine child: it answers "stats")."""
    logging.getLogger("coordkit").setLevel(logging.ERROR)
    context = zmq.Context()
    try:
        sock = _routed(context)
        names = [
            b"%s_s%d_dp0" % ((role or "whole").encode(), rank) for rank, role in enumerate(roles)
        ]
        routes = _connect_as(sock, address, names)
        role_of = dict(zip(routes, roles, strict=True))
        for rank, (route, role) in enumerate(zip(routes, roles, strict=True)):
            if role is None:
                sock.send_multipart([route, b""])
                continue
            sock.send_multipart([route, packb([REGISTER_ROLE, role, "nixl", instance_meta(rank)])])
            if not sock.poll(_REGISTER_MS):
                raise TimeoutError(f"{role} engine {rank}: no REGISTER_ROLE_ACK")
            _, reply = sock.recv_multipart()
            if reply != packb([REGISTER_ROLE_ACK]):
                raise RuntimeError(f"{role} engine {rank} refused: {reply!r}")
        conn.send(("ready", address))
        _serve(conn, sock, role_of, dict(zip(routes, range(len(routes)), strict=True)))
    finally:
        context.destroy(linger=0)


def _serve(
    conn: Connection, sock: zmq.Socket, role_of: dict[bytes, str | None], rank_of: dict[bytes, int]
) -> None:
    body = reply_body("megatron")
    handed = {route: prefill_body(body, rank) for route, rank in rank_of.items()}
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(conn.fileno(), zmq.POLLIN)
    messages = answered = 0
    while True:
        ready = dict(poller.poll())
        if conn.fileno() in ready:
            if conn.recv()[0] != "stats":
                return
            conn.send(("stats", messages, answered))
        if sock not in ready:
            continue
        finals: dict[bytes, list[int]] = {}
        for _ in range(4096):
            try:
                route, frame = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            header = frame[1]
            if header == RELEASE_KV:
                continue
            rid = read_rid(frame)
            if header == SUBMIT_KV:
                sock.send_multipart([route, packb([KV_READ_DONE, rid])])
                messages += 1
            if header in (SUBMIT, SUBMIT_KV):
                finals.setdefault(route, []).append(rid)
        for route, rids in finals.items():
            reply = handed[route] if role_of[route] == "prefill" else body
            sock.send_multipart([route, megatron_reply(rids, reply)])
            messages += 1
            answered += len(rids)
