"""The P/D engines' messages, read for the P/D room (loop/pdmessages.pyx)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import zmq

from .. import _codec_py as codec
from .. import _pd, protocol
from ..protocol import Buffer, EngineRole, ErrorCode, Header, ProtocolError, packb, unpackb
from .tables import ABORTED, _Engine, _Request

if TYPE_CHECKING:
    from .pd import PD, Hop


class PDMessages:
    """The P/D engines' messages: a coordkit prefill's HANDOFF, a #6675 prefill's reply,
    NCCL's KV_TRANSFER_READY, KV_READ_DONE, an engine's REQUEST_ERROR and REQUEST_ABORTED,
    each read and handed to its request's hops."""

    def __init__(self, pd: PD):
        self._pd = pd

    def from_engine(self, engine: _Engine, header: int, frames: list[zmq.Frame]) -> bool:
        """The P/D messages of an engine (False: not one)."""
        if header == Header.HANDOFF:
            self.handoff(engine, frames)
        elif header == Header.KV_TRANSFER_READY:
            self.transfer_ready(engine, frames)
        elif header == Header.KV_READ_DONE:
            self.read_done(engine, frames)
        elif header == Header.REQUEST_ERROR:
            self.request_error(engine, frames)
        elif header == Header.REQUEST_ABORTED:
            self.request_aborted(engine, frames)
        elif header == Header.REGISTER_ROLE:
            self._pd._loop._peers.register_role(engine.identity, engine, frames)
        else:
            return False
        return True

    def handoff(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """A coordkit prefill's HANDOFF: each kv_meta and block-id frame goes to the
        decode as it came."""
        meta = frames[1].bytes
        try:
            entries = codec.read_handoff(meta)
        except ProtocolError as exc:
            self._pd._loop._refusals.malformed(None, None, Header.HANDOFF, str(exc), frames)
            return
        if len(entries) != len(frames) - 2:
            self._pd._loop._refusals.malformed(
                None, None, Header.HANDOFF, "bad frame layout", frames
            )
            return
        for (rid, offset, size), frame in zip(entries, frames[2:], strict=True):
            self._pd._handed(engine.rank, rid, meta[offset : offset + size], frame.bytes, 0, None)

    def hop_at(self, rid: int, rank: int) -> Hop | None:
        """The request's hop when ``rank`` is its decode (before its read), else None."""
        hop = self._pd.hops.get(rid)
        if hop is None or hop.stage != _pd.DECODE or hop.decode != rank:
            return None
        return hop

    def transfer_ready(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        message = self._pd._loop._answers.parse(protocol.KV_TRANSFER_READY, None, -1, frames)
        if message is None:
            return
        hop = self.hop_at(message.rid, engine.rank)
        if hop is None:
            self._pd.counts["stray"] += 1
            return
        prefill = self._pd.seats.get(hop.prefill)
        if prefill is not None and prefill.megatron and not prefill.nccl:
            request = self._pd._loop._find(message.rid)
            assert request is not None
            self._pd._end(request, ErrorCode.ENGINE_FAILED, _pd.UNEXPECTED_READINESS, False)
            return
        decode_meta = self._pd.seats[engine.rank].transfer
        frame = _pd.send_kv_message(message.rid, decode_meta, message.cached_prefix_blocks)
        self._pd._send_to(hop.prefill, [frame])

    def read_done(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """KV_READ_DONE: a request's read, or the reads of a coordkit decode's step; the
        pins of those a coordkit prefill holds released in one RELEASE_KV per prefill."""
        try:
            _, rids = codec.read_rids(frames[1].bytes)
        except ProtocolError as exc:
            self._pd._loop._refusals.malformed(None, None, Header.KV_READ_DONE, str(exc), frames)
            return
        if len(frames) != 2:
            self._pd._loop._refusals.malformed(
                None, None, Header.KV_READ_DONE, "bad frame layout", frames
            )
            return
        self._pd.releasing = {} if len(rids) > 1 else None
        try:
            for rid in rids:
                self.read_one(engine, rid)
        finally:
            releases, self._pd.releasing = self._pd.releasing, None
            if releases:
                self._pd._send_releases(releases)

    def read_one(self, engine: _Engine, rid: int) -> None:
        hop = self.hop_at(rid, engine.rank)
        if hop is not None:
            hop.stage = _pd.READ
            if hop.pins:
                self._pd._release_pins(rid, hop)
            return
        orphan = self._pd.orphans.get(rid)
        if orphan is not None and orphan.decode == engine.rank:
            self._pd._free_orphan(rid)
            return
        self._pd.counts["stray"] += 1

    def request_error(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        """An engine's REQUEST_ERROR for a request it holds: it ends with the engine's
        reason; not safe, its pins wait for the read."""
        message = self._pd._loop._answers.parse(protocol.REQUEST_ERROR, None, -1, frames)
        if message is None:
            return
        request = self._pd._loop._find(message.rid)
        if request is None or request.rank != engine.rank:
            orphan = self._pd.orphans.get(message.rid)
            if message.source_safe and orphan is not None and orphan.decode == engine.rank:
                self._pd._free_orphan(message.rid)
            else:
                self._pd.counts["stray"] += 1
            return
        if request.server_rid not in self._pd.hops:  # a whole request its engine failed
            self._pd._end(request, ErrorCode.ENGINE_FAILED, message.reason, True)
            return
        self._pd._end(request, ErrorCode.ENGINE_FAILED, message.reason, message.source_safe)

    def request_aborted(self, engine: _Engine, frames: list[zmq.Frame]) -> None:
        message = self._pd._loop._answers.parse(protocol.REQUEST_ABORTED, None, -1, frames)
        if message is None or not message.source_safe:
            return  # unsafe: a safe one follows
        request = self._pd._loop._find(message.rid)
        if request is not None and request.rank == engine.rank:
            self._pd._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        orphan = self._pd.orphans.get(message.rid)
        if orphan is not None and orphan.decode == engine.rank:
            self._pd._free_orphan(message.rid)

    # -- a #6675 prefill's replies ------------------------------------------------------

    def prefilled(self, request: _Request, engine: _Engine, body: Buffer) -> None:
        """A #6675 prefill's finished request, read for its handoff (NIXL blobs put back)."""
        pd = self._pd
        rid, rank = request.server_rid, engine.rank
        hop = pd.hops[rid]
        try:
            record = unpackb(body)
        except ProtocolError:
            record = None
        handoff = _pd.handoff_of(record)
        if request.flags & ABORTED:
            pd._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
            pd._end(request, ErrorCode.ABORTED, _pd.ABORTED_TEXT, True, aborted=True)
            return
        if isinstance(handoff, str):
            pd._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
            pd._end(request, ErrorCode.ENGINE_FAILED, handoff, True)
            return
        kv_meta, blocks = handoff
        registration = pd.registrations.get(engine.identity)
        if registration is not None and registration.transport == "nixl":
            try:
                kv_meta = _pd.restore_nixl_blobs(
                    kv_meta, registration.instance_meta, registration.agents
                )
            except ValueError as error:
                pd._send_to(rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
                pd._end(
                    request,
                    ErrorCode.ENGINE_FAILED,
                    f"invalid NIXL handoff metadata: {error}",
                    True,
                )
                return
        tokens = _pd.prompt_tokens_of(record) if _pd.str_prompt(hop.prompt) else None
        pd._handed(rank, rid, packb(kv_meta), packb(blocks), _pd.decode_slots(kv_meta), tokens)

    def stray_reply(self, engine: _Engine, rid: int) -> None:
        """A #6675 prefill's reply of no request of its (ended meanwhile): what it may
        have pinned for it goes."""
        pd = self._pd
        seat = pd.seats.get(engine.rank)
        if seat is not None and seat.megatron and seat.role & EngineRole.PREFILL:
            pd._send_to(engine.rank, [protocol.rids_message(Header.RELEASE_KV, rid)])
