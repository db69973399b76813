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

import itertools
import os
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from ._implementation import load_implementation, selected
from ._policies import DEFAULT_BLOCK_SIZE, DEFAULT_DECODE_TOKENS, DEFAULT_PREFILL_WEIGHT
from ._shared import DIALECTS, MEGATRON_VERSIONS, Detokenizer, Options
from .curve import CurveServer
from .metrics import MetricsServer

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["Coordinator"]

#: Seconds between checks of heartbeats and drains when nothing else wakes the loop.
TIMER_INTERVAL = 0.05

_wake_ids = itertools.count()


class _Sockets:
    """The coordinator's ROUTER, and the inproc pair through which stop() wakes its loop."""

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
        self.router.setsockopt(zmq.SNDHWM, 0)  # memory is bounded by max_inflight instead
        self.router.setsockopt(zmq.RCVHWM, 0)
        self.router.setsockopt(zmq.MAXMSGSIZE, max_message_size)
        self.router.setsockopt(zmq.LINGER, self.LINGER_MS)
        self.curve = curve
        try:
            if curve is not None:
                curve.secure(self.router)
            self.router.bind(bind)
        except zmq.ZMQError:
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

    def wake(self) -> None:
        """Ask the loop to stop; safe from any thread, a no-op once closed."""
        with self._lock:
            if not self.closed:
                self._wake_send.send(b"")

    def close(self) -> None:
        with self._lock:
            self.closed = True
            if self.curve is not None:
                self.curve.close(self.router)
            self.router.close()
            if hasattr(self, "wake_recv"):  # bound, not failed before
                self.wake_recv.close()
                self._wake_send.close(linger=0)


class Coordinator:
    """A data-parallel coordinator bound to ``bind`` (any ZeroMQ endpoint).

    Every option is keyword-only; the user guide's table (``docs/guide.md``)
    says what each means.
    ``implementation`` is ``"c"`` or ``"py"`` (default: the one selected at
    import, :data:`coordkit.IMPLEMENTATION`); both behave alike, frame for frame.
    """

    def __init__(
        self,
        bind: str = "ipc:///tmp/coordkit.sock",
        *,
        policy: str = "least_loaded",
        max_inflight: int = 1_000_000,
        max_inflight_per_engine: int = 0,
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
        block_size: int = DEFAULT_BLOCK_SIZE,
        metrics_port: int | None = None,
        curve_secret_key: str | os.PathLike[str] | None = None,
        curve_authorized_keys: str | os.PathLike[str] | None = None,
        context: zmq.Context | None = None,
        implementation: str | None = None,
    ):
        if not 1 <= max_inflight <= 1 << 30:
            raise ValueError("max_inflight must be between 1 and 2**30")
        if max_inflight_per_engine < 0:
            raise ValueError("max_inflight_per_engine must be >= 0 (0: no cap)")
        if heartbeat_timeout < 0 or drain_timeout < 0 or request_timeout < 0:
            raise ValueError("timeouts must be >= 0 (0 disables heartbeat and request expiry)")
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
        if (curve_secret_key is None) != (curve_authorized_keys is None):
            raise ValueError("CURVE needs both curve_secret_key and curve_authorized_keys")
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
            megatron_version=megatron_version,
        )
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
            curve = CurveServer(
                context, curve_secret_key, curve_authorized_keys, self._auth_refused
            )
        self._sockets = _Sockets(bind, max_message_size, context, curve)
        #: The bound endpoint (a tcp port asked for as 0 or * is resolved).
        self.address = self._sockets.address
        #: Whether peers must authenticate with CURVE (and traffic is encrypted).
        self.curve = curve is not None
        self._loop = impl.loop.Loop(
            self.options, router, self._sockets.router, self._sockets.wake_recv
        )
        self._metrics: MetricsServer | None = None
        if metrics_port is not None:
            try:
                self._metrics = MetricsServer(self, metrics_port)
            except BaseException:
                self._sockets.close()
                raise
        self._thread: threading.Thread | None = None
        self._started = False

    def serve_forever(self) -> None:
        """Run the loop until SHUTDOWN or :meth:`stop`; then close the sockets.

        Every request still in flight then gets ERROR(SHUTTING_DOWN).
        """
        if self._sockets.closed:
            raise RuntimeError("coordinator is closed")
        self._started = True
        next_timer = time.monotonic() + TIMER_INTERVAL
        try:
            while self._loop.serve(max(next_timer - time.monotonic(), 0.001)):
                now = time.monotonic()
                if now >= next_timer:
                    self._loop.expire(now)
                    next_timer = now + TIMER_INTERVAL
        finally:
            self._close()

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

    def _auth_refused(self) -> None:
        # Only the CURVE monitor thread calls this; the loop itself never writes the count.
        loop = getattr(self, "_loop", None)  # a refusal may come before the loop is built
        if loop is not None:
            loop.count_auth_refused()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _close(self) -> None:
        if not self._sockets.closed:
            self._loop.shutdown()
            self._sockets.close()
        if self._metrics is not None:
            self._metrics.close()
