"""Traces of requests with OpenTelemetry (the ``otel`` extra): configuration, and the spans
of the client, the coordinator and the engine.

A traced request is one tree: the client's span (:meth:`Client.submit` to the final
reply), the coordinator's (``coordkit.coordinator``, its children ``route``, ``engine``
and ``reply``) and the engine's. The client carries the trace to the engine in the
request's sampling params, under ``"traceparent"`` (:data:`TRACEPARENT`, a W3C string),
set only on a request its sampler sampled; the coordinator forwards the params byte for
byte, and the :class:`~coordkit.Engine` takes the key out of them into
:attr:`Request.traceparent <coordkit.engine.Request.traceparent>` (:func:`engine_span`
continues it). Untraced, the params are what they always were.

Nothing here imports OpenTelemetry at import time: a client or an engine whose
application set no tracer provider costs one check when it is made, and a coordinator
without tracing nothing. What turns tracing on is what OpenTelemetry users expect:

* a client and an engine trace with the application's global tracer provider (or the
  one they are given); :func:`configure` sets one up from the ``OTEL_*`` variables;
* a coordinator traces when ``trace_sample`` is given or the environment asks for traces
  (``OTEL_TRACES_SAMPLER``, ``OTEL_TRACES_EXPORTER``, ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` set; ``OTEL_SDK_DISABLED=true`` or
  ``OTEL_TRACES_EXPORTER=none`` turn it off): see :func:`sampling`. Its spans are made
  from :class:`TraceRecord`\\ s its loop pushes into a :class:`TraceSink`, whose own
  thread makes and exports them, off the loop's.

Exporters (``OTEL_TRACES_EXPORTER``): ``otlp`` (the default; http/protobuf, or grpc with
``OTEL_EXPORTER_OTLP_PROTOCOL=grpc`` and its exporter installed), ``console``, ``none``;
the endpoint, headers, batch sizes and ``OTEL_SERVICE_NAME`` are the SDK's own variables.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from random import getrandbits
from typing import TYPE_CHECKING, Any, NamedTuple

from ._checks import check_params
from ._shared import identity_text
from .protocol import ErrorCode

if TYPE_CHECKING:
    import asyncio

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, SpanContext, Tracer

__all__ = [
    "CLIENT_GONE",
    "TRACEPARENT",
    "TRACEPARENT_MARK",
    "MISSING_EXTRA",
    "Sampling",
    "TraceRecord",
    "TraceSink",
    "asked",
    "configure",
    "end_span",
    "engine_span",
    "follow_future",
    "request_span",
    "sampling",
    "span_exporters",
    "tracer_of",
    "tracer_provider",
]

#: The sampling params' key of a traced request: a W3C ``traceparent``,
#: ``00-<trace id>-<parent span id>-<flags>``, 55 characters.
TRACEPARENT = "traceparent"

#: What precedes a traceparent's 55 characters in a request's packed params: the key (a
#: fixstr of 11) and the head of its value (a str8 of 55). A loop that finds it in the
#: params' bytes has the traceparent in the 55 bytes after it, without decoding them.
TRACEPARENT_MARK = b"\xab" + TRACEPARENT.encode() + b"\xd9\x37"

#: The one line a request for traces gives without the otel extra.
MISSING_EXTRA = "coordkit: traces need OpenTelemetry: pip install 'coordkit[otel]'"

#: The instrumentation scope of every span: the package's name (a vendored copy's own).
_SCOPE = __package__ or "coordkit"

#: The variables that ask for traces when set (OTEL_TRACES_EXPORTER=none asks for none).
_ASKING = (
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
)

#: OTEL_TRACES_SAMPLER's names, as (the ratio of requests without a trace context, whether
#: a client's sampled trace is followed); None: the ratio is OTEL_TRACES_SAMPLER_ARG.
_SAMPLERS: dict[str, tuple[float | None, bool]] = {
    "always_on": (1.0, False),
    "always_off": (0.0, False),
    "traceidratio": (None, False),
    "parentbased_always_on": (1.0, True),
    "parentbased_always_off": (0.0, True),
    "parentbased_traceidratio": (None, True),
}


def _otel() -> None:
    """ImportError with the one line saying what to install, without OpenTelemetry's SDK."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError:
        raise ImportError(MISSING_EXTRA) from None


# -- configuration ---------------------------------------------------------------------


@dataclass(frozen=True)
class Sampling:
    """Which requests a coordinator traces.

    ``ratio`` is the share of requests that carry no sampled trace context (a Megatron
    peer's, an untraced client's) given spans of their own (a trace each); ``follow``:
    every request whose client traced it is traced too, its spans in the client's
    trace. ``every`` is ``ratio`` as the loop applies it: one request in ``every``
    (0: none).
    """

    ratio: float
    follow: bool

    @property
    def every(self) -> int:
        return 0 if self.ratio <= 0 else max(1, round(1 / self.ratio))


def _ratio(text: str, name: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 1:
        raise ValueError(f"coordkit: {name} must be a number between 0 and 1, not {text!r}")
    return value


def asked(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment asks for traces (see the module)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
        return False
    return any(environ.get(name, "").strip() for name in _ASKING)


def sampling(
    trace_sample: float | None = None, environ: Mapping[str, str] = os.environ
) -> Sampling | None:
    """A coordinator's sampling: None when it traces nothing.

    ``trace_sample`` (``coordkit serve --trace-sample P``), when given, is the ratio of
    requests traced (0: none), a client's traced requests followed, as OpenTelemetry's
    ``parentbased_traceidratio`` sampler does. Otherwise the environment decides: traces
    only when it asks for them (see the module), with ``OTEL_TRACES_SAMPLER`` (by default
    ``parentbased_always_on``, OpenTelemetry's own default) and ``OTEL_TRACES_SAMPLER_ARG``
    read as OpenTelemetry reads them. ValueError names what is wrong.
    """
    if trace_sample is not None:
        ratio = _ratio(str(trace_sample), "trace_sample")
        return Sampling(ratio, True) if ratio > 0 else None
    if not asked(environ):
        return None
    name = environ.get("OTEL_TRACES_SAMPLER", "").strip().lower() or "parentbased_always_on"
    if name not in _SAMPLERS:
        raise ValueError(
            f"coordkit: OTEL_TRACES_SAMPLER={name!r} is none of {', '.join(_SAMPLERS)}"
        )
    given, follow = _SAMPLERS[name]
    ratio = (
        given
        if given is not None
        else _ratio(environ.get("OTEL_TRACES_SAMPLER_ARG", "1.0"), "OTEL_TRACES_SAMPLER_ARG")
    )
    if ratio <= 0 and not follow:
        return None
    return Sampling(ratio, follow)


def span_exporters(environ: Mapping[str, str] = os.environ) -> list[SpanExporter]:
    """The span exporters ``OTEL_TRACES_EXPORTER`` names (``otlp`` by default), each
    configured by its ``OTEL_EXPORTER_*`` variables (read from ``environ``). ImportError
    (one line) without the otel extra, ValueError for an exporter coordkit does not set up."""
    _otel()
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")]
    exporters: list[SpanExporter] = []
    for name in filter(None, names):
        if name == "none":
            continue
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporters.append(ConsoleSpanExporter())
        elif name == "otlp":
            exporters.append(_otlp(environ))
        else:
            raise ValueError(
                f"coordkit: OTEL_TRACES_EXPORTER={name!r} is not one coordkit sets up "
                "(otlp, console, none): pass a tracer provider of your own"
            )
    return exporters


def _otlp(environ: Mapping[str, str]) -> SpanExporter:
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "http/protobuf"
    ).strip()
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ImportError(
                "coordkit: OTLP over grpc needs its exporter: "
                "pip install opentelemetry-exporter-otlp-proto-grpc"
            ) from None
        return OTLPSpanExporter()
    if protocol != "http/protobuf":
        raise ValueError(f"coordkit: OTLP protocol {protocol!r} is not grpc or http/protobuf")
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )
    except ImportError:
        raise ImportError(MISSING_EXTRA) from None
    # As the exporter reads them from os.environ, but from ``environ``.
    endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    if not endpoint and (base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        endpoint = base.rstrip("/") + "/v1/traces"
    return HTTPSpanExporter(endpoint=endpoint or None)


def tracer_provider(
    service: str, sample: float | None = None, *, environ: Mapping[str, str] = os.environ
) -> TracerProvider:
    """An SDK tracer provider configured from the ``OTEL_*`` variables, exporting in
    batches (``OTEL_BSP_*``): its exporters from ``OTEL_TRACES_EXPORTER`` (see
    :func:`span_exporters`; ``environ``), its service name ``OTEL_SERVICE_NAME`` (or
    ``OTEL_RESOURCE_ATTRIBUTES``'s), ``service`` when neither says. Its sampler is
    ``OTEL_TRACES_SAMPLER``'s, or ``parentbased_traceidratio`` of ``sample`` when given.
    ImportError (one line) without the otel extra."""
    _otel()
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio

    chosen = None
    if sample is not None:
        chosen = ParentBasedTraceIdRatio(_ratio(str(sample), "the trace sample"))
    provider = TracerProvider(sampler=chosen, resource=_resource(service))
    for exporter in span_exporters(environ):
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def _resource(service: str) -> Resource:
    """The process's resource as the OTEL_* variables describe it, ``service`` its
    service name unless they name one."""
    from opentelemetry.sdk.resources import Resource

    resource = Resource.create()
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
        resource = Resource.create({"service.name": service})
    return resource


def configure(service: str, sample: float | None = None) -> Any:
    """The application's global tracer provider: the one it set, or one made by
    :func:`tracer_provider` (``service``, ``sample``) and set now. What the ``coordkit``
    commands call; an application's clients and engines then trace with it."""
    _otel()
    from opentelemetry import trace

    current = trace.get_tracer_provider()
    if not isinstance(current, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return current
    provider = tracer_provider(service, sample)
    trace.set_tracer_provider(provider)
    return provider


def tracer_of(provider: Any = None) -> Tracer | None:
    """The tracer of a client or an engine: ``provider``'s, or the global provider's
    when the application set one; None when neither (the endpoint traces nothing, and
    OpenTelemetry is not even imported when the application did not import it)."""
    if provider is None:
        trace = sys.modules.get("opentelemetry.trace")
        if trace is None:  # nobody set a provider without importing it
            return None
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            return None
    tracer: Tracer = provider.get_tracer(_SCOPE)
    return tracer


# -- the client ------------------------------------------------------------------------


def _traceparent(span: Span) -> str:
    context = span.get_span_context()
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"


def request_span(tracer: Tracer, name: str, sampling_params: Any) -> tuple[Any, Span | None]:
    """A request's client span, a child of the current one, and the params to send: the
    caller's with the span's traceparent when sampled (the span then ends with
    :func:`end_span`), the caller's as they are and no span when not."""
    from opentelemetry.trace import SpanKind

    span = tracer.start_span(name, kind=SpanKind.CLIENT)
    if not span.get_span_context().trace_flags.sampled:
        return sampling_params, None
    try:
        params = dict(check_params(sampling_params) or {})
    except TypeError as exc:
        end_span(span, exc)
        raise
    params[TRACEPARENT] = _traceparent(span)
    return params, span


def end_span(span: Span, error: BaseException | None = None) -> None:
    """A request's span ends: ``error`` (an exception, a cancellation) is its status."""
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
    span.end()


def follow_future(span: Span, future: asyncio.Future[Any]) -> None:
    """End ``span`` when ``future`` (a request's) is done."""
    span.set_attribute("coordkit.request_id", getattr(future, "request_id", -1))
    future.add_done_callback(partial(_future_done, span))


def _future_done(span: Span, future: asyncio.Future[Any]) -> None:
    if future.cancelled():
        end_span(span, _Cancelled("cancelled"))
    else:
        end_span(span, future.exception())


class _Cancelled(Exception):
    """The status of a request cancelled by its caller."""


# -- the engine ------------------------------------------------------------------------

_TRACEPARENT_FORM = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _remote(traceparent: str | None) -> SpanContext | None:
    """The (remote) span a traceparent names; None for none, or one not of W3C's form."""
    match = None if traceparent is None else _TRACEPARENT_FORM.fullmatch(traceparent)
    if match is None:
        return None
    from opentelemetry.trace import SpanContext, TraceFlags

    trace_id, span_id, flags = (int(part, 16) for part in match.groups())
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, True, TraceFlags(flags))


def engine_span(
    request: Any,
    tracer: Tracer | None = None,
    name: str = "coordkit.engine",
    start_time: int | None = None,
) -> Span | None:
    """A span continuing the trace a :class:`~coordkit.engine.Request` carries (its
    ``traceparent``), to end when its final reply is sent; None for an untraced request
    (or without a tracer: ``tracer`` or the global provider's, see :func:`tracer_of`)."""
    parent = _remote(getattr(request, "traceparent", None))
    if parent is None:
        return None
    tracer = tracer or tracer_of()
    if tracer is None:
        return None
    from opentelemetry.trace import NonRecordingSpan, SpanKind, set_span_in_context

    return tracer.start_span(
        name,
        context=set_span_in_context(NonRecordingSpan(parent)),
        kind=SpanKind.SERVER,
        attributes={"coordkit.server_rid": request.server_rid},
        start_time=start_time,
    )


# -- the coordinator -------------------------------------------------------------------

#: A TraceRecord's ``error`` for a request that ended without an answer: its client left.
CLIENT_GONE = -1


class TraceRecord(NamedTuple):
    """What a coordinator's loop records of a request it traces, pushed once it ended.

    Times are the loop's clock (``time.monotonic()``, CLOCK_MONOTONIC, in seconds): its
    acceptance (the SUBMIT read), its routing (its frames sent to the engine; None: never
    routed), its first reply and its final reply received from the engine (None: none),
    and its end (the final, or the ERROR that ended it, sent to the client). ``error``
    is the :class:`~coordkit.ErrorCode` it ended with (0: a final reply; :data:`CLIENT_GONE`:
    none, its client left). ``client`` and
    ``engine`` are routing ids (the spans show them as ``stats()`` does);
    ``traceparent`` is the one its params carry, or None.
    """

    server_rid: int
    client_rid: int
    client: bytes
    engine: bytes | None
    accepted: float
    routed: float | None
    first_reply: float | None
    final: float | None
    ended: float
    error: int
    traceparent: str | None


class TraceSink:
    """Where a coordinator's loop puts the requests it traced, and the thread that turns
    them into spans and exports them, off the loop's thread.

    The loop reads ``every`` and ``follow`` (a :class:`Sampling`'s) and hands over each
    traced request that ended, either way: it calls :meth:`push` (with the GIL, on a
    rare path), or it keeps them itself (in C, without the GIL) and :meth:`attach`\\ es a
    source the thread calls for them. Pushed records wait in a deque of at most
    ``capacity`` (the oldest dropped past it, counted in ``dropped``): ``append`` and the
    thread's ``popleft`` are each atomic, so neither side takes a lock, and a push costs
    the loop one append. The thread wakes every
    ``interval`` seconds, makes each record's spans (see :meth:`spans`) and hands them to
    ``exporters`` (by default those the ``OTEL_*`` variables name), ``batch`` records at a
    time; :meth:`close` exports what is left.

    The spans are made as the SDK's exporters take them (``ReadableSpan``), not through
    a tracer: the loop sampled already, and a tracer's span costs some 50 µs to make
    where this costs a few (the export's encoding stays the exporter's).
    """

    def __init__(
        self,
        sampling: Sampling,
        exporters: Sequence[SpanExporter] | None = None,
        *,
        capacity: int = 1 << 16,
        interval: float = 0.5,
        batch: int = 256,
    ):
        _otel()
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        self.every = sampling.every
        self.follow = sampling.follow
        self.dropped = 0
        self.emitted = 0
        self._own = exporters is None
        self._exporters = list(span_exporters() if exporters is None else exporters)
        self._resource = _resource("coordkit-coordinator")
        self._scope = InstrumentationScope(_SCOPE)
        self._records: deque[TraceRecord] = deque(maxlen=capacity)
        self._interval = interval
        self._batch = batch
        # The loop's clock to the wall clock's nanoseconds, which spans are timed in.
        self._offset = time.time_ns() - time.monotonic_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._source: Callable[[], Iterable[TraceRecord]] | None = None

    def attach(self, source: Callable[[], Iterable[TraceRecord]]) -> None:
        """The loop's records, taken by the sink's thread: ``source()`` (called with the
        GIL, on that thread) gives those that ended since its last call."""
        self._source = source

    def push(self, record: TraceRecord) -> None:
        """A traced request that ended (the loop's thread, with the GIL)."""
        if len(self._records) == self._records.maxlen:
            self.dropped += 1
        self._records.append(record)

    def start(self) -> None:
        """Start the thread that makes and exports the spans (``coordkit-traces``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="coordkit-traces", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.drain()

    def drain(self) -> None:
        """Make and export the spans of every record handed over so far."""
        if self._source is not None:
            for record in self._source():
                self.push(record)
        records = self._records
        while records:
            spans: list[ReadableSpan] = []
            for _ in range(self._batch):
                try:
                    record = records.popleft()
                except IndexError:  # all taken (by another drain, too)
                    break
                spans += self.spans(record)
                self.emitted += 1
            for exporter in self._exporters:
                exporter.export(spans)

    def close(self) -> None:
        """Stop the thread, export what is left, and shut its own exporters down (those
        it was given are flushed); once."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.drain()
        for exporter in self._exporters:
            if self._own:
                exporter.shutdown()
            else:
                exporter.force_flush()

    def _ns(self, seconds: float) -> int:
        return int(seconds * 1e9) + self._offset

    def spans(self, record: TraceRecord) -> list[ReadableSpan]:
        """One request's spans: ``coordkit.coordinator`` from its acceptance to its end, a
        child of the client's span when it carried a traceparent (a trace of its own
        otherwise: a Megatron client's), and its children ``route`` (acceptance to
        routing: the queue and the routing decision), ``engine`` (routing to the final
        reply, with an event at the first) and ``reply`` (the final's way to the client)."""
        from opentelemetry.sdk.trace import Event, ReadableSpan
        from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

        parent = _remote(record.traceparent)
        trace_id = getrandbits(128) if parent is None else parent.trace_id
        sampled = TraceFlags(TraceFlags.SAMPLED)
        ns, resource, scope = self._ns, self._resource, self._scope

        def span(
            name: str, under: SpanContext | None, start: float, end: float, **more: Any
        ) -> ReadableSpan:
            context = SpanContext(trace_id, getrandbits(64), False, sampled)
            return ReadableSpan(
                name,
                context,
                under,
                resource,
                start_time=ns(start),
                end_time=ns(end),
                instrumentation_scope=scope,
                **more,
            )

        attributes: dict[str, str | int] = {
            "coordkit.server_rid": record.server_rid,
            "coordkit.client_rid": record.client_rid,
            "coordkit.client": identity_text(record.client),
        }
        if record.engine is not None:
            attributes["coordkit.engine"] = identity_text(record.engine)
        status = Status()
        if record.error:
            try:
                text = ErrorCode(record.error).name
            except ValueError:
                text = "client gone" if record.error == CLIENT_GONE else f"error {record.error}"
            status = Status(StatusCode.ERROR, text)
        root = span(
            "coordkit.coordinator",
            parent,
            record.accepted,
            record.ended,
            attributes=attributes,
            kind=SpanKind.SERVER,
            status=status,
        )
        made = [root]
        inside = root.context
        if record.routed is not None:
            made.append(span("route", inside, record.accepted, record.routed))
            first = record.first_reply
            events = () if first is None else (Event("first reply", timestamp=ns(first)),)
            end = record.ended if record.final is None else record.final
            made.append(span("engine", inside, record.routed, end, events=events))
        if record.final is not None:
            made.append(span("reply", inside, record.final, record.ended))
        return made
