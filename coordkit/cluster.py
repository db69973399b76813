"""Several coordinators serving one fleet at once: members in etcd, clients spread by
rendezvous, engines shared by all (``coordkit[ha]``; docs/scaling.md).

* **Membership.** A member (``coordkit serve --cluster etcd://HOST:PORT/NAME``) holds
  a lease on ``/coordkit/NAME/members/ID`` whose value is its address
  (:class:`Member`); a keepalive thread renews it every ``ttl / 3``. A member whose
  lease lapses is gone. Joining needs etcd: :meth:`Member.join` raises
  ConnectionError when etcd does not answer, so no member joins while etcd is
  unreachable. A member already in keeps serving through an etcd outage whatever
  happens to its lease; when etcd answers again and the lease is gone, it joins again
  under a new lease.
* **The view.** :func:`read_members` reads the live members' addresses once;
  :class:`View` keeps them read every ``interval`` on a thread of its own. When etcd is
  unreachable, the view stays what it last was: endpoints serve on their last view.
  Etcd carries the members only: nothing per request, per client or per engine.
* **Rendezvous.** :func:`rendezvous` orders the members for a key (a client's routing
  id) by highest random weight: the first is its coordinator, the next its choice
  when that one is gone. A member joining takes about 1/N of the keys from the
  others and moves no other key; one leaving moves only its own keys.
* **Clients** follow one member at a time (:class:`Spread`, the candidates of
  :mod:`coordkit._liveness` ordered by rendezvous), and move to the next choice,
  REJOINing there, when theirs is gone.
* **Engines** connect to every member (:class:`SharedLinks`: one
  :class:`~coordkit.engine.Engine` per member, following the view); a reply goes back
  on the connection its request came in on. A declared capacity is split among the
  members the engine knows when each link registers. Each member's server ids are its
  own: one that another member already holds at the engine (adopted from a member
  lost, which came back and sent it again) gets an id of the engine's own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from . import protocol
from ._checks import check_address
from ._events import Abort, Event, Request
from ._held import Held
from ._liveness import Candidates
from .election import (
    EtcdEndpoint,
    _etcd3gw,
    _lease_not_found,
    _reason,
    _unreachable,
    parse_endpoint,
)
from .protocol import EPOCH_KEY

if TYPE_CHECKING:
    import etcd3gw


class Link(Protocol):
    """What :class:`SharedLinks` uses of each member's :class:`~coordkit.engine.Engine`
    (not imported: engine.py imports this module)."""

    _socket: zmq.Socket
    _rebuild: Held | None
    connected: bool
    pending: int

    @property
    def registered(self) -> bool: ...

    def poll(self, timeout: float = 0.0) -> list[Event]: ...
    def wait_registered(self, timeout: float = 10.0) -> bool: ...
    def reply(self, finished: Iterable[Any]) -> None: ...
    def reply_partial(self, partial: Iterable[tuple[int, Any]]) -> None: ...
    def disconnect(self) -> None: ...
    def close(self) -> None: ...


log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_TTL",
    "Member",
    "SharedLinks",
    "Spread",
    "View",
    "is_cluster",
    "members_prefix",
    "read_members",
    "rendezvous",
]

#: The member's lease TTL in whole seconds (etcd raises one below its minimum).
DEFAULT_TTL = 3
#: Seconds between two reads of the view by a :class:`View` (a member lapses in a TTL).
VIEW_INTERVAL = 0.5
#: Seconds an etcd request may take before etcd counts as unreachable for a read.
READ_TIMEOUT = 1.0
#: Seconds an idle engine waits on its links at most before it looks at each again.
_LINK_WATCH = 0.1
#: Seconds a link to a member of a static list stays lost before what it holds is
#: handed to the other members (a member in etcd: once it left the view).
HAND_OVER_AFTER = 1.0
#: The first of the ids an engine gives a member's request whose server id another
#: member holds there: past every server id (u64), so they meet none.
_OWN_IDS = 1 << 64


def is_cluster(address: object) -> bool:
    """Whether an endpoint's address names members (``etcd://...``, or a list of
    coordinator addresses) rather than one coordinator or ``--ha`` standbys."""
    return isinstance(address, list | tuple) or (
        isinstance(address, str) and address.startswith("etcd://")
    )


def members_prefix(endpoint: EtcdEndpoint) -> str:
    """Where NAME's members live in etcd (``etcdctl get --prefix`` lists them)."""
    return f"/coordkit/{endpoint.name}/members/"


# -- rendezvous ------------------------------------------------------------------------


def _weight(key: bytes, member: str) -> int:
    digest = hashlib.blake2b(member.encode() + b"\0" + key, digest_size=8).digest()
    return int.from_bytes(digest, "little")


def rendezvous(key: bytes, members: Iterable[str]) -> list[str]:
    """``members`` (addresses), ``key``'s first choice first: highest random weight, a
    hash of the member and the key (ties, never seen in practice, by address)."""
    return sorted(set(members), key=lambda member: (-_weight(key, member), member))


# -- membership ------------------------------------------------------------------------


def _client(endpoint: EtcdEndpoint, timeout: float) -> etcd3gw.Etcd3Client:
    etcd = _etcd3gw()
    return etcd.client(host=endpoint.host, port=endpoint.port, timeout=timeout, api_path="/v3/")


def _errors() -> tuple[type[BaseException], ...]:
    return (_etcd3gw().exceptions.Etcd3Exception, OSError)


def _unreachable_error(endpoint: EtcdEndpoint, exc: BaseException) -> Exception:
    where = f"etcd at {endpoint.host}:{endpoint.port}"
    if _unreachable(exc):
        return ConnectionError(f"coordkit: {where} is not reachable: {_reason(exc)}")
    return RuntimeError(f"coordkit: {where}: {_reason(exc)}")


def read_members(endpoint: str | EtcdEndpoint, timeout: float = READ_TIMEOUT) -> dict[str, str]:
    """NAME's live members now, ID → address (ConnectionError: etcd does not answer)."""
    endpoint = endpoint if isinstance(endpoint, EtcdEndpoint) else parse_endpoint(endpoint)
    prefix = members_prefix(endpoint)
    client = _client(endpoint, timeout)
    try:
        found = client.get_prefix(prefix)
    except _errors() as exc:
        raise _unreachable_error(endpoint, exc) from None
    finally:
        client.session.close()
    return {kv["key"].decode().removeprefix(prefix): value.decode() for value, kv in found}


class Member:
    """One coordinator's membership of NAME: its key under a lease while it serves.

    :meth:`join` puts ``/coordkit/NAME/members/ID`` = ``address`` under a lease of
    ``ttl`` seconds (ConnectionError when etcd does not answer: nobody joins without
    etcd); a thread renews it every ``ttl / 3``. Through an etcd outage the member
    serves on (nothing here stops it); once etcd answers and the lease has lapsed,
    it joins again under a new one. :meth:`leave` revokes the lease: the key goes at
    once, instead of a TTL later.
    """

    def __init__(
        self,
        endpoint: str | EtcdEndpoint,
        address: str,
        *,
        member_id: str | None = None,
        ttl: int = DEFAULT_TTL,
    ):
        self.endpoint = endpoint if isinstance(endpoint, EtcdEndpoint) else parse_endpoint(endpoint)
        if not (isinstance(ttl, int) and ttl >= 1):
            raise ValueError(f"coordkit: ttl must be a whole number of seconds >= 1, not {ttl!r}")
        self.address = check_address(address)
        self.id = member_id or os.urandom(8).hex()
        self.ttl = ttl
        self.key = members_prefix(self.endpoint) + self.id
        #: How many times the member joined (again, after its lease lapsed in an outage).
        self.joins = 0
        #: Whether the last keepalive was answered (False: etcd unreachable meanwhile).
        self.reachable = True
        self._client = _client(self.endpoint, ttl / 3)
        self._lease_id: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join(self) -> None:
        """Put the key under a new lease and keep it alive (ConnectionError: no etcd)."""
        try:
            self._put()
        except _errors() as exc:
            raise _unreachable_error(self.endpoint, exc) from None
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"coordkit-member-{self.id}", daemon=True
        )
        self._thread.start()

    def leave(self) -> None:
        """Stop renewing and revoke the lease (its key goes at once). Again: nothing."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._lease_id is not None:
            with contextlib.suppress(*_errors()):
                _etcd3gw().Lease(self._lease_id, self._client).revoke()
            self._lease_id = None
        self._client.session.close()

    def __enter__(self) -> Member:
        self.join()
        return self

    def __exit__(self, *exc: object) -> None:
        self.leave()

    def _put(self) -> None:
        lease = self._client.lease(self.ttl)
        self._client.put(self.key, self.address, lease=lease)
        self._lease_id = lease.id
        self.joins += 1
        log.info("coordkit: member %s of %s at %s", self.id, self.endpoint, self.address)

    def _keep_alive(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            assert self._lease_id is not None
            try:
                try:
                    left = _etcd3gw().Lease(self._lease_id, self._client).refresh()
                except _errors() as exc:
                    if not _lease_not_found(exc):
                        raise
                    left = 0
                if left <= 0:  # lapsed while etcd was away: in again
                    log.warning("coordkit: member %s: its lease lapsed; joining again", self.id)
                    self._put()
            except _errors() as exc:
                if self.reachable:
                    log.warning(
                        "coordkit: member %s: etcd unreachable (%s); serving on",
                        self.id,
                        _reason(exc),
                    )
                self.reachable = False
                continue
            self.reachable = True


class View:
    """NAME's live members (ID → address), read from etcd every ``interval`` on a thread;
    through an etcd outage, what was last read."""

    def __init__(self, endpoint: str | EtcdEndpoint, interval: float = VIEW_INTERVAL):
        self.endpoint = endpoint if isinstance(endpoint, EtcdEndpoint) else parse_endpoint(endpoint)
        self.interval = interval
        self._lock = threading.Lock()
        #: The view's members (raises ConnectionError here when etcd is not reachable).
        self._members = read_members(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, name="coordkit-view", daemon=True)
        self._thread.start()

    @property
    def members(self) -> dict[str, str]:
        with self._lock:
            return dict(self._members)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _follow(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                members = read_members(self.endpoint, min(self.interval, READ_TIMEOUT))
            except (ConnectionError, RuntimeError):
                continue  # the last view stands
            with self._lock:
                self._members = members


# -- clients ---------------------------------------------------------------------------


class Spread(Candidates):
    """A client's members, in its rendezvous order: it follows the first that admits it,
    and when that one is gone, the next choice among the members then live.

    ``source`` reads the live members' addresses (etcd's view; None for a static list);
    when it fails, the last view is kept. Each member's epoch is its own: a member is
    refused only when it announces an epoch older than that address did before (a
    stale life of it); moving between members compares nothing.
    """

    def __init__(
        self,
        key: bytes,
        addresses: Sequence[str],
        source: Callable[[], Sequence[str]] | None = None,
    ):
        self.key = key
        self._source = source
        self.addresses = tuple(rendezvous(key, (check_address(a) for a in addresses)))
        if not self.addresses:
            raise ConnectionError("coordkit: the cluster has no live member")
        self.index = 0
        self.epoch: int | None = None
        self.epochs: dict[str, int] = {}
        self._seen = set(self.addresses)
        self._tried: set[str] = set()
        # The address the socket is connected to: the member left, even when it is out
        # of the view now (a CONNECT must not go its way, round-robin, if it is back).
        self._connected = self.addresses[0]

    @property
    def several(self) -> bool:
        return True  # even one member: its loss sends the client looking at the view

    @property
    def others(self) -> tuple[str, ...]:
        return tuple(self._seen - {self.current})

    def admit(self, features: Mapping[Any, Any]) -> str | None:
        epoch = features.get(EPOCH_KEY)
        if type(epoch) is not int:
            return f"the coordinator at {self.current} announces no epoch"
        known = self.epochs.get(self.current)
        if known is not None and epoch < known:
            return f"the member at {self.current} is of epoch {epoch}, older than {known}"
        self.epochs[self.current] = self.epoch = epoch
        self._tried.clear()
        return None

    def refresh(self) -> None:
        """Read the live members again (the last view kept when etcd does not answer)."""
        if self._source is None:
            return
        try:
            found = self._source()
        except (ConnectionError, RuntimeError) as exc:
            log.warning("coordkit client: keeping the last view of the members: %s", exc)
            return
        if found:
            current = self.current
            self.addresses = tuple(rendezvous(self.key, found))
            self._seen.update(self.addresses)
            self.index = self.addresses.index(current) if current in self.addresses else -1

    def move(self, socket: zmq.Socket, discard: bool = False) -> None:
        """Leave the current member for the next choice not tried since one admitted
        the client (after all of them: the first choice again)."""
        linger = socket.getsockopt(zmq.LINGER)
        socket.setsockopt(zmq.LINGER, 0)
        with contextlib.suppress(zmq.ZMQError):
            socket.disconnect(self._connected)
        self._tried.add(self._connected)
        socket.setsockopt(zmq.LINGER, linger)
        if discard:
            with contextlib.suppress(zmq.Again):
                while True:
                    socket.recv_multipart(zmq.NOBLOCK, copy=False)
        untried = [a for a in self.addresses if a not in self._tried]
        if not untried:
            self._tried.clear()
            untried = list(self.addresses)
        self.index = self.addresses.index(untried[0])
        self._connected = self.current
        socket.connect(self._connected)

    @property
    def current(self) -> str:
        return self.addresses[self.index] if self.index >= 0 else ""


def client_candidates(address: str | Sequence[str], key: bytes) -> Spread:
    """The :class:`Spread` of ``address``: an ``etcd://`` NAME's live members (read now,
    and again at each move), or a static list of coordinator addresses."""
    if isinstance(address, str):
        endpoint = parse_endpoint(address)
        return Spread(key, list(read_members(endpoint).values()), _source(endpoint))
    return Spread(key, list(address))


def _source(endpoint: EtcdEndpoint) -> Callable[[], list[str]]:
    return lambda: list(read_members(endpoint).values())


# -- engines ---------------------------------------------------------------------------


class SharedLinks:
    """An engine rank's links to every member: one :class:`Engine` (one DEALER) per
    member, added and dropped as the view changes. A request is answered on the link it
    came in on (by its id at the engine, below). A declared capacity is split among the
    members known when a link registers (each at least 1).

    The ids its requests have at the engine are the members' server ids, but where two
    members' ids meet: a member lost whose requests were handed over, back and sending
    one of them again (its clients moved on; the member they moved to holds the
    request under that id). That one gets an id of the engine's own, and its replies
    and aborts are translated on the way.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        make: Callable[[str, int], Link],
        capacity: int,
    ):
        self._make = make
        self._capacity = capacity
        self._view: View | None = None
        if isinstance(address, str):
            self._view = View(address)
            addresses = list(self._view.members.values())
        else:
            addresses = [check_address(a) for a in address]
        self._links: dict[str, Link] = {}
        self._origin: dict[int, tuple[Link, int]] = {}  # engine's id -> link, member's id
        self._ids: dict[Link, dict[int, int]] = {}  # link -> member's id -> engine's id
        self._next_own = _OWN_IDS
        self._lost_at: dict[str, float] = {}  # links lost, since when
        self._sync(addresses)

    @property
    def links(self) -> dict[str, Link]:
        """The member addresses linked to, and each link's Engine."""
        return dict(self._links)

    def _share(self, members: int) -> int:
        return max(self._capacity // max(members, 1), 1) if self._capacity else 0

    def _sync(self, addresses: Iterable[str]) -> None:
        wanted = set(addresses)
        for address in set(self._links) - wanted:
            link = self._links.pop(address)
            if link.pending:
                # It still holds requests: kept until its member is back or they end.
                self._links[address] = link
                continue
            link.close()
            self._ids.pop(link, None)
        for address in sorted(wanted - set(self._links)):
            self._links[address] = self._make(address, self._share(len(wanted)))

    def poll(self, timeout: float) -> list[Event]:
        members = None
        if self._view is not None:
            members = set(self._view.members.values())
            self._hand_over(members)
            self._sync(members)
        else:
            self._hand_over(None)
        deadline = time.monotonic() + timeout
        poller = zmq.Poller()
        for link in self._links.values():
            poller.register(link._socket, zmq.POLLIN)
        events: list[Event] = []
        while True:
            # Every link polled each time: its heartbeats and its connection's watch.
            for link in list(self._links.values()):
                for event in link.poll(0):
                    arrived = self._arrived(link, event)
                    if arrived is not None:
                        events.append(arrived)
            left = deadline - time.monotonic()
            if events or left <= 0:
                return events
            poller.poll(round(min(left, _LINK_WATCH) * 1000))

    def _arrived(self, link: Link, event: Event) -> Event | None:
        """``event`` from ``link`` under the engine's id of its request (None: an abort
        of nothing this member has here)."""
        if isinstance(event, Request):
            rid = event.server_rid
            owner = self._origin.get(rid)
            if owner is not None and owner[0] is not link:
                event = dataclasses.replace(event, server_rid=self._next_own)
                self._next_own += 1
            self._ids.setdefault(link, {})[rid] = event.server_rid
            self._origin[event.server_rid] = (link, rid)
        elif isinstance(event, Abort):
            aborted = self._ids.get(link, {}).get(event.server_rid)
            if aborted is None:
                return None
            if aborted != event.server_rid:
                event = Abort(aborted)
        return event

    def _hand_over(self, members: set[str] | None) -> None:
        """A member lost (its link's connection ended, and it left the view, or a
        static list's stayed lost HAND_OVER_AFTER): what its link holds for rebuild
        clients goes to each client's next choice, the first of its rendezvous among
        the links registered, in a HELD there (that member opens its window again, and
        adopts them for the client's REJOIN); their replies go there from now on."""
        now = time.monotonic()
        for address, lost in list(self._links.items()):
            if lost.connected:
                self._lost_at.pop(address, None)
                continue
            since = self._lost_at.setdefault(address, now)
            gone = address not in members if members is not None else now - since >= HAND_OVER_AFTER
            held = lost._rebuild
            if not gone or held is None or not held.requests:
                continue
            others = {
                a: link for a, link in self._links.items() if a != address and link.registered
            }
            if not others:
                continue  # nobody to hand them to yet
            moved: dict[str, list[list[Any]]] = {}
            for rid, kept in list(held.requests.items()):
                if kept.client_id is None:
                    continue
                target = rendezvous(kept.client_id, others)[0]
                destination = others[target]._rebuild
                if destination is None:
                    continue
                destination.requests[rid] = held.requests.pop(rid)
                own = self._ids.get(lost, {}).pop(rid, rid)
                self._origin[own] = (others[target], rid)
                self._ids.setdefault(others[target], {})[rid] = own
                entry = [rid, kept.client_rid, kept.client_id, kept.partials, kept.final]
                moved.setdefault(target, []).append(entry)
            for target, entries in moved.items():
                link = others[target]
                link._socket.send_multipart(protocol.HELD.pack(entries, b""))
                link.pending += len(entries)
                lost.pending = max(lost.pending - len(entries), 0)
                log.warning(
                    "coordkit engine: the member at %s is lost: %d requests handed to %s",
                    address,
                    len(entries),
                    target,
                )

    def reply(self, finished: Iterable[Any], partial: bool = False) -> None:
        by_link: dict[int, tuple[Link, list[Any]]] = {}
        for entry in finished:
            own = entry[0]
            origin = self._origin.get(own) if partial else self._origin.pop(own, None)
            if origin is None:
                log.warning("coordkit engine: a reply for %d, not a request here", own)
                continue
            link, rid = origin
            if not partial:
                self._ids.get(link, {}).pop(rid, None)
            if rid != own:
                entry = (rid, *entry[1:])
            by_link.setdefault(id(link), (link, []))[1].append(entry)
        for link, entries in by_link.values():
            (link.reply_partial if partial else link.reply)(entries)

    @property
    def pending(self) -> int:
        return sum(link.pending for link in self._links.values())

    @property
    def registered(self) -> bool:
        """Whether every member's link is acknowledged."""
        return bool(self._links) and all(link.registered for link in self._links.values())

    def wait_registered(self, timeout: float) -> bool:
        """Until every member's link is acknowledged (what comes meanwhile is kept)."""
        deadline = time.monotonic() + timeout
        for link in self._links.values():
            if not link.wait_registered(max(deadline - time.monotonic(), 0.0)):
                return False
        return bool(self._links)

    def disconnect(self) -> None:
        for link in self._links.values():
            link.disconnect()

    def close(self) -> None:
        if self._view is not None:
            self._view.close()
        for link in self._links.values():
            link.close()
        self._links.clear()
