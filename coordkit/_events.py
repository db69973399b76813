"""What an engine rank receives, as events: the Engine hands them out, both engine cores make them.

:class:`Request` (SUBMIT_REQUEST, SUBMIT_REQUEST_WITH_KV, an entry of an
ENGINE_SUBMIT_BATCH), :class:`Abort`, :class:`ReleaseKV` and :class:`Control`;
:func:`refused` is what both cores do with an ERROR from the coordinator. They
live apart from the endpoint (``engine.py``, which re-exports them) and from
either core, so that the twins ``_engine_c`` and ``_engine_py`` import a
module below both, never each other or the endpoint above them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import zmq

from ._shared import logger
from .protocol import HANDOFF_KEY, Header, unpackb
from .tracing import TRACEPARENT

__all__ = [
    "Request",
    "Abort",
    "ReleaseKV",
    "SendKV",
    "Control",
    "Event",
    "refused",
    "take_traceparent",
]

#: The engine side's logger: ``<package>.engine``, as the endpoint's own.
log = logger.getChild("engine")


@dataclass(frozen=True, slots=True)
class Request:
    """A new request: SUBMIT_REQUEST, or SUBMIT_REQUEST_WITH_KV when ``kv_meta`` is set.

    ``prompt`` (and ``src_block_ids``) are the received frames, not copies. In
    disaggregated prefill/decode (docs/pd.md) a request is a hop: the prefill hop is a
    SUBMIT whose sampling params say ``"do_kv_handoff": True`` (:meth:`prefill_hop`:
    compute the prompt's KV, pin it and hand it off with ``Engine.handoff``); the
    decode hop is a SUBMIT_REQUEST_WITH_KV (:meth:`decode_hop`): ``kv_meta`` is what
    the prefill handed off, ``src_block_ids`` its pinned blocks (:meth:`src_blocks`).
    ``traceparent`` is the W3C trace context of a request its client traced (None
    otherwise), taken out of the sampling params it came in (``"traceparent"``), so
    that ``sampling_params`` are the caller's own: :func:`coordkit.tracing.engine_span`
    continues the trace.
    """

    server_rid: int
    sampling_params: Any
    prompt: zmq.Frame
    kv_meta: Any = None
    src_block_ids: zmq.Frame | None = None
    traceparent: str | None = None

    def prompt_tokens(self) -> Any:
        """The prompt msgpack-decoded: token ids (or a str, as the client sent it)."""
        return unpackb(self.prompt.buffer)

    def prefill_hop(self) -> bool:
        """Whether this is the prefill hop of a P/D request: hand its KV off, do not
        generate."""
        params = self.sampling_params
        return isinstance(params, dict) and params.get(HANDOFF_KEY) is True

    def decode_hop(self) -> bool:
        """Whether this is the decode hop of a P/D request (a KV submission)."""
        return self.kv_meta is not None

    def src_blocks(self) -> Any:
        """The prefill's pinned block ids, msgpack-decoded (None without them)."""
        return None if self.src_block_ids is None else unpackb(self.src_block_ids.buffer)


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort ``server_rid``; the engine still owes it a final reply."""

    server_rid: int


@dataclass(frozen=True, slots=True)
class ReleaseKV:
    """RELEASE_KV: unpin the blocks handed off for request ``rid``. From a coordinator
    running P/D, to the prefill that handed them off, once the decode read them (or
    will not); otherwise a client's, broadcast to every engine, ``rid`` as it sent it."""

    rid: int


@dataclass(frozen=True, slots=True)
class SendKV:
    """SEND_KV, to a prefill whose decode pushes (NCCL): push request ``server_rid``'s
    pinned blocks from ``cached_prefix_blocks`` on to the decode ``decode_meta``
    describes (its registration's transfer descriptor)."""

    server_rid: int
    decode_meta: Any
    cached_prefix_blocks: int = 0


@dataclass(frozen=True, slots=True)
class Control:
    """A control signal (PAUSE ... STOP_CUDA_PROFILER); ``epoch`` for SET_GENERATION_EPOCH."""

    header: Header
    epoch: int | None = None


Event = Request | Abort | ReleaseKV | SendKV | Control


def take_traceparent(params: Any) -> str | None:
    """The traceparent a traced request's params carry, taken out of them (a map of the
    engine's own: the core decoded it); None when they carry none."""
    if type(params) is not dict:
        return None
    traceparent = params.pop(TRACEPARENT, None)
    return traceparent if type(traceparent) is str else None


def refused(error: Any) -> None:
    """An ERROR from the coordinator: a reply entry of ours it could not deliver."""
    log.warning(
        "coordkit engine: the coordinator refused %s: %s",
        "a message" if error.rid is None else f"the reply to request {error.rid}",
        error.message,
    )
