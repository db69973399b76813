"""The engine side: an engine rank's endpoint and the events it hands out.

:class:`Engine` is what an inference engine's step loop talks to: it
registers with the coordinator, hands out what arrived as small event
objects, and sends each step's finished requests as one batched reply::

    with Engine("ipc:///tmp/coordkit.sock", rank=0) as engine:
        while True:
            for event in engine.poll(timeout=0.01):
                ...  # Request, Abort, ReleaseKV or Control
            engine.reply([(rid, body) for rid, body in finished_this_step])

It is synchronous (engine step loops are) and not thread-safe: use one
Engine from one thread. :class:`coordkit.tools.fake_engine.FakeEngine` is a
complete engine built on it, for demos and tests.

Under it runs a *core* -- the Cython one (:mod:`coordkit._engine_c`), which
receives, parses and builds the replies in C, or its pure-Python twin
(:mod:`coordkit._engine_py`), chosen as the coordinator's is; both hand out
the same events and put the same frames on the wire. After registering, an
Engine says what it is with ENGINE_HELLO: ``[94, {"coordkit": 1, "ack": 1,
"batch": 1}]``, asking for batches, or ``[94, {"coordkit": 1, "ack": 1}]``
with ``batch=False``. A
coordinator that grants batches may then send its SUBMITs as
ENGINE_SUBMIT_BATCH messages, which poll() hands out as one Request per
entry. Replies are batched either way. An ERROR the coordinator sends back
(a reply entry it could not deliver) is logged.

``"ack": 1`` says that the engine reads ENGINE_ACK, with which coordkit's
coordinator answers it, ``[97, {"batch": 1}]`` (what it granted):
:attr:`Engine.registered` says whether the current connection was
acknowledged, and :meth:`Engine.wait_registered` waits for it.

In disaggregated prefill/decode (docs/pd.md) an engine says its role and its
capacity in the hello (``Engine(role="prefill", capacity=8)``). A prefill engine
gets prefill hops (:meth:`Request.prefill_hop <coordkit.engine.Request.prefill_hop>`),
answers each with :meth:`Engine.handoff` (its KV's metadata and pinned block ids,
which the coordinator hands a decode engine), and unpins on :class:`ReleaseKV`
(pushing on :class:`SendKV` first when its decode pushes); a decode engine gets the
handoff as a Request whose ``kv_meta`` is set, says :meth:`Engine.kv_read_done`
once it read the blocks (:meth:`Engine.kv_transfer_ready` first when the prefill
pushes to it), and generates as for any request.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from . import protocol
from ._checks import check_capacity
from ._events import Abort, Control, Event, ReleaseKV, Request, SendKV
from ._held import DEFAULT_HELD_HASHES, Held
from ._implementation import load_implementation, selected
from ._liveness import (
    ACK_WINDOW,
    CANDIDATE_WINDOW,
    DEFAULT_COORDINATOR_TIMEOUT,
    Candidates,
    ConnectionWatch,
    Following,
    prepare,
)
from .cluster import SharedLinks, is_cluster
from .curve import KeySource, ServerKey
from .kvpublish import KVPublisher
from .protocol import (
    ACK_FEATURE,
    BASE_KEY,
    BATCH_FEATURE,
    CAPACITY_KEY,
    COORDKIT_HELLO,
    DOMAIN_KEY,
    KV_EVENTS_KEY,
    KV_EVENTS_REPLAY_KEY,
    REBUILD_FEATURE,
    ROLE_KEY,
    ROLE_NAMES,
    SESSION_KEY,
    TRANSFER_KEY,
)

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Engine", "Request", "Abort", "ReleaseKV", "SendKV", "Control", "Event"]

log = logging.getLogger(__name__)

_CLOSE_LINGER_MS = 1000  # lets the last replies and DISCONNECT leave on close()
#: How often poll() reads the connection's events: bounds how late a re-registration is.
_WATCH_INTERVAL = 0.1
#: Seconds after a registration without an ENGINE_ACK before poll() logs a warning.
REGISTRATION_WARNING = 5.0


#: A reply entry: (server_rid, body) or (server_rid, body, needs_detokenize).
#: A body that is not bytes-like is msgpack-packed.
ReplyEntry = tuple[int, Any] | tuple[int, Any, bool]
#: A handoff: (server_rid, kv_meta, src_block_ids), the block ids a list of ints or
#: their msgpack array as bytes.
HandoffEntry = tuple[int, Any, Any]
_BYTES_LIKE = (bytes, bytearray, memoryview, zmq.Frame)


class Engine(Following):
    """One engine rank's connection to the coordinator (a DEALER with an identity).

    ``pending`` counts requests received and not yet answered with a final
    reply. ``capacity`` (an int, 0 by default: none) is how many requests it runs
    at once: said in its ENGINE_HELLO, so that a coordinator that queues sends it
    no more than that and keeps the rest waiting, fairly, until it has room
    (docs/queueing.md). With ``heartbeat_interval`` set, :meth:`poll` sends
    HEARTBEAT ``[91, pending, capacity]`` that often (the first at once), so
    the coordinator can declare the engine gone when they stop. After the
    registration it sends ENGINE_HELLO, asking for batched SUBMITs unless
    ``batch`` is False; ``implementation`` (``"c"`` or ``"py"``) picks the
    core, by default the one chosen at import.

    ``registered`` is whether a coordinator acknowledged the engine: coordkit's
    answers each ENGINE_HELLO with ENGINE_ACK once the engine is in its pool
    (``granted`` is what it granted, e.g. ``{"batch": 1}``). It is False until
    then, False again from a lost connection until the new registration is
    acknowledged, and always False against a coordinator that does not send
    ENGINE_ACK (Megatron's). :meth:`poll` logs a warning, naming the address,
    when no acknowledgement came within ``REGISTRATION_WARNING`` seconds of
    a registration; :meth:`wait_registered` waits for one.

    ``hello=False`` sends no ENGINE_HELLO: the engine registers as a
    Megatron engine does (the empty frame only), for a coordinator other
    than coordkit's that speaks the multipart layout and may not survive a
    header it does not know (Megatron-Core 0.19's own coordinator raises on
    one). It then gets no batches, no ERRORs and no ENGINE_ACK: it cannot
    know that it was registered, ``registered`` stays False and
    :meth:`wait_registered` raises. Not for coordkit's
    coordinator in the megatron-core dialect, which would take the engine
    for a 0.19 one and send it single frames.

    ``coordinator_timeout`` (seconds; None: none) sets ZMTP heartbeats on the
    socket, so that a coordinator silent that long is deemed lost, as one
    whose connection closed is at once. libzmq reconnects by itself; on the
    new connection :meth:`poll` registers the engine again (the empty frame
    and ENGINE_HELLO, same identity), within 0.1 s of the handshake or at the
    next poll. ``connected`` is False from a lost connection until then. With CURVE,
    ``curve_server_key`` (the coordinator's public key: its ``.key`` file or
    z85 bytes) and ``curve_keys`` (the engine's own pair: its
    ``.key_secret`` file or ``(public, secret)`` z85 bytes) are given both.

    ``rebuild`` (with ``hello``) makes it take part in the rebuild after a
    coordinator's loss: it keeps, for each request a rebuild client sent, who
    sent it and the replies the coordinator has not acknowledged (HANDLED), and
    on each registration reports what it holds (HELD) and sends again what is
    asked (REPLAY); its requests are then never run twice (docs/failover.md).
    It also keeps the block hashes of the last ``held_hashes`` it was sent
    (the prefix policy forwards each request's), and reports them in HELD, so
    that a new coordinator's prefix policy knows what this rank caches.

    ``address`` may name several coordinators, split by commas
    (``"tcp://a:5555,tcp://b:5555"``: the standbys of one ``--ha`` NAME); it
    then follows one at a time (``address`` is the one followed now), and
    moves to the next when the connection ends, when none is made within
    0.5 s, or when one is not acknowledged within 2 s. It follows only a
    coordinator whose ENGINE_ACK announces an epoch no older than the highest
    it has seen (:attr:`coordinator_epoch`),
    and hands out nothing a coordinator sent before that ENGINE_ACK admitted
    it: so it never acts for a stale leader. This needs the rebuild (the
    epoch comes with it): ValueError with ``rebuild=False`` or ``hello=False``.

    ``role`` (``"prefill"``, ``"decode"`` or ``"both"``; None: aggregated, whole
    requests only) takes part in disaggregated prefill/decode; it needs the hello and
    a ``capacity`` (requests held at most, a prefill's pinned handoffs counted), and
    may name the transfer ``domain`` the engine moves KV within (a decode hop goes to a
    decode of its prefill's domain) and ``transfer``, what a prefill is sent of this
    decode in SEND_KV when it pushes. :attr:`role_granted` says whether the
    coordinator took the role (one that does not run P/D sends whole requests).

    ``kv_events`` announces, in the hello, where the engine's KV-cache events are
    published in vLLM's wire format (a vLLM or SGLang engine's own PUB endpoint, with
    ``kv_events_replay`` its replay ROUTER), so that a coordinator reading events
    prices this rank by them (docs/routing.md); or it is a
    :class:`coordkit.kvpublish.KVPublisher` the adapter publishes through:
    :meth:`kv_stored`, :meth:`kv_removed` and :meth:`kv_cleared` (the engine does not
    close it).
    """

    def __init__(
        self,
        address: str,
        rank: int = 0,
        identity: bytes | str | None = None,
        *,
        heartbeat_interval: float | None = None,
        capacity: int = 0,
        context: zmq.Context | None = None,
        batch: bool = True,
        implementation: str | None = None,
        coordinator_timeout: float | None = DEFAULT_COORDINATOR_TIMEOUT,
        curve_server_key: ServerKey | None = None,
        curve_keys: KeySource | None = None,
        hello: bool = True,
        rebuild: bool = True,
        held_hashes: int = DEFAULT_HELD_HASHES,
        role: str | None = None,
        domain: str = "",
        transfer: Any = None,
        kv_events: str | KVPublisher | None = None,
        kv_events_replay: str | None = None,
    ):
        self._kv_publisher = kv_events if isinstance(kv_events, KVPublisher) else None
        #: Where its KV-cache events are published, said in its hello (None: nowhere).
        self.kv_events = kv_events.endpoint if isinstance(kv_events, KVPublisher) else kv_events
        self.kv_events_replay = (
            kv_events.replay_endpoint if isinstance(kv_events, KVPublisher) else kv_events_replay
        )
        if role is not None:
            if role not in ROLE_NAMES:
                raise ValueError(
                    f"role must be one of {', '.join(ROLE_NAMES)} or None, not {role!r}"
                )
            if not hello:
                raise ValueError("coordkit: an Engine's role is said in its hello: hello=False")
            if capacity < 1:
                raise ValueError(
                    f"a {role} engine declares its capacity (at least 1), not {capacity}"
                )
        self._links: SharedLinks | None = None
        if is_cluster(address):
            # One Engine per member, each its own socket and core (docs/scaling.md).
            if role is not None:
                raise ValueError("coordkit: an engine shared by a cluster runs no P/D role")
            named = identity or f"engine-{rank}"
            self.rank, self.capacity, self.role, self.hello = rank, capacity, role, hello
            self.identity = named.encode() if isinstance(named, str) else named
            self._shared_impl = (
                load_implementation(implementation) if implementation else selected()
            ).name

            def link(member: str, share: int) -> Engine:
                return Engine(
                    member,
                    rank,
                    self.identity,
                    heartbeat_interval=heartbeat_interval,
                    capacity=share,
                    context=context,
                    batch=batch,
                    implementation=implementation,
                    coordinator_timeout=coordinator_timeout,
                    curve_server_key=curve_server_key,
                    curve_keys=curve_keys,
                    hello=hello,
                    rebuild=rebuild,
                    held_hashes=held_hashes,
                    # Every member's hello names the publisher: one prefix view for all.
                    kv_events=self.kv_events,
                    kv_events_replay=self.kv_events_replay,
                )

            self._rebuild: Held | None = None
            self._registered = False
            self.granted: dict[Any, Any] = {}
            self._links = SharedLinks(address, link, capacity)
            return
        self._candidates = Candidates(address)
        if self._candidates.several and not (rebuild and hello):
            raise ValueError(
                "coordkit: an Engine given several coordinator addresses needs the rebuild "
                "(rebuild=True, hello=True): the epoch that chooses among them comes with it"
            )
        if held_hashes < 0:
            raise ValueError(f"held_hashes must be at least 0, not {held_hashes}")
        check_capacity(capacity)
        impl = load_implementation(implementation) if implementation else selected()
        if identity is None:
            identity = f"engine-{rank}"
        self.rank = rank
        self.identity = identity.encode() if isinstance(identity, str) else identity
        self.heartbeat_interval = heartbeat_interval
        self.capacity = capacity
        self.batch = batch and hello
        self.hello = hello
        self.role = role
        self.domain = domain
        self.transfer = transfer
        # Said in every hello: a registration with another token is another process.
        self._session = secrets.randbits(63) or 1
        self._next_heartbeat = time.monotonic() if heartbeat_interval else math.inf
        # An own context, so close() can wait (up to the linger) for the last replies to leave.
        self._own_context = context is None
        self._context = context or zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, self.identity)
        # No high-water marks: the coordinator's max_inflight bounds what can queue here.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        try:
            prepare(self._socket, coordinator_timeout, curve_server_key, curve_keys)
        except BaseException:
            self._socket.close(linger=0)
            if self._own_context:
                self._context.term()
            raise
        self._watch = ConnectionWatch(self._socket)  # before connect(): no event missed
        self._next_watch = time.monotonic() + _WATCH_INTERVAL
        self.connected = True  # the registration below is queued for the first connection
        self._registered = False
        #: What the coordinator granted in its last ENGINE_ACK (``{"batch": 1}``), or {}.
        self.granted = {}
        self._held: list[Event] = []  # received by wait_registered(), for the next poll()
        self._rebuild = Held(self._socket, held_hashes) if rebuild and hello else None
        # Several addresses: what came from a coordinator not (yet) admitted, the reason
        # its ENGINE_ACK was refused, when to give up on it.
        self._unadmitted: list[Event] = []
        self._refused: str | None = None
        self._give_up_at = time.monotonic() + CANDIDATE_WINDOW
        self._socket.connect(self._candidates.current)
        self._register()
        self._core = impl.engine.EngineCore(self._socket, self._acknowledged, self._rebuild)

    @property
    def implementation(self) -> str:
        """``"c"`` or ``"py"``: the core this engine runs on."""
        if self._links is not None:
            return self._shared_impl
        return str(self._core.implementation)

    @property
    def coordinator_epoch(self) -> int | None:
        """The epoch the coordinator announced when it granted the rebuild, or None."""
        return None if self._rebuild is None else self._rebuild.epoch

    @property
    def pending(self) -> int:
        """Requests received and not yet answered with a final reply."""
        if self._links is not None:
            return self._links.pending
        return int(self._core.pending)

    @pending.setter
    def pending(self, value: int) -> None:
        if self._links is None:  # a shared engine's links count their own
            self._core.pending = value

    @property
    def role_granted(self) -> bool:
        """Whether the coordinator took this engine's P/D role on the current connection
        (its ENGINE_ACK named it; see :class:`Engine`)."""
        return (
            self._registered and self.role is not None and self.granted.get(ROLE_KEY) == self.role
        )

    @property
    def registered(self) -> bool:
        """Whether a coordinator acknowledged this engine on the current connection
        (ENGINE_ACK; see :class:`Engine`); shared by a cluster: every member's link."""
        if self._links is not None:
            return self._links.registered
        return self._registered

    def poll(self, timeout: float = 0.0) -> list[Event]:
        """Wait up to ``timeout`` seconds for messages and return their events.

        Returns as soon as something arrived, with everything that is queued
        (a step's worth: at most 4096 messages); an empty list on timeout.
        Sends a HEARTBEAT whenever one is due.
        """
        if self._links is not None:
            return self._links.poll(timeout)
        if self._held:
            events, self._held = self._held, []
            return events
        return self._poll(timeout)

    def wait_registered(self, timeout: float = 10.0) -> bool:
        """Poll until a coordinator acknowledged the engine; whether one did within
        ``timeout`` seconds (True at once when it already is).

        What arrives meanwhile (a request may come before the acknowledgement)
        is kept and handed out by the next :meth:`poll`. RuntimeError with
        ``hello=False``, which no coordinator acknowledges.
        """
        if not self.hello:
            raise RuntimeError(
                "coordkit: an Engine with hello=False is never acknowledged: "
                "nothing can tell that it was registered"
            )
        deadline = time.monotonic() + timeout
        if self._links is not None:
            return self._links.wait_registered(timeout)
        while not self._registered:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._held += self._poll(left)
        return True

    def _poll(self, timeout: float) -> list[Event]:
        deadline = time.monotonic() + timeout
        registered = self._registered
        while True:
            now = time.monotonic()
            if now >= self._next_heartbeat:
                self._send_heartbeat(now)
            if now >= self._next_watch:
                self._check_connection(now)
            wait = min(deadline, self._next_heartbeat, self._next_watch) - now
            events: list[Event] = self._core.poll(math.ceil(max(wait, 0.0) * 1000))
            if self._candidates.several:
                events = self._screened(events)
            if events or self._registered != registered or time.monotonic() >= deadline:
                return events

    def reply(self, finished: Iterable[ReplyEntry]) -> None:
        """Send the final replies of one step as ONE batched ENGINE_REPLY.

        A body that is not bytes-like is msgpack-packed; a bytes-like one is
        sent as it is (copied when small; above 8 KiB, held until sent). Shared by a
        cluster: each on the link its request came in on.
        """
        if self._links is not None:
            self._links.reply(finished)
            return
        self._core.reply(finished)

    def reply_partial(self, partial: Iterable[tuple[int, Any]]) -> None:
        """Send the partial replies of one step as ONE batched ENGINE_REPLY_PARTIAL."""
        if self._links is not None:
            self._links.reply(partial, partial=True)
            return
        self._core.reply_partial(partial)

    def handoff(self, handoffs: Iterable[HandoffEntry]) -> None:
        """Send the prefill hops this step ended as ONE HANDOFF: per request its
        ``kv_meta`` (any msgpack: what a decode engine needs to read the KV) and the
        ids of the blocks it pinned for it, until a :class:`ReleaseKV` names it. The
        coordinator hands both to a decode engine; the request is no longer pending
        here."""
        entries, blocks = [], []
        for rid, kv_meta, src_block_ids in handoffs:
            entries.append((rid, kv_meta))
            is_frame = isinstance(src_block_ids, _BYTES_LIKE)
            blocks.append(src_block_ids if is_frame else protocol.packb(list(src_block_ids)))
        if not entries:
            return
        self._socket.send_multipart(protocol.HANDOFF.pack(entries, blocks), copy=False)
        self.pending = max(self.pending - len(entries), 0)
        if self._rebuild is not None:
            self._rebuild.handed_off([rid for rid, _ in entries])

    def kv_transfer_ready(self, server_rid: int, cached_prefix_blocks: int = 0) -> None:
        """A decode engine whose prefill pushes: its receives for the request are
        posted, and its leading ``cached_prefix_blocks`` are cached here already
        (KV_TRANSFER_READY; the coordinator has the prefill push the rest)."""
        self._socket.send_multipart(
            protocol.KV_TRANSFER_READY.pack(server_rid, cached_prefix_blocks)
        )

    def kv_read_done(self, *server_rids: int) -> None:
        """A decode engine read these requests' KV: their prefills may unpin it, in ONE
        KV_READ_DONE (the reads of one step together)."""
        if not server_rids:
            return
        for rid in server_rids:
            protocol.KV_READ_DONE.fields[0].check("KV_READ_DONE", rid)
        self._socket.send(protocol.rids_message(protocol.Header.KV_READ_DONE, *server_rids))

    def request_error(self, server_rid: int, reason: str, source_safe: bool = True) -> None:
        """A hop failed here (REQUEST_ERROR): a handoff that could not be imported, a
        transfer that failed; ``source_safe`` False while a transfer may still read the
        prefill's blocks. The coordinator hands the request to another engine, or ends
        it; the request is no longer pending here."""
        self._socket.send_multipart(protocol.REQUEST_ERROR.pack(server_rid, reason, source_safe))
        self.pending = max(self.pending - 1, 0)

    def disconnect(self) -> None:
        """Tell the coordinator this rank takes no new work (send finals for what it holds)."""
        if self._links is not None:
            self._links.disconnect()
            return
        self._socket.send_multipart(protocol.DISCONNECT.pack())

    def _publisher(self) -> KVPublisher:
        if self._kv_publisher is None:
            raise RuntimeError("coordkit: this Engine publishes no events (kv_events=KVPublisher)")
        return self._kv_publisher

    def kv_stored(
        self, hashes: Sequence[int | bytes], parent: int | bytes | None, tokens: Sequence[int]
    ) -> None:
        """Blocks the engine cached: their hashes (its own), the block before the first
        (None: they start a prompt) and their tokens (KVPublisher.stored)."""
        self._publisher().stored(hashes, parent, tokens)

    def kv_removed(self, hashes: Sequence[int | bytes]) -> None:
        """Blocks the engine evicted, by the hashes they were stored under."""
        self._publisher().removed(hashes)

    def kv_cleared(self) -> None:
        """The engine dropped every cached block."""
        self._publisher().cleared()

    def close(self) -> None:
        if self._links is not None:
            self._links.close()
            return
        self._watch.close()
        self._socket.close(linger=_CLOSE_LINGER_MS)
        if self._own_context:
            self._context.term()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _register(self) -> None:
        self._socket.send(b"")  # registration
        self._warn_at = time.monotonic() + REGISTRATION_WARNING
        if not self.hello:
            return
        # A coordkit engine: multipart in every dialect; read ENGINE_ACK; batches when it asks.
        hello: dict[str, Any] = {**COORDKIT_HELLO, ACK_FEATURE: 1, SESSION_KEY: self._session}
        if self.batch:
            hello[BATCH_FEATURE] = 1
        if self.capacity:
            hello[CAPACITY_KEY] = self.capacity
        if self.role is not None:
            hello[ROLE_KEY] = self.role
            if self.domain:
                hello[DOMAIN_KEY] = self.domain
            if self.transfer is not None:
                hello[TRANSFER_KEY] = self.transfer
        if self.kv_events is not None:
            hello[KV_EVENTS_KEY] = self.kv_events
            if self.kv_events_replay is not None:
                hello[KV_EVENTS_REPLAY_KEY] = self.kv_events_replay
        if self._rebuild is not None:
            # Until the answer says the rebuild is granted, requests carry no trailer.
            self._rebuild.granted = False
            hello.update({REBUILD_FEATURE: 1, BASE_KEY: self._rebuild.next_number})
        self._socket.send_multipart(protocol.ENGINE_HELLO.pack(hello))

    def _acknowledged(self, granted: dict[Any, Any]) -> None:
        """An ENGINE_ACK (from the engine core)."""
        if not self.connected:
            return  # from a connection that ended since: not this registration's
        if self._candidates.several and not self._registered:
            self._refused = self._candidates.admit(granted)
            if self._refused is not None:
                return  # poll() moves on (not from within the core's drain)
        if not self._registered:
            log.info(
                "coordkit engine %s: registered at %s (granted %s)",
                self.rank,
                self.address,
                granted or "nothing more",
            )
            if self.role is not None and granted.get(ROLE_KEY) != self.role:
                log.warning(
                    "coordkit engine %s: the coordinator at %s did not take the role %r: "
                    "it does not run disaggregated prefill/decode, and sends whole requests",
                    self.rank,
                    self.address,
                    self.role,
                )
        self._registered = True
        self.granted = granted
        if self._rebuild is not None:
            self._rebuild.acknowledged(granted)

    def _check_connection(self, now: float) -> None:
        """The connection ended: note it; a new one: register on it; no acknowledgement
        for a while: say so, once per registration."""
        self._next_watch = now + _WATCH_INTERVAL
        several = self._candidates.several
        for event in self._watch.events(self._candidates.others):
            if event == zmq.EVENT_DISCONNECTED and self.connected:
                self.connected = False
                self._registered = False
                self._warn_at = now + REGISTRATION_WARNING
                log.warning(
                    "coordkit engine %s: lost the coordinator at %s", self.rank, self.address
                )
                if several:
                    self._move(now)
                    break  # the rest was the connection left's
            elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED and several and not self._registered:
                self._give_up_at = now + ACK_WINDOW  # connected: now its ENGINE_ACK
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED and not self.connected:
                self.connected = True
                # What was sent meanwhile went out first: the same coordinator takes it,
                # a restarted one drops it (from a peer not registered: not_connected).
                self._register()
                log.info("coordkit engine %s: registering again at %s", self.rank, self.address)
        if several and not self._registered and now >= self._give_up_at:
            self._move(now)
        if self.hello and not self._registered and now >= self._warn_at:
            self._warn_at = math.inf
            log.warning(
                "coordkit engine %s: not registered at %s after %g s: is a coordkit "
                "coordinator running there?",
                self.rank,
                self.address,
                REGISTRATION_WARNING,
            )

    def _screened(self, events: list[Event]) -> list[Event]:
        """Several addresses: what a coordinator sent is handed out once its ENGINE_ACK
        admitted it; a refused one's is dropped, and the next coordinator is tried."""
        if self._refused is not None:
            log.warning("coordkit engine %s: not following it: %s", self.rank, self._refused)
            self._unadmitted += events
            self._move(time.monotonic(), discard=True)
            return []
        if not self._registered:
            self._unadmitted += events
            return []
        if self._unadmitted:
            events, self._unadmitted = self._unadmitted + events, []
        return events

    def _move(self, now: float, discard: bool = False) -> None:
        """To the next coordinator address; it registers once connected (see poll())."""
        self.connected = False
        self._registered = False
        self._refused = None
        # Not handed out: not pending either.
        self.pending -= sum(isinstance(event, Request) for event in self._unadmitted)
        self._unadmitted = []
        self._candidates.move(self._socket, discard)
        self._give_up_at = now + CANDIDATE_WINDOW

    def _send_heartbeat(self, now: float) -> None:
        self._socket.send_multipart(protocol.HEARTBEAT.pack(self.pending, self.capacity))
        self._next_heartbeat = now + (self.heartbeat_interval or math.inf)
