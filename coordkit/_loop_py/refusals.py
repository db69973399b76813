"""The refusals and terminal errors (loop/refusals.pyx)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from .. import protocol
from .._shared import Counter, GoneReason, QueueOutcome, RouteStatus, megatron_failed_reply
from ..protocol import ErrorCode, Header, error_text, header_name
from .tables import ABORTED, GONE, SINGLE_FRAME_MAIN, _Client, _Engine, _Request

if TYPE_CHECKING:
    from .loop import Loop


def _refusal(status: RouteStatus) -> ErrorCode:
    """The ErrorCode for a new request no engine took (a RouteStatus other than SENT)."""
    if status == RouteStatus.NO_ENGINES:
        return ErrorCode.NO_ENGINES
    return ErrorCode.MALFORMED if status == RouteStatus.UNSENDABLE else ErrorCode.BUSY


_REFUSAL_COUNTERS = {
    RouteStatus.NO_ENGINES: Counter.NO_ENGINES,
    RouteStatus.ALL_BUSY: Counter.BUSY,
    RouteStatus.UNSENDABLE: Counter.MALFORMED,
}


class Refusals:
    """The refusals and terminal errors: a request failed, timed out or refused; ERROR to a
    client; malformed input answered and counted."""

    def __init__(self, loop: Loop):
        self._loop = loop

    def fail_request(self, request: _Request, code: ErrorCode, header: int) -> None:
        """End ``request`` with ERROR(code): its one terminal reply."""
        self._loop._tally.failed(request.rank)
        if self._loop._traces is not None:
            self._loop._traces.fail(request, code)
        self._loop._forget(request)
        self._loop._failed[code] += 1
        if code == ErrorCode.ENGINE_FAILED:
            self._loop._counters[Counter.ENGINE_FAILED] += 1
        if not self.send_error(request.client, request.client_rid, code, header, True):
            self._loop._peers.client_gone(request.client)

    def time_out(self, request: _Request) -> None:
        """End a request in flight longer than request_timeout: ERROR(TIMED_OUT) to
        its client, ABORT to its engine (whose late final is then unknown, dropped); one
        that waits leaves the queue; a P/D request's hops are its room's."""
        self._loop._counters[Counter.TIMED_OUT] += 1
        if self._loop._pd is not None and request.server_rid in self._loop._pd.hops:
            self._loop._pd.time_out(request)
            return
        if request.rank < 0:
            self._loop._unqueue(request, QueueOutcome.TIMED_OUT)
        elif not request.flags & ABORTED and self._loop._engines[request.rank].state != GONE:
            self._loop._control.abort_at_engine(
                self._loop._engines[request.rank], request.server_rid
            )
        self.fail_request(request, ErrorCode.TIMED_OUT, Header.SUBMIT_REQUEST)

    def reject_entry(self, engine: _Engine, rid: int | None, code: int, header: int) -> None:
        """An entry of an engine's batch that was not delivered: malformed ones are
        counted and logged, and a coordkit engine is told with an ERROR."""
        if code == ErrorCode.MALFORMED:
            self._loop._counters[Counter.MALFORMED_ENTRIES] += 1
            self._loop._tally.engines[engine.rank].malformed_entries += 1
            what = f"malformed entry in {header_name(header)} from engine {engine.rank}"
            self._loop._log.warn("malformed", what)
        if engine.coordkit:
            error = protocol.ERROR.pack(rid, code, error_text(code, header))
            if not self._loop._answers.send(engine.identity, error):
                self._loop._faults.lost(engine, GoneReason.UNREACHABLE)

    def send_error(
        self,
        client: _Client,
        rid: int | None,
        code: int,
        header: int,
        ends: bool = False,
        text: str | None = None,
    ) -> bool:
        """ERROR to a coordkit client (its text ``text``, else error_text's); to a
        Megatron main client, when the error ends a request of its (``ends``), the
        FAILED final it takes (0.19's clients get nothing). False when the client is
        gone."""
        if not client.present or (
            not client.coordkit and not (ends and client.format == SINGLE_FRAME_MAIN)
        ):
            return True  # away, its REJOIN then finds it ended; or it takes no ERROR
        self._loop._counters[Counter.ERRORS_SENT] += 1
        text = error_text(code, header) if text is None else text
        if self._loop._pr6675 and not client.coordkit:  # #6675's client: its REQUEST_ERROR
            assert rid is not None
            return self._loop._answers.send(
                client.identity, protocol.REQUEST_ERROR.pack(rid, text, True)
            )
        if not client.coordkit:
            assert rid is not None
            self._loop._log.warn(
                "failed_final", f"a Megatron main client's request {rid} failed: {text}"
            )
            return self._loop._answers.send(client.identity, [megatron_failed_reply(rid)])
        return self._loop._answers.send(client.identity, protocol.ERROR.pack(rid, code, text))

    def refuse(
        self,
        client: _Client,
        rid: int | None,
        code: int,
        header: int,
        counter: Counter,
        ends: bool = False,
    ) -> None:
        """Count a refused message and answer its client with ERROR(code); ``ends``:
        it was a request that parsed (see _send_error)."""
        self._loop._counters[counter] += 1
        self._loop._refused[code] += 1
        if not self.send_error(client, rid, code, header, ends):
            self._loop._peers.client_gone(client)

    def malformed(
        self,
        client: _Client | None,
        rid: int | None,
        header: int,
        detail: str,
        frames: list[Any],
    ) -> None:
        """A message that does not parse: counted, logged (rate-limited), and
        answered when its sender is a client."""
        sender = frames[0] if isinstance(frames[0], bytes) else frames[0].bytes
        self._loop._log.warn(
            "malformed", f"malformed {header_name(header)} from {sender!r}: {detail}"
        )
        if client is None:
            self._loop._counters[Counter.MALFORMED] += 1
        else:
            self.refuse(client, rid, ErrorCode.MALFORMED, header, Counter.MALFORMED)

    def malformed_batch(
        self, client: _Client, rids: Sequence[int], detail: str, frames: list[zmq.Frame]
    ) -> None:
        """A SUBMIT_BATCH whose entries cannot all go on: no prompt can be told from
        another, so each request named ends here; when none is, one ERROR without
        an id says so."""
        if not rids:
            self.malformed(client, None, Header.SUBMIT_BATCH, detail, frames)
        for rid in rids:
            if self._loop._clients.get(client.identity) is not client:
                return  # found gone meanwhile
            self.malformed(client, rid, Header.SUBMIT_BATCH, detail, frames)

    def shut_down(self) -> None:
        """End every request still in flight with ERROR(SHUTTING_DOWN): its terminal reply."""
        for request in self._loop._faults.in_order(lambda r: True):
            if self._loop._find(request.server_rid) is request:
                self._loop._unqueue(request, QueueOutcome.REFUSED)
                self.fail_request(request, ErrorCode.SHUTTING_DOWN, Header.SHUTDOWN)
        self._loop._faults.settle()
        if self._loop._traces is not None and self._loop._traces.ending:
            self._loop._traces.end()
