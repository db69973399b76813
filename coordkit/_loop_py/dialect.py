"""Multipart and single frame (loop/dialect.pyx): what a request carries in each format."""

from __future__ import annotations

from typing import Any

import zmq

from .. import _codec_py as codec
from .. import protocol
from ..protocol import Buffer, Header
from .message import _parses, _send_all, _view
from .tables import MSGPACK_NIL, MULTIPART, SINGLE_FRAME, SINGLE_FRAME_MAIN


def single_frame(format: int) -> bool:
    """Whether a peer of ``format`` speaks Megatron-Core's single frames."""
    return format == SINGLE_FRAME or format == SINGLE_FRAME_MAIN


def single_layout(header: int, length: int) -> bool:
    """Whether a single-frame SUBMIT has its header's fields: [20, rid, prompt, params]
    (0.19's), with multi_modal_data last (main's), or [24, rid, prompt, params,
    kv_meta, src_block_ids] (main's KV submission)."""
    if header == Header.SUBMIT_REQUEST:
        return length == 4 or length == 5
    return length == 6


def single_walks(length: int, n_multipart: int, n_single: int) -> bool:
    """Whether a single frame must be read whole to be carried: to be split for a
    multipart engine, or (main's five fields) to be cut to four for a 0.19 engine,
    which it may be only once its multi_modal_data is found nil."""
    return n_multipart > 0 or (length == 5 and n_single > 0)


class Inbound:
    """A request, new or kept, to be put in the format of the engine chosen for it."""

    __slots__ = (
        "header",
        "single",
        "length",
        "meta",
        "payload",
        "prompt",
        "params",
        "extra",
        "hashes",
        "hash_frame",
        "tokens",
        "batched",
        "carriers",
        "priority",
        "deadline_ms",
    )

    def __init__(self, header: int):
        self.header = header
        self.single = False  # it came as one frame (Megatron-Core's: 0.19's or main's)
        self.length = 0  # single frame: its fields, 4, 5 or 6
        self.meta = b""  # multipart: its metadata with the server id
        # The frames it came in after the metadata: multipart its payload frames (the
        # prompt first), single frame the frame itself.
        self.payload: list[Any] = []
        # Its prompt, and what follows the rid in its metadata: the params (and a KV
        # submission's kv_meta). Single frame: the params once found (else None: the
        # prompt then runs to the frame's end), then its last field, extra: main's
        # multi_modal_data or src_block_ids (empty for 0.19's four fields).
        self.prompt: Buffer = b""
        self.params: Buffer | None = b""
        self.extra: Buffer = b""
        self.hashes: Buffer | None = None  # its block hashes
        self.hash_frame: Any = None  # the frame they came in: forwarded to a rebuild engine
        self.tokens = 0
        self.batched = False  # an entry of a SUBMIT_BATCH: a batched engine takes it later
        self.carriers = 0  # a bit per PeerFormat whose engines can take it (carriers)
        self.priority = 0  # its QoS, as its client sent it (read_qos): never sent on
        self.deadline_ms = 0


def multipart_inbound(header: int, payload: list[Any], params: Buffer, hashes: Any) -> Inbound:
    """A multipart request: ``payload`` its payload frames (the prompt first), ``params``
    what follows the rid in its metadata (or a SUBMIT_BATCH entry's params), ``hashes``
    its block-hash frame or None."""
    inbound = Inbound(header)
    inbound.payload = payload
    inbound.prompt = _view(payload[0])
    inbound.params = params
    if hashes is not None:
        inbound.hashes = _view(hashes)
        inbound.hash_frame = hashes
    inbound.tokens = codec.prompt_tokens(inbound.prompt)
    return inbound


def single_inbound(
    frame: memoryview, header: int, length: int, prompt: int, params: int, extra: int
) -> Inbound:
    """A single-frame request of ``length`` fields, read as far as its rid (``prompt``
    where the rest starts: it runs to the frame's end, ``params`` 0), or whole
    (``params`` and ``extra`` where the params and the last field start)."""
    inbound = Inbound(header)
    inbound.single = True
    inbound.length = length
    inbound.prompt = frame[prompt:]
    inbound.params = None
    if params:
        inbound.prompt = frame[prompt:params]
        inbound.params = frame[params:extra]
        inbound.extra = frame[extra:]
    inbound.tokens = codec.prompt_tokens(inbound.prompt)
    return inbound


def text_only(inbound: Inbound) -> bool:
    """A single-frame SUBMIT_REQUEST without multimodal data: 0.19's four fields, or
    main's five once read whole with its multi_modal_data nil."""
    return inbound.header == Header.SUBMIT_REQUEST and (
        inbound.length == 4 or (len(inbound.extra) == 1 and inbound.extra[0] == MSGPACK_NIL)
    )


def carriers(inbound: Inbound, single_engines: bool) -> None:
    """Which formats can carry the request, once. A single frame goes to a main engine
    as it came; to a 0.19 engine as a SUBMIT_REQUEST of four fields (main's nil
    multi_modal_data dropped); to a multipart engine once its params were found (it
    splits there), with no multimodal data. A multipart request goes to a
    single-frame engine (when there is one) as [20, rid, prompt, params], so only a
    SUBMIT_REQUEST whose prompt is one str or array and whose params are a map."""
    if inbound.single:
        inbound.carriers = 1 << SINGLE_FRAME_MAIN
        if text_only(inbound):
            inbound.carriers |= 1 << SINGLE_FRAME
        if inbound.params is not None and (
            inbound.header == Header.SUBMIT_REQUEST_WITH_KV or text_only(inbound)
        ):
            inbound.carriers |= 1 << MULTIPART
        return
    assert inbound.params is not None
    inbound.carriers = 1 << MULTIPART
    if (
        single_engines
        and inbound.header == Header.SUBMIT_REQUEST
        and _parses(codec.check_prompt, inbound.prompt)
        and _parses(codec.check_map, inbound.params)
    ):
        inbound.carriers |= 1 << SINGLE_FRAME | 1 << SINGLE_FRAME_MAIN


def carries(inbound: Inbound, format: int) -> bool:
    """Whether an engine of ``format`` can take the request (carriers)."""
    return bool(inbound.carriers >> format & 1)


def rewrite_meta(inbound: Inbound, server_rid: int) -> bytes:
    """A multipart request's metadata with ``server_rid``: ``[header, server_rid,
    <params>]``, an array of 2 + its payload frames."""
    assert inbound.params is not None
    return codec.write_submit(inbound.header, 2 + len(inbound.payload), server_rid, inbound.params)


def send_single(
    sock: zmq.Socket, inbound: Inbound, server_rid: int, format: int, trailer: list[Any]
) -> int:
    """A single-frame request in an engine's format, then ``trailer``; the bytes sent.
    To a main engine the rest behind the new head as it came; to a 0.19 engine its
    four fields; to a multipart engine split at the field boundaries: ``[header,
    server_rid, <params>]``, the prompt and (a KV submission) src_block_ids."""
    params = b"" if inbound.params is None else inbound.params
    if format == SINGLE_FRAME_MAIN:
        rest = b"".join((inbound.prompt, params, inbound.extra))
        meta = codec.write_submit(inbound.header, inbound.length, server_rid, rest)
        return _send_all(sock, [meta, *trailer])
    if format == SINGLE_FRAME:
        rest = b"".join((inbound.prompt, params))
        meta = codec.write_submit(inbound.header, 4, server_rid, rest)
        return _send_all(sock, [meta, *trailer])
    kv = inbound.header == Header.SUBMIT_REQUEST_WITH_KV
    meta = codec.write_submit(inbound.header, 4 if kv else 3, server_rid, params)
    return _send_all(sock, [meta, inbound.prompt, *([inbound.extra] if kv else []), *trailer])


def send_request(
    sock: zmq.Socket, inbound: Inbound, server_rid: int, format: int, trailer: list[Any]
) -> int:
    """A request's frames after its engine's routing id, in the engine's ``format``, then
    ``trailer`` (see trailer_frames); the bytes sent. Multipart to multipart: the
    metadata and the payload frames as themselves. Otherwise the prompt and the params
    spliced into the engine's format (a single frame behind a new head, or split at the
    field boundaries): a copy."""
    if inbound.single:
        return send_single(sock, inbound, server_rid, format, trailer)
    if single_frame(format):
        assert inbound.params is not None
        frame = codec.write_single_submit(
            Header.SUBMIT_REQUEST, server_rid, inbound.prompt, inbound.params
        )
        return _send_all(sock, [frame, *trailer])
    return _send_all(sock, [inbound.meta, *inbound.payload, *trailer])


def trailer_frames(client_rid: int, client_id: bytes | None, hashes: Any) -> list[Any]:
    """What follows a request's payload to a rebuild engine: its trailer ``[client_rid,
    client_id, hashed]`` (``client_id`` None for a client that cannot rejoin), then its
    block-hash frame when given."""
    trailer = protocol.pack_trailer(client_rid, client_id, hashes is not None)
    return [trailer] if hashes is None else [trailer, hashes]


def engine_parses(format: int, header: int) -> bool:
    """Whether an engine of ``format`` parses a message of ``header`` from the
    coordinator: a 0.19 engine has no ABORT_REQUEST and no KV transfer."""
    return format != SINGLE_FRAME or header not in (Header.ABORT_REQUEST, Header.RELEASE_KV)


# Whether a client's format carries a reply (reply_carried).
CARRIED = 0
NOT_SENT = 1  # a partial to a 0.19 client, which takes finals only
NOT_A_MAP = 2  # a body that is not a map, to a Megatron client: counted, dropped


def reply_carried(format: int, header: int, body: Any) -> int:
    """Whether a client of ``format`` takes a reply (CARRIED, NOT_SENT, NOT_A_MAP): a
    Megatron client takes maps, each ``[header, client_rid, <map>]``; a 0.19 client
    finals only."""
    if not single_frame(format):
        return CARRIED
    if header != Header.ENGINE_REPLY and format != SINGLE_FRAME_MAIN:
        return NOT_SENT
    return CARRIED if _parses(codec.check_map, body) else NOT_A_MAP


def send_reply(sock: zmq.Socket, format: int, header: int, client_rid: int, body: Any) -> int:
    """A reply's frames after its client's routing id, in the client's ``format``: one
    ``[header, client_rid, <map>]``, or ``[header, client_rid]`` and the body; the
    bytes sent."""
    if single_frame(format):
        return _send_all(sock, [codec.write_submit(header, 3, client_rid, body)])
    return _send_all(sock, [codec.write_header_int(header, client_rid), body])
