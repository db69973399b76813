"""The coordinator: one ROUTER socket between the clients and the engine ranks.

:class:`Coordinator` is the public face, the same whichever implementation
runs it: it checks its options, owns the sockets, runs the loop on the
calling thread or a background one, keeps its timers and answers
:meth:`~Coordinator.stats`. The work is done by a *loop core*, the tables and
the message handlers: ``coordkit._loop_c.Loop`` (Cython, over raw libzmq,
without the GIL) or ``coordkit._loop_py.Loop`` (the pure-Python reference),
as pyzmq layers ``zmq.Socket`` over its Cython backend.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import math
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import zmq

from ._checks import check_address, check_tenant_weights
from ._implementation import load_implementation, selected
from ._kvevents import Subscriber, parse_endpoints
from ._pd import DEFAULT_PD_LEASE, DEFAULT_PD_RETRIES, DEFAULT_PD_THRESHOLD
from ._pd import check_options as check_pd_options
from ._policies import DEFAULT_BLOCK_SIZE, DEFAULT_DECODE_TOKENS, DEFAULT_PREFILL_WEIGHT
from ._shared import (
    BREAKER_BACKOFF,
    BREAKER_FAILURES,
    BREAKER_WINDOW,
    CONNECTION_EVENTS,
    DEFAULT_QUEUE_LIMIT,
    DIALECTS,
    ENGINE_GRACE,
    MAX_QUEUE_LIMIT,
    MEGATRON_VERSIONS,
    REBUILD_WINDOW,
    REFUSAL_EVENTS,
    Detokenizer,
    Options,
    logger,
)
from .curve import CurveServer
from .metrics import MetricsServer
from .tracing import Sampling, TraceSink, sampling

if TYPE_CHECKING:
    from typing_extensions import Self

    from .election import Term

__all__ = ["Coordinator"]

#: Seconds the main thread's loop serves before returning to Python, where its
#: signal handlers run (a signal that interrupts its poll returns at once).
SIGNALS_EVERY = 1.0

_wake_ids = itertools.count()

#: The wall clock in ns at a coordinator's start: its epoch (without a term) and its
#: first server id, both above those of any earlier life at the same place (the
#: tests pin it to compare frames).
_clock_ns = time.time_ns
#: A cluster's members serve at once: each draws its server ids from a random place
#: below this (the clock would give members started together the same ids once their
#: index laps; random starts meet with odds of the ids drawn / 2**61).
_CLUSTER_IDS = 1 << 61


#: Options that are gone, and what replaced them: the hint their error gives.
REMOVED_OPTIONS = {
    "prefix_alpha": (
        "prefix_prefill_weight",
        "32·α/(1−α) for the old α: the same ratio of affinity to load",
    ),
}


def _removed(options: dict[str, Any]) -> TypeError:
    """The error for keyword arguments Coordinator() does not take: a removed one named
    with its replacement, any other as Python names an unexpected one."""
    name = next(iter(options))
    if name in REMOVED_OPTIONS:
        replacement, how = REMOVED_OPTIONS[name]
        return TypeError(f"coordkit: {name} is gone: use {replacement} ({how})")
    return TypeError(f"Coordinator() got an unexpected keyword argument {name!r}")


def _ipc_file(address: str) -> str | None:
    """The socket file an ``ipc://`` address binds (None: another transport, an
    abstract name, or libzmq's ``*``)."""
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://") :]
    return None if path.startswith("@") or path == "*" else os.path.abspath(path)


def _refuse_if_answered(address: str, path: str) -> None:
    """ZMQError(EADDRINUSE) when something accepts connections on the socket file:
    libzmq's bind would replace the file and leave whoever serves it unreachable.
    A file nobody serves (ECONNREFUSED: its coordinator was killed) is replaced;
    one that is not a socket at all (libzmq would delete it) is refused (EEXIST)."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise zmq.ZMQError(
                errno.EEXIST, f"coordkit: cannot bind {address}: {path} is not a socket file"
            )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (BlockingIOError, TimeoutError):
        pass  # a listener whose backlog is full: it is there all the same
    except OSError:
        return  # no file, or nobody behind it
    finally:
        probe.close()
    raise zmq.ZMQError(
        errno.EADDRINUSE,
        f"coordkit: {address} is in use: a coordinator (or another program) answers there; "
        "stop it, or bind another path",
    )


def _serve_slice(term: Term | None, main: bool) -> float:
    """How long one serve() call lasts (see serve_forever)."""
    slice_ = SIGNALS_EVERY if main else math.inf
    if term is not None:
        slice_ = min(slice_, max((term.deadline - time.monotonic()) / 2, 0.001))
    return slice_


class _Sockets:
    """The coordinator's ROUTER, its socket monitor (read by the loop: connections that
    end, handshakes refused), and the inproc pair through which stop() wakes its loop.

    An ``ipc://`` path already served is refused; the socket file bound is removed
    on close, unless another coordinator bound the path since.
    """

    LINGER_MS = 500  # lets the final ERRORs of a shutdown reach their clients

    def __init__(
        self,
        bind: str,
        max_message_size: int,
        context: zmq.Context | None,
        curve: CurveServer | None,
    ):
        self._lock = threading.Lock()
        self.closed = False
        self.context = context or zmq.Context.instance()
        self.router = self.context.socket(zmq.ROUTER)
        # A send to a peer that is gone fails (EHOSTUNREACH) instead of vanishing.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # A peer that reconnects with its routing id (a blip) takes it over from its
        # old connection instead of being refused while that one lingers.
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.router.setsockopt(zmq.SNDHWM, 0)  # memory is bounded by max_inflight instead
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        self.router.setsockopt(zmq.LINGER, self.LINGER_MS)
        self.curve = curve
        self.monitor: zmq.Socket | None = None
        self._bound_file: tuple[str, int, int] | None = None  # path, device, inode
        try:
            if curve is not None:
                curve.secure(self.router)
            self.monitor = self._watch(CONNECTION_EVENTS | (REFUSAL_EVENTS if curve else 0))
            path = _ipc_file(bind)
            if path is not None:
                _refuse_if_answered(bind, path)
            try:
                self.router.bind(bind)
            except zmq.ZMQError as exc:
                reason = zmq.strerror(exc.errno) if exc.errno else exc.strerror  # no addr=...
                text = f"coordkit: cannot bind {bind}: {reason}"
                raise zmq.ZMQError(exc.errno, text) from None
            if path is not None:
                info = os.stat(path)
                self._bound_file = (path, info.st_dev, info.st_ino)
        except BaseException:
            self.close()
            raise
        self.address: str = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        # A fresh name each time: libzmq frees an inproc name only a little after close.
        # by the package's name: a vendored copy shares the process and its Context.instance()
        wake = f"inproc://{__name__}-wake-{next(_wake_ids)}"
        self.wake_recv = self.context.socket(zmq.PAIR)
        self.wake_recv.bind(wake)
        self._wake_send = self.context.socket(zmq.PAIR)
        self._wake_send.connect(wake)

    def _watch(self, events: int) -> zmq.Socket:
        """The ROUTER's monitor, set before it binds so that every connection is seen."""
        address = f"inproc://{__name__}-monitor-{next(_wake_ids)}"
        self.router.monitor(address, events)
        monitor = self.context.socket(zmq.PAIR)
        monitor.setsockopt(zmq.RCVHWM, 0)  # a full pipe would stall libzmq's I/O thread
        monitor.connect(address)
        return monitor

    def nudge(self) -> None:
        """Tell the loop the KV events' thread has records waiting (a byte, where stop()
        sends an empty frame); safe from any thread, a no-op once closed."""
        with self._lock:
            if not self.closed:
                self._wake_send.send(b"k")

    def wake(self) -> None:
        """Ask the loop to stop; safe from any thread, a no-op once closed."""
        with self._lock:
            if not self.closed:
                self._wake_send.send(b"")

    def close(self) -> None:
        with self._lock:
            self.closed = True
            # The file first: libzmq closes the listener a little after close(), and a
            # coordinator started meanwhile must not find this one answering there.
            self._remove_bound_file()
            if self.monitor is not None:
                self.router.disable_monitor()
                self.monitor.close(linger=0)
            if self.curve is not None:
                self.curve.close()
            self.router.close()
            if hasattr(self, "wake_recv"):  # bound, not failed before
                self.wake_recv.close()
                self._wake_send.close(linger=0)

    def _remove_bound_file(self) -> None:
        if self._bound_file is None:
            return
        path, device, inode = self._bound_file
        self._bound_file = None
        with contextlib.suppress(FileNotFoundError):
            info = os.stat(path)
            if (info.st_dev, info.st_ino) == (device, inode):  # not another's since
                os.unlink(path)


class Coordinator:
    """A data-parallel coordinator bound to ``bind`` (any ZeroMQ endpoint).

    Every option is keyword-only; the user guide's table (``docs/guide.md``)
    says what each means.
    ``implementation`` is ``"c"`` or ``"py"`` (default: the one selected at
    import, :data:`coordkit.IMPLEMENTATION`); both behave alike, frame for frame.

    ``bind`` is ``tcp://HOST:PORT``, ``ipc:///path`` or ``inproc://name``
    (ValueError otherwise). An ``ipc://`` path where something already
    answers is refused (``zmq.ZMQError``, errno ``EADDRINUSE``, as a tcp port
    in use is); a socket file left by a coordinator that was killed is
    replaced, and the file is removed when the coordinator closes. A removed
    option (``prefix_alpha``) raises TypeError naming its replacement.

    ``term`` (an :class:`coordkit.election.Term`) makes it serve while that term
    lasts: its epoch is the term's, the loop stops the moment the term's
    deadline passes (checked at each wake-up) or the term is lost, and it then
    closes without failing what is in flight (the next leader takes it over).
    ``rebuild_window`` is how long after its start it waits for engines to
    report what they hold (docs/failover.md); a ``cluster`` member (``coordkit serve
    --cluster``) keeps it open a window past each REJOIN and HELD:
    those of another member's clients and engines, that member lost (docs/scaling.md).
    ``engine_grace`` is how long an engine whose tcp connection ended keeps what it
    holds (over ipc, none: the connection's end is its process's), and
    ``breaker_failures`` failures of an engine within ``breaker_window`` seconds
    quarantine it for ``breaker_backoff`` seconds, doubled while it keeps failing
    (docs/failure-model.md).

    Engines that register a role run disaggregated prefill/decode (docs/pd.md):
    ``pd_mode`` ``"conditional"`` runs a request whose prompt, less what the engine
    that would run it whole caches, is at most ``pd_threshold`` tokens on that one
    engine, ``"always"`` sends every request through both hops while a prefill and a
    decode engine are up; a prefill's pins are released after ``pd_lease`` seconds
    without their decode's read, and a request is prefilled or handed off again up to
    ``pd_retries`` times after an engine's death.
    ``metrics_port`` serves Prometheus metrics (the ``metrics`` extra; port 0: a free
    one, :attr:`metrics_port` says which), and the loop then measures its latencies;
    ``engine_histograms`` adds each engine's time to first reply and request duration
    (two histograms per engine: off by default for the series they cost at thousands of
    engines).

    ``trace_sample`` (0 to 1) traces that share of the requests with OpenTelemetry (the
    ``otel`` extra; ImportError naming it without), and every request whose client traced
    it; by default the ``OTEL_*`` variables decide (:func:`coordkit.tracing.sampling`).
    Its spans go to ``trace_exporter`` (an OpenTelemetry ``SpanExporter``), by default to
    the exporters the ``OTEL_*`` variables configure (docs/deploying.md, "Traces").

    ``kv_events`` reads the engines' own KV-cache events (vLLM's wire format,
    docs/routing.md): a map of engine to ``"ENDPOINT"`` or ``"ENDPOINT,REPLAY"`` for the
    engines that cannot say (an empty map: only those a coordkit engine announces at
    its hello), an engine named by its data-parallel rank N (the one registering as
    ``engine-N`` or Megatron's ``mp-coord-N``) or by its routing id (a str); the
    ``prefix`` policy then prices an engine that publishes by what its events say it
    holds. ``kv_events_topic`` filters their topic (a prefix).
    """

    def __init__(
        self,
        bind: str = "ipc:///tmp/coordkit.sock",
        *,
        policy: str = "least_loaded",
        max_inflight: int = 1_000_000,
        max_inflight_per_engine: int = 0,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        tenant_weights: Mapping[str, float] | None = None,
        heartbeat_timeout: float = 10.0,
        drain_timeout: float = 30.0,
        max_message_size: int = 256 << 20,
        detokenizer: Detokenizer | None = None,
        seed: int = 0,
        prefix_prefill_weight: float = DEFAULT_PREFILL_WEIGHT,
        prefix_decode_tokens: int = DEFAULT_DECODE_TOKENS,
        prefix_ttl: float = 600.0,
        prefix_max_entries: int = 1_000_000,
        max_clients: int = 65536,
        max_engines: int = 4096,
        keep_prompts: bool = True,
        request_timeout: float = 0.0,
        dialect: str = "multipart",
        megatron_version: str = "0.19",
        pd_mode: str = "conditional",
        pd_threshold: int = DEFAULT_PD_THRESHOLD,
        pd_lease: float = DEFAULT_PD_LEASE,
        pd_retries: int = DEFAULT_PD_RETRIES,
        block_size: int = DEFAULT_BLOCK_SIZE,
        rebuild_window: float = REBUILD_WINDOW,
        cluster: bool = False,
        engine_grace: float = ENGINE_GRACE,
        breaker_failures: int = BREAKER_FAILURES,
        breaker_window: float = BREAKER_WINDOW,
        breaker_backoff: float = BREAKER_BACKOFF,
        term: Term | None = None,
        metrics_port: int | None = None,
        engine_histograms: bool = False,
        trace_sample: float | None = None,
        trace_exporter: Any = None,
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_authorized_keys: str | os.PathLike[str] | None = None,
        context: zmq.Context | None = None,
        implementation: str | None = None,
        kv_events: Mapping[int | str, str] | None = None,
        kv_events_topic: str = "",
        **removed: Any,
    ):
        if removed:
            raise _removed(removed)
        check_address(bind)
        if not 1 <= max_inflight <= 1 << 30:
            raise ValueError("max_inflight must be between 1 and 2**30")
        if max_inflight_per_engine < 0:
            raise ValueError("max_inflight_per_engine must be >= 0 (0: no cap)")
        if not 0 <= queue_limit <= MAX_QUEUE_LIMIT:
            raise ValueError(f"queue_limit must be between 0 (none wait) and {MAX_QUEUE_LIMIT}")
        weights = check_tenant_weights(tenant_weights)
        check_pd_options(pd_mode, pd_threshold, pd_lease, pd_retries)
        if min(heartbeat_timeout, drain_timeout, request_timeout, rebuild_window) < 0:
            raise ValueError("timeouts must be >= 0 (0 disables heartbeat and request expiry)")
        if engine_grace < 0 or breaker_failures < 0:
            raise ValueError("engine_grace and breaker_failures must be >= 0 (0: none)")
        if breaker_window <= 0 or breaker_backoff <= 0:
            raise ValueError("breaker_window and breaker_backoff must be > 0")
        if max_message_size < -1 or max_message_size == 0:
            raise ValueError("max_message_size must be positive, or -1 for no limit")
        if not 1 <= max_clients <= 1 << 24 or not 1 <= max_engines <= 1 << 16:
            raise ValueError("max_clients must be in 1..2**24 and max_engines in 1..65536")
        if dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {', '.join(DIALECTS)}, not {dialect!r}")
        if megatron_version not in MEGATRON_VERSIONS:
            raise ValueError(
                f"megatron_version must be one of {', '.join(MEGATRON_VERSIONS)}, "
                f"not {megatron_version!r}"
            )
        if megatron_version != "0.19" and dialect != "megatron-core":
            raise ValueError(f"megatron_version={megatron_version!r} needs dialect='megatron-core'")
        if block_size < 1:
            raise ValueError("block_size must be at least 1")
        if engine_histograms and metrics_port is None:
            raise ValueError("engine_histograms needs metrics_port (they are metrics)")
        if (curve_secret_key is None) != (curve_authorized_keys is None):
            raise ValueError("CURVE needs both curve_secret_key and curve_authorized_keys")
        traced = sampling(trace_sample)
        impl = load_implementation(implementation) if implementation else selected()
        #: ``"c"`` or ``"py"``: which loop core runs this coordinator.
        self.implementation: str = impl.name
        self.policy = policy
        self.options = Options(
            max_inflight=max_inflight,
            max_inflight_per_engine=max_inflight_per_engine,
            heartbeat_timeout=heartbeat_timeout,
            drain_timeout=drain_timeout,
            detokenizer=detokenizer,
            max_clients=max_clients,
            max_engines=max_engines,
            keep_prompts=keep_prompts,
            request_timeout=request_timeout,
            measure_latency=metrics_port is not None,
            dialect=dialect,
            block_size=block_size,
            epoch=term.epoch if term is not None else _clock_ns(),
            first_server_id=secrets.randbelow(_CLUSTER_IDS) if cluster else _clock_ns(),
            rebuild_window=rebuild_window,
            cluster=cluster,
            megatron_version=megatron_version,
            # Over ipc a connection that ends is its process's end: no blip to wait for.
            engine_grace=engine_grace if bind.startswith("tcp://") else 0.0,
            breaker_failures=breaker_failures,
            breaker_window=breaker_window,
            breaker_backoff=breaker_backoff,
            queue_limit=queue_limit,
            tenant_weights=weights,
            pd_mode=pd_mode,
            pd_threshold=pd_threshold,
            pd_lease=float(pd_lease),
            pd_retries=pd_retries,
            engine_histograms=engine_histograms,
        )
        publishers = [parse_endpoints(f"{n}={spec}") for n, spec in (kv_events or {}).items()]
        self._term = term
        router = impl.Router(
            policy,
            max_engines,
            seed=seed,
            rank_cap=max_inflight_per_engine,
            prefix_prefill_weight=prefix_prefill_weight,
            prefix_decode_tokens=prefix_decode_tokens,
            block_size=block_size,
            prefix_ttl=prefix_ttl,
            prefix_max_entries=prefix_max_entries,
        )
        context = context or zmq.Context.instance()
        curve = None
        if curve_secret_key is not None and curve_authorized_keys is not None:
            curve = CurveServer(context, curve_secret_key, curve_authorized_keys)
        self._sockets = _Sockets(bind, max_message_size, context, curve)
        #: The bound endpoint (a tcp port asked for as 0 or * is resolved).
        self.address = self._sockets.address
        #: Whether peers must authenticate with CURVE (and traffic is encrypted).
        self.curve = curve is not None
        try:
            sink = _sink(traced, trace_exporter, trace_sample is not None)
        except BaseException:
            self._sockets.close()
            raise
        self.options = dataclasses.replace(self.options, tracing=sink)
        self._kv_events: Subscriber | None = None
        if kv_events is not None:
            self._kv_events = Subscriber(
                context,
                self._sockets.nudge,
                block_size,
                kv_events_topic.encode(),
                decode=impl.codec.decode_kv_batch,
                chains=impl.codec.KVChains(max_engines),
            )
            try:
                for name, endpoint, replay in publishers:
                    self._kv_events.configure(name, endpoint, replay)
            except ValueError:
                self._sockets.close()
                self._close_tracing()
                raise
            self.options = dataclasses.replace(self.options, kv_events=self._kv_events)
        self._loop = impl.loop.Loop(
            self.options,
            router,
            self._sockets.router,
            self._sockets.wake_recv,
            self._sockets.monitor,
        )
        self._metrics: MetricsServer | None = None
        if metrics_port is not None:
            try:
                self._metrics = MetricsServer(self, metrics_port)
            except BaseException:
                self._sockets.close()
                self._close_tracing()
                raise
        if self.options.tracing is not None:
            self.options.tracing.start()
        if self._kv_events is not None:
            self._kv_events.start()
        self._thread: threading.Thread | None = None
        self._started = False
        if term is not None:
            term.on_lost(lambda reason: self._sockets.wake())

    @property
    def epoch(self) -> int:
        """What it announces to rebuild peers: its term's epoch, or the clock at its start."""
        return self.options.epoch

    def serve_forever(self) -> None:
        """Run the loop until SHUTDOWN or :meth:`stop`, or its term ends; then close.

        Every request still in flight then gets ERROR(SHUTTING_DOWN), unless the
        term ended: then nothing more is sent, and the next leader takes them over.
        """
        if self._sockets.closed:
            raise RuntimeError("coordinator is closed")
        self._started = True
        term = self._term
        # The timers run inside serve(), without the GIL: under load the loop leaves
        # it only to read a term's renewed deadline (at half the time left, so that a
        # renewal is seen well before the deadline it replaced) or, on the main
        # thread, for the signal handlers. (A return waits for the GIL: in a busy
        # process, up to the interpreter's switch interval.)
        main = threading.current_thread() is threading.main_thread()
        deadline = math.inf
        try:
            while self._loop.serve(
                _serve_slice(term, main), deadline := math.inf if term is None else term.deadline
            ):
                pass
        finally:
            # Past the deadline the loop was given, the term ended for it, even if a
            # keepalive answered meanwhile renewed it: what is in flight is handed over.
            ended = term is not None and (time.monotonic() >= deadline or not term.valid())
            self._close(handover=ended)

    def start(self) -> None:
        """Run :meth:`serve_forever` on a background thread named ``coordkit``."""
        if self._thread is not None:
            raise RuntimeError("coordinator already started")
        self._thread = threading.Thread(target=self.serve_forever, name="coordkit", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop the loop (from any thread) and wait for it when it runs on another."""
        if not self._started:
            self._close()
            return
        self._sockets.wake()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def stats(self) -> dict[str, Any]:
        """Counters, requests in flight, clients, control state and engines."""
        return self._loop.stats()

    def metrics(self) -> dict[str, Any]:
        """Messages and bytes by header and direction, requests failed and messages
        refused by error code, and (when measured) the latency histograms."""
        return self._loop.metrics()

    @property
    def metrics_port(self) -> int | None:
        """The port its Prometheus metrics are served on (None: not served)."""
        return None if self._metrics is None else self._metrics.port

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close(self, handover: bool = False) -> None:
        if not self._sockets.closed:
            if not handover:
                self._loop.shutdown()
            self._sockets.close()
        if self._kv_events is not None:
            self._kv_events.stop()
        if self._metrics is not None:
            self._metrics.close()
        self._close_tracing()

    def _close_tracing(self) -> None:
        """The spans of what was traced made and exported (what shutdown() ended too)."""
        if self.options.tracing is not None:
            self.options.tracing.close()


def _sink(traced: Sampling | None, exporter: Any, asked: bool) -> TraceSink | None:
    """The trace sink of a coordinator that traces; without the otel extra, ImportError
    when ``asked`` (trace_sample given), a warning when only the environment asked."""
    if traced is None:
        return None
    try:
        return TraceSink(traced, None if exporter is None else [exporter])
    except ImportError as exc:
        if asked:
            raise
        logger.warning("%s (the OTEL_* variables ask for traces)", exc)
        return None
