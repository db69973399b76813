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

An endpoint given several coordinator addresses (``"tcp://a:5555,tcp://b:5555"``:
standbys of one etcd NAME) follows one at a time, its :class:`Candidates`: its
socket is connected to one address only (a DEALER connected to two would deal
its messages between both), and it moves to the next when the connection ends,
when no connection is made within ``CANDIDATE_WINDOW``, or when the coordinator
that answers announces an epoch older than one it has seen.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Container, Mapping
from typing import Any, cast

import zmq
from zmq.utils.monitor import recv_monitor_message

from ._checks import check_addresses
from .curve import KeySource, ServerKey, secure_client
from .protocol import EPOCH_KEY

__all__ = [
    "ACK_WINDOW",
    "CANDIDATE_WINDOW",
    "DEFAULT_COORDINATOR_TIMEOUT",
    "Candidates",
    "ConnectionWatch",
    "Following",
    "prepare",
]

#: Seconds without a sign of life before the coordinator is deemed lost.
DEFAULT_COORDINATOR_TIMEOUT = 5.0
#: Seconds an endpoint with several coordinator addresses waits at one for a connection
#: before it tries the next: a serving coordinator's handshake takes milliseconds; a
#: standby has not bound its address, and a frozen leader's host accepts but never greets.
CANDIDATE_WINDOW = 0.5
#: Seconds a candidate connected to has to acknowledge the CONNECT or ENGINE_HELLO
#: before the next is tried (a serving coordinator answers in milliseconds).
ACK_WINDOW = 2.0

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

    def events(self, others: Container[str] = ()) -> list[int]:
        """The events reported since the last call, in order (never blocks), but
        those of the endpoints in ``others`` (addresses left: libzmq may report
        one late)."""
        found = []
        while cast(int, self._monitor.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            if event["endpoint"].decode() not in others:
                found.append(event["event"])
        return found

    def close(self) -> None:
        """Stop watching; call before the socket closes (again: nothing)."""
        if self._monitor.closed:
            return
        self._socket.disable_monitor()
        self._monitor.close(linger=0)


class Candidates:
    """The coordinators an endpoint may follow: the one it follows, the highest epoch seen.

    With one address nothing is chosen: libzmq reconnects to it by itself, and
    no epoch is compared (a coordinator restarted there is the only one to
    follow). With several, :meth:`admit` takes a coordinator only if it
    announces an epoch no older than any admitted before, so that an endpoint
    never goes back to a stale leader, and :meth:`move` goes to the next.
    """

    def __init__(self, address: str):
        self.addresses = check_addresses(address)
        self.index = 0
        #: The highest epoch an admitted coordinator announced (None: none yet).
        self.epoch: int | None = None

    @property
    def several(self) -> bool:
        return len(self.addresses) > 1

    @property
    def current(self) -> str:
        """The address followed (or tried) now."""
        return self.addresses[self.index]

    @property
    def others(self) -> tuple[str, ...]:
        """The addresses but the current one (libzmq reports them as given)."""
        return self.addresses[: self.index] + self.addresses[self.index + 1 :]

    def admit(self, features: Mapping[Any, Any]) -> str | None:
        """Whether to follow the coordinator that answered with ``features`` (a
        CONNECT_ACK's or ENGINE_ACK's map): None, and its epoch the highest seen,
        or why not."""
        epoch = features.get(EPOCH_KEY)
        if type(epoch) is not int:
            return f"the coordinator at {self.current} announces no epoch"
        if self.epoch is not None and epoch < self.epoch:
            return (
                f"the coordinator at {self.current} is of epoch {epoch}, "
                f"older than {self.epoch}: a stale leader"
            )
        self.epoch = epoch
        return None

    def refresh(self) -> None:
        """Nothing: the addresses given are all there is (a cluster's are read again)."""

    def move(self, socket: zmq.Socket, discard: bool = False) -> None:
        """Leave the current coordinator for the next one (after the last: the first);
        ``discard`` drops what the one left sent that was not read yet (a refused one's)."""
        # What is queued for it is dropped (the rebuild sends it again), or it would keep
        # the context's term() waiting for a coordinator that may never come back.
        linger = socket.getsockopt(zmq.LINGER)
        socket.setsockopt(zmq.LINGER, 0)
        with contextlib.suppress(zmq.ZMQError):  # ENOENT: libzmq dropped it already
            socket.disconnect(self.current)
        socket.setsockopt(zmq.LINGER, linger)
        if discard:
            with contextlib.suppress(zmq.Again):
                while True:
                    socket.recv_multipart(zmq.NOBLOCK, copy=False)
        self.index = (self.index + 1) % len(self.addresses)
        socket.connect(self.current)


class Following:
    """What a client and an engine say of the coordinators they follow (their ``_candidates``)."""

    _candidates: Candidates

    @property
    def address(self) -> str:
        """The coordinator's address (of several: the one followed or tried now)."""
        return self._candidates.current

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every coordinator address it was given."""
        return self._candidates.addresses
