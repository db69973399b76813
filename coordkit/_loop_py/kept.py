"""The kept-prompt store (loop/kept.pyx)."""

from __future__ import annotations

import zmq

from .. import _codec_py as codec
from .._shared import COPY_BELOW, SHARED_SMALL_MAX
from ..protocol import Header, ProtocolError
from .dialect import Inbound, multipart_inbound, single_inbound, single_walks
from .message import _view
from .tables import Kept


def keep(meta: bytes | None, prompt: zmq.Frame, single: bool, small_shared: int) -> Kept:
    """What re-sends a request. A prompt of COPY_BELOW bytes or more has a buffer of
    its own: shared. A smaller one is shared too while the loop shares fewer than
    SHARED_SMALL_MAX (``small_shared``): sharing a small frame pins the whole receive
    buffer libzmq decoded it from, so past that bound it is copied (pyzmq's
    copy-below-a-threshold rule)."""
    if len(prompt) >= COPY_BELOW:
        return Kept(meta, prompt, single, False)
    if small_shared < SHARED_SMALL_MAX:
        return Kept(meta, prompt, single, True)
    return Kept(meta, prompt.bytes, single, False)


def kept_prompt(kept: Kept) -> memoryview:
    """The kept prompt's bytes (for a single frame: the whole frame)."""
    return _view(kept.prompt)


def kept_inbound(kept: Kept, n_multipart: int, n_single: int) -> Inbound:
    """A kept request as an Inbound, to be re-sent as a new one is sent: a single frame
    read again (whole when the engines of each format, ``n_multipart`` and
    ``n_single``, say it must be: single_walks), or its metadata and its prompt."""
    data = kept_prompt(kept)
    if kept.single:
        header, _, length, prompt = codec.read_single_head(data)
        params = extra = 0
        if single_walks(length, n_multipart, n_single):
            try:
                *_, params, extra = codec.read_single_submit(data)
            except ProtocolError:
                pass
        return single_inbound(data, header, length, prompt, params, extra)
    assert kept.meta is not None
    meta = memoryview(kept.meta)
    inbound = multipart_inbound(
        Header.SUBMIT_REQUEST, [kept.prompt], meta[codec.read_submit(meta)[3] :], None
    )
    inbound.meta = kept.meta
    return inbound
