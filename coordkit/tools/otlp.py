"""A small OTLP/HTTP trace receiver, and a request's span tree as text (the otel extra).

:class:`Receiver` takes what OpenTelemetry's OTLP exporters send (``POST /v1/traces``,
protobuf, gzip or not) on a thread of its own, and keeps the spans: ``coordkit demo
--trace-sample`` points its processes at one and prints a request's tree, and the tests
assert on the spans a real exporter sent. It is for those, not a collector.
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple

from ..tracing import MISSING_EXTRA

__all__ = ["Receiver", "ReceivedSpan", "tree"]

_PATH = "/v1/traces"


class ReceivedSpan(NamedTuple):
    """A span as an exporter sent it: ids in hex (``parent_id`` "" for a root), times in
    the wall clock's ns, the service name of the process that made it."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    start: int
    end: int
    attributes: dict[str, Any]
    events: tuple[str, ...]
    error: bool  # its status is ERROR
    status: str  # its status's description ("" for none)

    @property
    def seconds(self) -> float:
        return (self.end - self.start) / 1e9


def _value(value: Any) -> Any:
    """An OTLP AnyValue's Python value (the scalars spans carry)."""
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


def _spans(body: bytes) -> list[ReceivedSpan]:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        service = str(resource.get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    ReceivedSpan(
                        service,
                        span.name,
                        span.trace_id.hex(),
                        span.span_id.hex(),
                        span.parent_span_id.hex(),
                        span.start_time_unix_nano,
                        span.end_time_unix_nano,
                        {a.key: _value(a.value) for a in span.attributes},
                        tuple(event.name for event in span.events),
                        span.status.code == Status.STATUS_CODE_ERROR,
                        span.status.message,
                    )
                )
    return spans


class Receiver:
    """An OTLP/HTTP receiver on ``127.0.0.1`` (``port`` 0: a free one); ``endpoint`` is
    what ``OTEL_EXPORTER_OTLP_ENDPOINT`` takes. ImportError (one line) without the
    otel extra."""

    def __init__(self, port: int = 0):
        try:
            import opentelemetry.proto.collector.trace.v1.trace_service_pb2  # noqa: F401
        except ImportError:
            raise ImportError(MISSING_EXTRA) from None
        self._spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != _PATH:
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(_spans(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the exporters post every few seconds

        self._server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        #: The OTLP/HTTP endpoint: exporters post to ``{endpoint}/v1/traces``.
        self.endpoint = f"http://127.0.0.1:{self._server.server_port}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="coordkit-otlp", daemon=True
        )
        self._thread.start()

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._arrived:
            self._spans += spans
            self._arrived.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in the order they came."""
        with self._lock:
            return list(self._spans)

    def wait(self, count: int, timeout: float = 10.0) -> list[ReceivedSpan]:
        """The spans once at least ``count`` came (TimeoutError after ``timeout`` s)."""
        with self._arrived:
            if not self._arrived.wait_for(lambda: len(self._spans) >= count, timeout):
                raise TimeoutError(f"{len(self._spans)} of {count} spans within {timeout} s")
            return list(self._spans)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tree(spans: Iterable[ReceivedSpan], trace_id: str) -> list[str]:
    """One trace's spans as lines, each under its parent (a span whose parent is not
    among them is a root), in start order: name, service, duration, offset from the
    trace's start."""
    mine = sorted((s for s in spans if s.trace_id == trace_id), key=lambda s: s.start)
    if not mine:
        return []
    ids = {s.span_id for s in mine}
    children: dict[str, list[ReceivedSpan]] = {}
    for span in mine:
        children.setdefault(span.parent_id if span.parent_id in ids else "", []).append(span)
    origin = mine[0].start
    lines: list[str] = []

    def add(span: ReceivedSpan, depth: int) -> None:
        at = (span.start - origin) / 1e6
        text = f"{'  ' * depth}{span.name} [{span.service}] {span.seconds * 1e3:.3f} ms"
        lines.append(f"{text} (at +{at:.3f} ms){' ERROR' if span.error else ''}")
        for child in children.get(span.span_id, []):
            add(child, depth + 1)

    for root in children.get("", []):
        add(root, 0)
    return lines
