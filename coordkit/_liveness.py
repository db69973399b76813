"""What the client and the engine share to notice a lost coordinator, and to find it again.

Two libzmq features, no thread of ours:

* ZMTP heartbeats (``ZMQ_HEARTBEAT_IVL`` / ``_TIMEOUT`` / ``_TTL``): libzmq's
  I/O thread PINGs the coordinator every ``coordinator_timeout / 2`` and closes
  the connection when nothing came back for ``coordinator_timeout / 2`` after a
  PING, so a dead (or unreachable) coordinator is noticed within
  ``coordinator_timeout``; the TTL asks the coordinator to drop us likewise.
  A coordinator process that dies is usually noticed at once, when its host
  closes the connection; the heartbeats catch a host or network that went quiet.
* a socket monitor: libzmq reports the connection's end (``EVENT_DISCONNECTED``)
  and, after it reconnects by itself, the new handshake
  (``EVENT_HANDSHAKE_SUCCEEDED``), on an inproc PAIR socket whose FD can be
  watched like any other.
"""

from __future__ import annotations

import itertools
from typing import cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from .curve import KeySource, ServerKey, secure_client

__all__ = ["DEFAULT_COORDINATOR_TIMEOUT", "ConnectionWatch", "prepare"]

#: Seconds without a sign of life before the coordinator is deemed lost.
DEFAULT_COORDINATOR_TIMEOUT = 5.0

_TTL_MAX_MS = 6_553_500  # the largest ZMQ_HEARTBEAT_TTL libzmq accepts
_WATCHED = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
_monitor_names = itertools.count()


def prepare(
    socket: zmq.Socket,
    coordinator_timeout: float | None,
    curve_server_key: ServerKey | None,
    curve_keys: KeySource | None,
) -> None:
    """Set heartbeats and CURVE keys on ``socket``, which must not be connected yet."""
    if (curve_server_key is None) != (curve_keys is None):
        raise ValueError("coordkit: CURVE needs both curve_server_key and curve_keys")
    if curve_server_key is not None and curve_keys is not None:
        secure_client(socket, curve_server_key, curve_keys)
    if coordinator_timeout is None:
        return
    if not coordinator_timeout > 0:
        raise ValueError("coordkit: coordinator_timeout must be above 0 (or None)")
    timeout_ms = max(round(coordinator_timeout * 1000), 2)
    socket.setsockopt(zmq.HEARTBEAT_IVL, timeout_ms // 2)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms - timeout_ms // 2)
    socket.setsockopt(zmq.HEARTBEAT_TTL, min(timeout_ms, _TTL_MAX_MS))


class ConnectionWatch:
    """The connection events of one connecting socket: its end, and each new handshake.

    Create it before the socket connects, so that no event is missed.
    """

    def __init__(self, socket: zmq.Socket):
        self._socket = socket
        address = f"inproc://coordkit-connection-{next(_monitor_names)}-{id(self)}"
        socket.monitor(address, _WATCHED)
        # A plain socket whatever the context's class: the events are read without blocking.
        self._monitor = zmq.Socket(socket.context, zmq.PAIR)
        self._monitor.connect(address)

    @property
    def fd(self) -> int:
        """The monitor's FD, edge-triggered as every ZeroMQ FD: read with :meth:`events`."""
        return cast(int, self._monitor.getsockopt(zmq.FD))

    def events(self) -> list[int]:
        """The events reported since the last call, in order (never blocks)."""
        found = []
        while cast(int, self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            found.append(recv_monitor_message(self._monitor, zmq.NOBLOCK)["event"])
        return found

    def close(self) -> None:
        """Stop watching; call before the socket closes (again: nothing)."""
        if self._monitor.closed:
            return
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
