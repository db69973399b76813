"""Leader election through an etcd lease: one candidate serves NAME, the others wait.

Candidates for a NAME race to create its key, ``coordkit/leader/NAME``, in one
transaction (create only if absent), bound to a lease of ``ttl`` seconds. The
winner holds a :class:`Term`: a keepalive thread renews the lease every
``ttl / 3`` and reads the key back; the others watch the key and race again
when it is deleted (a resignation, or the lease expired). A term's
:attr:`~Term.epoch` is the key's ``create_revision``: etcd's revision grows by
one at every write of the whole store, and a new term's key can only be
created after the old one's deletion, itself a later write, so epochs
increase strictly from term to term and are never reused.

"Am I still the leader" is :meth:`Term.valid`, a comparison with the
monotonic clock and no request: a term is valid until ``ttl`` after the last
keepalive that etcd answered was *sent*, never beyond the moment etcd lets
the lease expire. A leader frozen (SIGSTOP, a stall in swap) past that finds its
term invalid the moment it runs again, before it can act on a message; its
keepalive thread then sets :attr:`Term.lost` without sending anything.

The etcd client is etcd3gw (the ``ha`` extra), imported when an
:class:`Election` is made; it speaks etcd's v3 JSON gateway (etcd 3.4 or later).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import etcd3gw
    from typing_extensions import Self

log = logging.getLogger(__name__)

#: The line a missing ``ha`` extra gives.
MISSING_EXTRA = "coordkit: --ha needs the ha extra: pip install 'coordkit[ha]'"
DEFAULT_TTL = 3
#: Where NAME's key lives in etcd (``etcdctl get coordkit/leader/NAME`` shows the leader).
KEY_PREFIX = "coordkit/leader/"

_NAME = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*")
_HOST = re.compile(r"\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+")
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\"()]+)")


class EtcdEndpoint(NamedTuple):
    """An ``etcd://HOST:PORT/NAME`` address: where etcd answers, and the NAME elected."""

    host: str
    port: int
    name: str

    @property
    def key(self) -> str:
        return KEY_PREFIX + self.name

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"etcd://{host}:{self.port}/{self.name}"


def parse_endpoint(text: str) -> EtcdEndpoint:
    """``etcd://HOST:PORT/NAME`` → its parts; a ValueError of one line says what is wrong."""

    def malformed(reason: str) -> ValueError:
        return ValueError(f"coordkit: {text!r} is not etcd://HOST:PORT/NAME ({reason})")

    scheme, sep, rest = text.partition("://")
    if scheme != "etcd" or not sep:
        raise malformed("it must start with etcd://")
    authority, _, name = rest.partition("/")
    host, colon, port = authority.rpartition(":")
    if not colon or host.endswith(":") or port.endswith("]"):  # no port, or a bare IPv6
        raise malformed("no port")
    if not _HOST.fullmatch(host):
        raise malformed(f"{host!r} is not a host name or address" if host else "no HOST")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise malformed(f"the port must be a number from 1 to 65535, not {port!r}")
    if not name:
        raise malformed("no NAME after HOST:PORT/")
    if not _NAME.fullmatch(name):
        raise malformed("NAME takes letters, digits, '.', '_' and '-', in parts split by '/'")
    return EtcdEndpoint(host.strip("[]"), int(port), name)


class Leader(NamedTuple):
    """Who holds NAME: the value it published (its bind address) and its term's epoch."""

    value: bytes
    epoch: int


class Election:
    """One candidate for ``endpoint``'s NAME, publishing ``value`` (its address) while it leads.

    ``ttl`` is the lease's, in whole seconds (etcd's unit; etcd raises a TTL
    below its own minimum, 1.5 election timeouts: 2 s by default). Etcd not
    answering for longer than ``ttl`` makes :meth:`campaign` raise
    ConnectionError, and a leader lose its term.
    """

    def __init__(
        self,
        endpoint: str | EtcdEndpoint,
        *,
        ttl: float = DEFAULT_TTL,
        value: bytes | str = b"",
    ):
        self.endpoint = endpoint if isinstance(endpoint, EtcdEndpoint) else parse_endpoint(endpoint)
        if not (isinstance(ttl, int | float) and ttl >= 1 and float(ttl).is_integer()):
            raise ValueError(f"coordkit: ttl must be a whole number of seconds >= 1, not {ttl!r}")
        self.ttl = int(ttl)
        self.value = _bytes(value)
        self._etcd = _etcd3gw()
        self._client = self._connect()

    def _connect(self) -> etcd3gw.Etcd3Client:
        """A client of its own (a requests Session serves one thread); its requests time
        out at ``ttl / 3``, so a keepalive can fail and be tried again within the TTL."""
        host, port, _ = self.endpoint
        return self._etcd.client(host=host, port=port, timeout=self.ttl / 3, api_path="/v3/")

    def campaign(self, timeout: float | None = None) -> Term:
        """Block until this candidate leads NAME (TimeoutError after ``timeout`` seconds)."""
        give_up = math.inf if timeout is None else time.monotonic() + timeout
        failing_since: float | None = None
        errors = (self._etcd.exceptions.Etcd3Exception, OSError)
        while True:
            now = time.monotonic()
            try:
                outcome = self._try_to_lead()
            except errors as exc:
                if _lease_not_found(exc):
                    continue  # our new lease expired before the transaction (a freeze): again
                failing_since = now if failing_since is None else failing_since
                if not _unreachable(exc) or now - failing_since >= self.ttl or now >= give_up:
                    raise self._error(exc) from None
                time.sleep(self.ttl / 10)
                continue
            if isinstance(outcome, Term):
                return outcome
            failing_since = None
            holder, revision = outcome
            if now >= give_up:
                raise TimeoutError(
                    f"coordkit: not elected for {self.endpoint.name} within {timeout:g} s "
                    f"(held by {holder.value!r}, epoch {holder.epoch})"
                )
            try:
                self._wait_for_release(revision, min(give_up - now, self.ttl))
            except self._etcd.exceptions.WatchTimedOut:
                pass
            except errors:  # a watch that broke: the next transaction says whether etcd is there
                time.sleep(self.ttl / 10)

    def leader(self) -> Leader | None:
        """Who leads NAME now (None: nobody), read from etcd."""
        try:
            found = self._client.get(self.endpoint.key, metadata=True)
        except (self._etcd.exceptions.Etcd3Exception, OSError) as exc:
            raise self._error(exc) from None
        for value, kv in found:
            return Leader(value, int(kv["create_revision"]))
        return None

    def close(self) -> None:
        self._client.session.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _error(self, exc: BaseException) -> Exception:
        """One line for what etcd did: not answer (ConnectionError), or refuse."""
        host, port, _ = self.endpoint
        where = f"etcd at {host}:{port}"
        if _unreachable(exc):
            return ConnectionError(f"coordkit: {where} is not reachable: {_reason(exc)}")
        return RuntimeError(f"coordkit: {where}: {_reason(exc)}")

    def _try_to_lead(self) -> Term | tuple[Leader, int]:
        """Create the key under a new lease if it is absent: our Term, or else who holds
        the key and the store's revision that answer was read at."""
        sent = time.monotonic()  # etcd expires the lease no sooner than ttl after this
        lease = self._client.lease(self.ttl)
        key = _b64(self.endpoint.key.encode())
        put = {"key": key, "value": _b64(self.value), "lease": lease.id}
        response = self._client.transaction(
            {
                "compare": [
                    {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": 0}
                ],
                "success": [{"request_put": put}],
                "failure": [{"request_range": {"key": key}}],
            }
        )
        # The put's revision: the key's create_revision.
        revision = int(response["header"]["revision"])
        if response.get("succeeded"):
            return Term(self, lease.id, revision, sent + self.ttl)
        with contextlib.suppress(self._etcd.exceptions.Etcd3Exception, OSError):
            lease.revoke()  # tidy: unused, it would expire by itself
        # A transaction is atomic: the key the compare found is the one read.
        kv = response["responses"][0]["response_range"]["kvs"][0]
        return Leader(_unb64(kv.get("value", "")), int(kv["create_revision"])), revision

    def _wait_for_release(self, revision: int, timeout: float) -> None:
        """Until the key is deleted after ``revision``, or WatchTimedOut after ``timeout``."""
        # Replayed from revision + 1: a deletion between the transaction and the watch counts.
        self._client.watch_once(
            self.endpoint.key, timeout=timeout, start_revision=revision + 1, filters=["NOPUT"]
        )


class Term:
    """One leadership of an :class:`Election`, from its campaign to its loss or resignation.

    ``epoch`` increases strictly from term to term. ``lost`` is set once the
    term is over (``reason`` says why); :meth:`on_lost` callbacks run then,
    on the keepalive thread (or the resigning one).
    """

    def __init__(self, election: Election, lease_id: int, epoch: int, deadline: float):
        self.election = election
        self.epoch = epoch
        self.lease_id = lease_id
        self.lost = threading.Event()
        self.reason: str | None = None
        self._deadline = deadline
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._client = election._connect()
        self._thread = threading.Thread(
            target=self._keep_alive, name=f"coordkit-lease-{epoch}", daemon=True
        )
        self._thread.start()

    @property
    def deadline(self) -> float:
        """The ``time.monotonic()`` this term ends at unless renewed before; -inf once lost."""
        return self._deadline

    def valid(self, now: float | None = None) -> bool:
        """Whether this candidate may still act as the leader: a comparison, no request.

        ``now`` is a ``time.monotonic()`` the caller already read (a loop's, say).
        """
        return (time.monotonic() if now is None else now) < self._deadline

    def on_lost(self, callback: Callable[[str], None]) -> None:
        """Call ``callback(reason)`` once the term is lost (at once if it already is)."""
        with self._lock:
            if self.reason is None:
                self._callbacks.append(callback)
                return
        callback(self.reason)

    def publish(self, value: bytes | str) -> bool:
        """Replace the value published with the key (say, once the bind address is known);
        False, and the term lost, when the key is no longer this term's."""
        election = self.election
        value = _bytes(value)
        key = _b64(election.endpoint.key.encode())
        put = {"key": key, "value": _b64(value), "lease": self.lease_id}
        ours = {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": self.epoch}
        try:
            response = election._client.transaction(
                {"compare": [ours], "success": [{"request_put": put}]}
            )
            published = bool(response.get("succeeded"))
        except (election._etcd.exceptions.Etcd3Exception, OSError) as exc:
            if not _lease_not_found(exc):
                raise election._error(exc) from None
            published = False
        if not published:
            self._lose("the key is no longer this term's")
            return False
        election.value = value
        return True

    def resign(self) -> None:
        """Stop leading, then release the key at once: a standby takes over without
        waiting for the TTL. Safe to call more than once, or after a loss."""
        self._lose("resigned")
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.resign()

    def _lose(self, reason: str) -> None:
        with self._lock:
            if self.reason is not None:
                return
            # Invalid first: the leader stops before the key can be anyone else's.
            self._deadline = -math.inf
            self.reason = reason
            callbacks, self._callbacks = self._callbacks, []
        self.lost.set()
        log.info(
            "coordkit: lost the lead of %s (epoch %d): %s",
            self.election.endpoint,
            self.epoch,
            reason,
        )
        for callback in callbacks:
            try:
                callback(reason)
            except Exception:
                log.exception("coordkit: an on_lost callback failed")

    def _keep_alive(self) -> None:
        """Renew the lease every ttl / 3 until the term ends, then revoke it."""
        exceptions = self.election._etcd.exceptions
        ttl = self.election.ttl
        interval = ttl / 3
        lease = self.election._etcd.Lease(self.lease_id, self._client)
        next_at = self._deadline - ttl + interval
        while not self._stop.wait(max(next_at - time.monotonic(), 0.0)):
            sent = time.monotonic()
            next_at = sent + interval
            if sent >= self._deadline:
                # What a leader frozen past its lease finds first when it wakes.
                self._lose(f"no keepalive was answered for {ttl} s")
                break
            # requests times out connecting and reading apart: both within the deadline.
            self._client.timeout = min(interval, self._deadline - sent) / 2
            try:
                left = lease.refresh()
                holder = self._holder()
            except (exceptions.Etcd3Exception, OSError) as exc:
                log.warning("coordkit: lease keepalive failed: %s", _reason(exc))
                continue  # again at the next tick, until the deadline
            if left <= 0:
                self._lose("the lease expired")
                break
            if holder != self.epoch:
                self._lose(f"the key was deleted or taken (now epoch {holder})")
                break
            with self._lock:
                if self.reason is None:  # a resignation meanwhile stays one
                    self._deadline = sent + ttl
        self._client.timeout = interval
        with contextlib.suppress(exceptions.Etcd3Exception, OSError):
            lease.revoke()  # deletes the key if it is still ours
        self._client.session.close()

    def _holder(self) -> int | None:
        """The epoch of the key's holder now (None: nobody)."""
        for _, kv in self._client.get(self.election.endpoint.key, metadata=True):
            return int(kv["create_revision"])
        return None


def _etcd3gw() -> ModuleType:
    try:
        import etcd3gw
        import etcd3gw.exceptions
    except ImportError:
        raise ImportError(MISSING_EXTRA) from None
    return etcd3gw


def _bytes(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _detail(exc: BaseException) -> str:
    """etcd's own message in an error response ("" when there is none)."""
    try:
        message = json.loads(getattr(exc, "detail_text", None) or "").get("message", "")
    except (ValueError, AttributeError):
        return ""
    return str(message)


def _lease_not_found(exc: BaseException) -> bool:
    return "requested lease not found" in _detail(exc)


def _unreachable(exc: BaseException) -> bool:
    """Whether etcd did not answer at all (rather than answered with an error)."""
    exceptions = _etcd3gw().exceptions
    unanswered = (OSError, exceptions.ConnectionFailedError, exceptions.ConnectionTimeoutError)
    return isinstance(exc, unanswered)


def _reason(exc: BaseException) -> str:
    """A short line for an etcd failure (requests' own messages run over several)."""
    # etcd3gw's errors keep their text in detail_text: an error response's body, or requests'.
    text = str(exc) or getattr(exc, "detail_text", None) or ""
    if "Timeout" in type(exc).__name__ or "timed out" in text:
        return "timed out"
    if match := _ERRNO.search(text):
        return match.group(1).strip().rstrip(".").lower()
    if detail := _detail(exc):
        return detail
    return text.splitlines()[0] if text else type(exc).__name__
