"""The raw libzmq binding drives pyzmq's own sockets.

Through ``zmqutil``, a tiny Cython user of the binding that the session
compiles on coordkit's public ``__init__.pxd`` (tests/support/_zmqutil_c.pyx):
real sockets, real transports, frames sent with pyzmq, moved by the binding,
received intact with pyzmq, and the other way round.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import msgpack
import pytest
import zmq
import zmq.backend.cython._zmq as backend

from tests.support.peers import REPLY, SUBMIT

pytestmark = pytest.mark.c_extension

# metadata, a large payload, a frame that is not msgpack at all, an empty frame
FRAMES = [msgpack.packb([SUBMIT, 5, {"max_tokens": 16}]), os.urandom(1 << 20), b"\xc1\xc1", b""]


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pair(ctx: zmq.Context, endpoint: str) -> tuple[zmq.Socket, zmq.Socket]:
    bound = ctx.socket(zmq.PAIR)
    bound.bind(endpoint)
    connected = ctx.socket(zmq.PAIR)
    connected.connect(endpoint)
    return bound, connected


def loaded_zmq_version(path: str) -> tuple[int, int, int]:
    """The version of the libzmq that ``path``, already loaded here, resolves symbols to."""
    # RTLD_NOLOAD, as includes/libzmq.h binds: a library this process has not loaded raises OSError.
    library = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    version = [ctypes.c_int() for _ in range(3)]
    library.zmq_version(*map(ctypes.byref, version))
    return tuple(v.value for v in version)


def test_libzmq_candidates(zmqutil):
    candidates = zmqutil.libzmq_candidates()
    # pyzmq's backend module is always the last resort and always exists, so that a candidate
    # exists proves nothing: each must be loaded here and be (or link) pyzmq's libzmq.
    assert candidates[-1] == backend.__file__
    assert len(set(candidates)) == len(candidates)
    assert any(os.path.exists(path) for path in candidates)
    for path in candidates:
        assert loaded_zmq_version(path) == zmq.zmq_version_info(), path
    # A pyzmq wheel bundles its libzmq as a shared object: the scan of the maps finds it first.
    bundled = Path(zmq.__file__).parent.parent / "pyzmq.libs"
    if any(bundled.glob("libzmq*.so*")):
        assert Path(candidates[0]).parent == bundled, candidates


def test_forward_inproc(zmqutil, ctx):
    src_in, src = pair(ctx, "inproc://src")
    dst, dst_out = pair(ctx, "inproc://dst")
    src_in.send_multipart(FRAMES)
    assert zmqutil.forward(src, dst) == len(FRAMES)
    assert dst_out.recv_multipart() == FRAMES


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_forward_through_router(zmqutil, ctx, tmp_path, transport):
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if transport == "ipc":
        endpoint = f"ipc://{tmp_path}/router"
        router.bind(endpoint)
    else:
        endpoint = f"tcp://127.0.0.1:{router.bind_to_random_port('tcp://127.0.0.1')}"
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"client-1")
    dealer.connect(endpoint)
    side, side_out = pair(ctx, "inproc://side")

    # in: the ROUTER prepends the sender's identity
    dealer.send_multipart(FRAMES)
    assert zmqutil.forward(router, side) == len(FRAMES) + 1
    assert side_out.recv_multipart() == [b"client-1", *FRAMES]

    # out: the identity frame routes the message back to the dealer
    reply = [msgpack.packb([REPLY, 5]), os.urandom(1 << 20)]
    side_out.send_multipart([b"client-1", *reply])
    assert zmqutil.forward(side, router) == len(reply) + 1
    assert dealer.poll(5000)
    assert dealer.recv_multipart() == reply


def test_forward_times_out(zmqutil, ctx):
    _, src = pair(ctx, "inproc://idle")
    dst, _ = pair(ctx, "inproc://idle-dst")
    assert zmqutil.forward(src, dst, timeout_ms=10) == 0


def test_forward_to_a_vanished_peer_raises(zmqutil, ctx):
    src_in, src = pair(ctx, "inproc://src")
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://nobody")
    src_in.send_multipart([b"no-such-peer", b"x"])
    with pytest.raises(zmq.ZMQError) as info:
        zmqutil.forward(src, router)
    assert info.value.errno == zmq.EHOSTUNREACH


def test_send_and_recv(zmqutil, ctx):
    a, b = pair(ctx, "inproc://a")
    zmqutil.send(a, FRAMES)
    assert b.recv_multipart() == FRAMES
    a.send_multipart(FRAMES)
    assert zmqutil.recv(b) == FRAMES
    zmqutil.send(a, [b"only"])
    assert zmqutil.recv(b) == [b"only"]
    with pytest.raises(zmq.Again):
        zmqutil.recv(b, timeout_ms=10)
    with pytest.raises(ValueError):
        zmqutil.send(a, [])


def test_closed_socket(zmqutil, ctx):
    a, b = pair(ctx, "inproc://closed")
    a.close()
    with pytest.raises(zmq.ZMQError):
        zmqutil.send(a, [b"x"])
    with pytest.raises(zmq.ZMQError):
        zmqutil.forward(a, b, timeout_ms=10)
