"""Traces (coordkit.tracing, the otel extra): the spans a real OTLP exporter sends to a
receiver of the test's own (coordkit.tools.otlp), on both implementations.

* a request's tree through a real coordinator: the client's span, the engine's span a
  child of it (its traceparent carried in the params, taken out at the engine);
* the coordinator's spans, made from the records its loop keeps (and from records pushed
  by hand), children of the client's span or a trace of their own (a Megatron
  client's), timed by the loop's hooks, their status the request's end;
* sampling honoured (the client's sampler, the coordinator's ``trace_sample`` and the
  ``OTEL_*`` variables), and nothing on the wire, byte for byte, when not traced.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, Sampler, TraceIdRatioBased

from coordkit import Client, Coordinator, ErrorCode
from coordkit.engine import Engine, Request
from coordkit.protocol import packb
from coordkit.tools import cli
from coordkit.tools.otlp import ReceivedSpan, Receiver, tree
from coordkit.tracing import (
    CLIENT_GONE,
    MISSING_EXTRA,
    TRACEPARENT,
    TRACEPARENT_MARK,
    Sampling,
    TraceRecord,
    engine_span,
    sampling,
)
from tests.support.cluster import bind_address
from tests.support.peers import DISCONNECT, ERROR, REPLY, SUBMIT, SUBMIT_BATCH, m, um
from tests.support.processes import python_env
from tests.support.scripted import TIMEOUT, run, scripted
from tests.support.threads import fake_engines


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


@pytest.fixture
def provider(receiver: Receiver) -> Iterator[Callable[..., TracerProvider]]:
    """``provider(service, sampler=ALWAYS_ON)``: a tracer provider exporting to the
    receiver with a real OTLP/HTTP exporter; each shut down at teardown."""
    made: list[TracerProvider] = []

    def make(service: str, sampler: Sampler = ALWAYS_ON) -> TracerProvider:
        resource = Resource.create({"service.name": service})
        made.append(TracerProvider(sampler=sampler, resource=resource))
        exporter = OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")
        made[-1].add_span_processor(BatchSpanProcessor(exporter))
        return made[-1]

    yield make
    for each in made:
        each.shutdown()


def of(receiver: Receiver, service: str) -> list[ReceivedSpan]:
    return [span for span in receiver.spans() if span.service == service]


def traceparent_of(span: ReceivedSpan) -> str:
    """The traceparent naming ``span`` as the parent, but its flags."""
    return f"00-{span.trace_id}-{span.span_id}"


def named(traceparent: str) -> str:
    """A traceparent but its flags, which must say sampled."""
    head, flags = traceparent.rsplit("-", 1)
    assert int(flags, 16) & 1, traceparent
    return head


# -- the tree of a request -----------------------------------------------------------------


def test_client_span_is_the_parent_of_the_engine_span(receiver, provider, make_coordinator, impl):
    """Client -> coordinator -> FakeEngine: each request's engine span continues its
    client span's trace, through a real coordinator; a stream's ends with its final."""
    client_side = provider(f"client-{impl.name}")
    engine_side = provider(f"engine-{impl.name}")
    outer = client_side.get_tracer("test")

    async def body(address: str) -> None:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name, tracer_provider=client_side
        ) as client:
            await client.wait_for_engines(2, timeout=TIMEOUT)
            with outer.start_as_current_span("test"):
                replies = await asyncio.gather(*(client.submit([i, i]) for i in range(4)))
                parts = [part async for part in client.stream([9], {"max_tokens": 3})]
            await asyncio.gather(*client.submit_many([[7], [8]], {"output_tokens": 2}))
            assert all(reply["status"] == "finished" for reply in replies)
            assert parts[-1]["status"] == "finished" and len(parts) == 4

    with (
        make_coordinator() as coord,
        fake_engines(
            coord.address,
            2,
            output_tokens=4,
            implementation=impl.name,
            tracer_provider=engine_side,
        ),
    ):
        run(body(coord.address))
    client_side.force_flush()
    engine_side.force_flush()
    clients = of(receiver, f"client-{impl.name}")
    engines = of(receiver, f"engine-{impl.name}")
    (test,) = (span for span in clients if span.name == "test")
    requests = [span for span in clients if span.name != "test"]
    assert sorted(span.name for span in requests) == ["coordkit.stream"] + ["coordkit.submit"] * 6
    assert len(engines) == 7
    by_parent = {span.parent_id: span for span in engines}
    for span in requests:
        engine = by_parent[span.span_id]  # the engine's span is the request span's child
        assert engine.name == "fake-engine.request" and engine.trace_id == span.trace_id
        assert engine.attributes["coordkit.status"] == "finished"
        assert span.start <= engine.start and engine.end <= span.end
        # Under the test's span, but those of submit_many, made outside it.
        assert (span.parent_id == test.span_id) == (span.attributes["coordkit.request_id"] < 5)
    assert {span.attributes["coordkit.request_id"] for span in requests} == set(range(7))
    lines = tree(receiver.spans(), test.trace_id)
    assert lines[0].startswith("test [client-")
    assert sum("fake-engine.request" in line for line in lines) == 5


@pytest.mark.parametrize("batch", [True, False], ids=["batched", "single"])
def test_the_engine_gets_the_traceparent_out_of_the_params(
    receiver, provider, make_coordinator, impl, batch
):
    """Request.traceparent at an Engine, from a SUBMIT_BATCH's entries or SUBMIT_REQUESTs,
    and its sampling params the caller's own."""
    client_side = provider(f"traceparent-{impl.name}-{batch}")

    async def body(address: str, engine: Engine) -> list[Request]:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name, tracer_provider=client_side
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            futures = [client.submit([1], {"max_tokens": 3}), client.submit([2])]
            futures += client.submit_many([[3], [4]], {"top_k": 1})
            received: list[Request] = []
            while len(received) < 4:
                received += await asyncio.to_thread(engine.poll, 0.1)
            engine.reply([(request.server_rid, {"ok": 1}) for request in received])
            await asyncio.gather(*futures)
            return received

    with (
        make_coordinator() as coord,
        Engine(coord.address, implementation=impl.name, batch=batch) as engine,
    ):
        received = run(body(coord.address, engine))
    client_side.force_flush()
    spans = of(receiver, f"traceparent-{impl.name}-{batch}")
    by_id = {span.attributes["coordkit.request_id"]: span for span in spans}
    assert [r.sampling_params for r in received] == [{"max_tokens": 3}, {}] + [{"top_k": 1}] * 2
    for rid, request in enumerate(received):
        assert named(request.traceparent) == traceparent_of(by_id[rid])


def test_engine_span_continues_only_a_well_formed_trace(provider):
    tracer = provider("engine-span").get_tracer("test")
    parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    span = engine_span(SimpleNamespace(traceparent=parent, server_rid=5), tracer)
    assert span is not None and span.parent is not None
    assert (span.parent.trace_id, span.parent.span_id) == (int("ab" * 16, 16), int("cd" * 8, 16))
    assert span.get_span_context().trace_id == span.parent.trace_id
    span.end()
    for wrong in (None, "", "00-" + "0" * 32 + "-" + "cd" * 8 + "-01", parent.upper(), parent[:-1]):
        assert engine_span(SimpleNamespace(traceparent=wrong, server_rid=5), tracer) is None
    assert engine_span(SimpleNamespace(traceparent=parent, server_rid=5)) is None  # no provider


# -- sampling ------------------------------------------------------------------------------


def test_sampling_is_the_client_providers(receiver, provider, make_coordinator, impl):
    """A request the client's sampler drops carries nothing and makes no span; with a
    ratio, exactly the sampled ones are traced, to the engine."""

    async def body(address: str, traced: TracerProvider) -> list[str]:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name, tracer_provider=traced
        ) as client:
            await client.wait_for_engines(1, timeout=TIMEOUT)
            return list(await asyncio.gather(*(client.submit([i]) for i in range(40))))

    def answer(engine: Engine, stop: threading.Event) -> None:
        """Each request's reply: the traceparent it came with ("-": none)."""
        while not stop.is_set():
            requests = [e for e in engine.poll(0.05) if isinstance(e, Request)]
            assert all(TRACEPARENT not in r.sampling_params for r in requests)
            engine.reply([(r.server_rid, r.traceparent or "-") for r in requests])

    for name, sampler in (("off", ALWAYS_OFF), ("half", TraceIdRatioBased(0.5))):
        service = f"sampled-{name}-{impl.name}"
        traced = provider(service, sampler)
        stop = threading.Event()
        with make_coordinator() as coord, Engine(coord.address, implementation=impl.name) as e:
            thread = threading.Thread(target=answer, args=(e, stop))
            thread.start()
            try:
                carried = {named(b) for b in run(body(coord.address, traced)) if b != "-"}
            finally:
                stop.set()
                thread.join()
        traced.force_flush()
        spans = of(receiver, service)
        assert carried == {traceparent_of(span) for span in spans}
        assert 0 < len(spans) < 40 if name == "half" else not spans


def test_sampling_from_the_option_and_the_environment():
    assert sampling(None, {}) is None  # nothing asks
    assert sampling(0.0, {"OTEL_TRACES_SAMPLER": "always_on"}) is None  # the option wins
    assert sampling(0.01, {}) == Sampling(0.01, True)
    assert sampling(0.01, {}).every == 100
    assert sampling(0.3, {}).every == 3
    assert sampling(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:4318"}) == Sampling(1.0, True)
    env = {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"}
    assert sampling(None, env) == Sampling(0.25, False)
    env["OTEL_TRACES_SAMPLER"] = "parentbased_always_off"
    assert sampling(None, env) == Sampling(0.0, True)
    assert sampling(None, env).every == 0  # only what clients traced
    assert sampling(None, {"OTEL_TRACES_SAMPLER": "always_off"}) is None
    assert sampling(None, {"OTEL_TRACES_EXPORTER": "console"}) == Sampling(1.0, True)
    assert sampling(None, {"OTEL_TRACES_EXPORTER": "none", "OTEL_TRACES_SAMPLER": "x"}) is None
    assert sampling(None, {"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_SAMPLER": "x"}) is None
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER='sometimes'"):
        sampling(None, {"OTEL_TRACES_SAMPLER": "sometimes"})
    with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG must be"):
        sampling(None, {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"})
    with pytest.raises(ValueError, match="trace_sample must be"):
        sampling(1.5)


# -- the coordinator's spans ------------------------------------------------------------------


def test_coordinator_spans_from_the_loops_records(receiver, provider, tmp_path, impl, monkeypatch):
    """The records a loop pushes become coordkit.coordinator spans with route, engine and
    reply children, timed as recorded: in the client's trace when it carried one, a
    trace of their own when not (a Megatron client's), an ERROR status for a refusal."""
    client_side = provider(f"records-client-{impl.name}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", f"records-coordinator-{impl.name}")
    with client_side.get_tracer("test").start_as_current_span("coordkit.submit") as span:
        traceparent = f"00-{span.get_span_context().trace_id:032x}-"
        traceparent += f"{span.get_span_context().span_id:016x}-01"
    coord = Coordinator(
        bind_address("ipc", tmp_path, "records"),
        implementation=impl.name,
        trace_sample=0.5,
        trace_exporter=OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces"),
    )
    try:
        sink = coord.options.tracing
        assert sink is not None and (sink.every, sink.follow) == (2, True)
        t = time.monotonic()
        sink.push(TraceRecord(7, 0, b"c1", b"engine-0", t, t + 0.001, t + 0.003, t + 0.005,
                              t + 0.0051, 0, traceparent))  # fmt: skip
        sink.push(TraceRecord(8, 3, b"\x00k\x8b", b"engine-1", t, t + 0.002, None, t + 0.004,
                              t + 0.0042, 0, None))  # fmt: skip
        # A loop that keeps its records itself hands them over when the sink asks.
        sink.attach(lambda: [TraceRecord(9, 4, b"c1", None, t, None, None, None, t + 0.0001,
                                         ErrorCode.BUSY, traceparent)])  # fmt: skip
        sink.push(TraceRecord(10, 5, b"c1", b"engine-1", t, t + 0.001, None, None, t + 0.002,
                              CLIENT_GONE, None))  # fmt: skip
    finally:
        coord.stop()  # flushes what was pushed
    client_side.force_flush()
    spans = of(receiver, f"records-coordinator-{impl.name}")
    roots = sorted(
        (s for s in spans if s.name == "coordkit.coordinator"),
        key=lambda s: s.attributes["coordkit.server_rid"],
    )
    assert [s.attributes["coordkit.server_rid"] for s in roots] == [7, 8, 9, 10]
    traced, megatron, refused, left = roots
    (client,) = of(receiver, f"records-client-{impl.name}")
    assert (traced.trace_id, traced.parent_id) == (client.trace_id, client.span_id)
    assert megatron.parent_id == "" and megatron.trace_id != client.trace_id
    assert megatron.attributes["coordkit.client"] == "006b8b"  # as stats() shows it
    assert refused.parent_id == client.span_id and refused.error
    assert not traced.error and traced.attributes["coordkit.engine"] == "engine-0"

    def children(parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
        return {s.name: s for s in spans if s.parent_id == parent.span_id}

    def us(ns: int) -> int:
        return round(ns / 1e3)

    parts = children(traced)
    assert set(parts) == {"route", "engine", "reply"}
    assert us(parts["route"].end - parts["route"].start) == 1000
    assert us(parts["engine"].start - traced.start) == 1000
    assert us(parts["engine"].end - traced.start) == 5000
    assert parts["engine"].events == ("first reply",)
    assert us(parts["reply"].end - parts["reply"].start) == 100
    assert us(traced.end - traced.start) == 5100
    assert set(children(megatron)) == {"route", "engine", "reply"}
    assert children(megatron)["engine"].events == ()
    assert children(refused) == {}
    assert left.error and set(children(left)) == {"route", "engine"}  # no reply went back
    assert us(children(left)["engine"].end - left.start) == 2000


def test_coordinator_configured_by_the_environment(receiver, tmp_path, impl, monkeypatch):
    """No option, no provider: the OTEL_* variables turn tracing on and say where to."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.1")
    monkeypatch.setenv("OTEL_SERVICE_NAME", f"from-env-{impl.name}")
    coord = Coordinator(bind_address("ipc", tmp_path, "env"), implementation=impl.name)
    try:
        sink = coord.options.tracing
        assert sink is not None and (sink.every, sink.follow) == (10, True)
        t = time.monotonic()
        sink.push(TraceRecord(1, 0, b"c", b"e", t, t, t, t, t, 0, None))
    finally:
        coord.stop()
    (span,) = (s for s in of(receiver, f"from-env-{impl.name}") if s.parent_id == "")
    assert span.name == "coordkit.coordinator"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    with Coordinator(bind_address("ipc", tmp_path, "off"), implementation=impl.name) as coord:
        assert coord.options.tracing is None


def test_without_the_extra(tmp_path, impl, monkeypatch):
    """trace_sample without OpenTelemetry: one line saying what to install; only the
    environment asking: a warning, and no tracing."""
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(ImportError) as raised:
        Coordinator(bind_address("ipc", tmp_path, "a"), implementation=impl.name, trace_sample=1)
    assert str(raised.value) == MISSING_EXTRA
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")
    with Coordinator(bind_address("ipc", tmp_path, "b"), implementation=impl.name) as coord:
        assert coord.options.tracing is None


# -- the coordinator's spans, recorded by its loop --------------------------------------------

#: How far apart two processes' (here two threads') clocks may put the same instant: the
#: coordinator maps its monotonic clock to the wall clock once, at its start.
SKEW = 2_000_000  # ns


def coordinator_exporter(receiver: Receiver) -> OTLPSpanExporter:
    return OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> dict[str, ReceivedSpan]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


def test_coordinator_spans_join_the_clients_trees(
    receiver, provider, make_coordinator, impl, monkeypatch
):
    """Client -> coordinator (route, engine, reply) beside the engine's span, for submit,
    stream and submit_many: every request traced (trace_sample=1), each coordkit.coordinator
    span a child of its client span, inside it, the engine's span inside its engine child."""
    client_side = provider(f"tree-client-{impl.name}")
    engine_side = provider(f"tree-engine-{impl.name}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", f"tree-coordinator-{impl.name}")

    async def body(address: str) -> None:
        async with await Client.connect(
            address, timeout=TIMEOUT, implementation=impl.name, tracer_provider=client_side
        ) as client:
            await client.wait_for_engines(2, timeout=TIMEOUT)
            await asyncio.gather(*(client.submit([i, i]) for i in range(4)))
            parts = [part async for part in client.stream([9], {"max_tokens": 3})]
            await asyncio.gather(*client.submit_many([[7], [8]], {"output_tokens": 2}))
            assert len(parts) == 4

    coord = make_coordinator(trace_sample=1.0, trace_exporter=coordinator_exporter(receiver))
    with (
        coord,
        fake_engines(
            coord.address, 2, output_tokens=4, implementation=impl.name, tracer_provider=engine_side
        ),
    ):
        run(body(coord.address))
    # Closed: what it traced is exported (the exporter given is flushed).
    client_side.force_flush()
    engine_side.force_flush()
    requests = of(receiver, f"tree-client-{impl.name}")
    engines = {s.parent_id: s for s in of(receiver, f"tree-engine-{impl.name}")}
    spans = of(receiver, f"tree-coordinator-{impl.name}")
    roots = [s for s in spans if s.name == "coordkit.coordinator"]
    assert len(requests) == len(roots) == len(engines) == 7
    by_parent = {s.parent_id: s for s in roots}
    for request in requests:
        root = by_parent[request.span_id]  # the coordinator's span is the request's child
        assert root.trace_id == request.trace_id and not root.error
        assert root.attributes["coordkit.client_rid"] == request.attributes["coordkit.request_id"]
        assert request.start - SKEW <= root.start <= root.end <= request.end + SKEW
        parts = children(spans, root)
        assert set(parts) == {"route", "engine", "reply"}
        route, at_engine, reply = parts["route"], parts["engine"], parts["reply"]
        assert root.start == route.start <= route.end == at_engine.start
        assert at_engine.end == reply.start <= reply.end == root.end
        assert at_engine.events == ("first reply",)
        engine = engines[request.span_id]  # the engine's span: the request's child too
        assert engine.attributes["coordkit.server_rid"] == root.attributes["coordkit.server_rid"]
        assert at_engine.start - SKEW <= engine.start <= engine.end <= at_engine.end + SKEW
        assert root.attributes["coordkit.engine"] in ("engine-0", "engine-1")


def test_a_megatron_clients_requests_are_traces_of_their_own(
    receiver, make_cluster, impl, monkeypatch
):
    """A single-frame client carries no trace context (a traceparent in its params is
    not looked for): its traced requests are root coordkit.coordinator spans."""
    monkeypatch.setenv("OTEL_SERVICE_NAME", f"megatron-coordinator-{impl.name}")
    with make_cluster(
        dialect="megatron-core", trace_sample=1.0, trace_exporter=coordinator_exporter(receiver)
    ) as c:
        engine = c.add_single_frame_engine()
        client = c.single_frame_client()
        parent = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
        for rid in range(3):
            client.submit(rid, [1, 2, 3], {"max_tokens": 1, "traceparent": parent})
        for _ in range(3):
            server_rid, _, _ = engine.recv_submit()
            engine.reply({"request_id": server_rid, "status": "finished"})
        assert sorted(client.recv_reply()[0] for _ in range(3)) == [0, 1, 2]
    spans = of(receiver, f"megatron-coordinator-{impl.name}")
    roots = [s for s in spans if s.name == "coordkit.coordinator"]
    assert sorted(s.attributes["coordkit.client_rid"] for s in roots) == [0, 1, 2]
    for root in roots:
        assert root.parent_id == "" and root.trace_id != "ab" * 16 and not root.error
        assert set(children(spans, root)) == {"route", "engine", "reply"}
        assert root.attributes["coordkit.engine"] == "engine-0"


def traced_rids(receiver: Receiver, service: str) -> dict[int, ReceivedSpan]:
    return {
        s.attributes["coordkit.client_rid"]: s
        for s in of(receiver, service)
        if s.name == "coordkit.coordinator"
    }


@pytest.mark.parametrize("follow", [True, False], ids=["parentbased", "ratio"])
def test_the_coordinator_samples_one_in_every_and_follows_the_clients(
    receiver, make_cluster, impl, monkeypatch, follow
):
    """trace_sample=0.25: one untraced request in 4 (the 4th, the 8th...), and every
    request whose params carry a traceparent, in its trace, not counted among the others.
    OTEL_TRACES_SAMPLER=traceidratio: one in 4 of them all, regardless of their clients;
    one of those that carries a traceparent still joins its trace."""
    service = f"sampled-coordinator-{impl.name}-{follow}"
    monkeypatch.setenv("OTEL_SERVICE_NAME", service)
    options: dict[str, Any] = {"trace_exporter": coordinator_exporter(receiver)}
    if follow:
        options["trace_sample"] = 0.25
    else:
        monkeypatch.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
        monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    traced = "00-" + "12" * 16 + "-" + "34" * 8 + "-01"
    with make_cluster(**options) as c:
        engine = c.add_engine()
        client = c.client(coordkit=True)
        for rid in range(12):
            params = {"traceparent": traced} if rid in (3, 6) else {"n": rid}
            client.send(m([SUBMIT, rid, params]), m([rid]))
        for _ in range(12):
            frames = engine.recv()
            engine.send(m([REPLY, [[um(frames[0])[1], False]]]), m("done"))
        assert len(client.recv_all()) == 12
    spans = traced_rids(receiver, service)
    if follow:  # the 4th and the 8th of the ten without a traceparent, and both with one
        assert sorted(spans) == [3, 4, 6, 9]
    else:  # the 4th, 8th and 12th of them all
        assert sorted(spans) == [3, 7, 11]
    for rid, span in spans.items():
        assert (span.trace_id == "12" * 16) == (rid in (3, 6))
        assert (span.parent_id == "34" * 8) == (rid in (3, 6))


def test_the_end_of_a_request_is_its_spans_status(receiver, make_cluster, impl, monkeypatch):
    """NO_ENGINES after acceptance: a root alone, ERROR; TIMED_OUT at its engine: route and
    engine (no reply); its client gone (DISCONNECT): "client gone"; a final: no error."""
    service = f"ends-coordinator-{impl.name}"
    monkeypatch.setenv("OTEL_SERVICE_NAME", service)
    with make_cluster(
        trace_sample=1.0, trace_exporter=coordinator_exporter(receiver), request_timeout=0.3
    ) as c:
        client = c.client(coordkit=True)
        client.send(m([SUBMIT, 0, {}]), m([0]))  # no engine yet
        assert um(client.recv()[0])[:3] == [ERROR, 0, ErrorCode.NO_ENGINES]
        engine = c.add_engine()
        client.send(m([SUBMIT, 1, {}]), m([1]))  # never answered: timed out
        engine.recv()
        assert um(client.recv(timeout=5)[0])[:3] == [ERROR, 1, ErrorCode.TIMED_OUT]
        engine.recv()  # its ABORT
        client.send(m([SUBMIT, 2, {}]), m([2]))  # answered
        server_rid = um(engine.recv()[0])[1]
        engine.send(m([REPLY, [[server_rid, False]]]), m("done"))
        assert um(client.recv()[0]) == [REPLY, 2]
        gone = c.client(coordkit=True)
        gone.send(m([SUBMIT, 3, {}]), m([3]))  # its client leaves first
        engine.recv()
        gone.send(m([DISCONNECT]))
        engine.recv()  # the ABORT of the request it left
    spans = of(receiver, service)
    ends = traced_rids(receiver, service)
    refused, timed_out, answered = ends[0], ends[1], ends[2]
    # Both clients number from 0: the one that left has client rid 3 (the other's 3 none).
    left = ends[3]
    assert refused.error and refused.status == "NO_ENGINES" and children(spans, refused) == {}
    assert timed_out.error and timed_out.status == "TIMED_OUT"
    assert set(children(spans, timed_out)) == {"route", "engine"}
    assert not answered.error and set(children(spans, answered)) == {"route", "engine", "reply"}
    assert left.error and left.status == "client gone"
    assert set(children(spans, left)) == {"route", "engine"}


# -- nothing on the wire when not traced ----------------------------------------------------


@pytest.mark.parametrize("grant", [False, True], ids=["single", "batched"])
def test_untraced_frames_are_byte_for_byte_what_they_were(tmp_path, impl, grant, provider):
    """A client without a provider, and one whose sampler samples nothing, send the same
    bytes; a sampled request's params differ by the traceparent alone, found by its mark."""
    params = {"temperature": 0.5}

    async def frames(**kwargs: Any) -> list[list[bytes]]:
        async with scripted(tmp_path, impl, grant=grant, **kwargs) as (script, client):
            client.submit([1, 2], params)
            client.stream([3], params)
            client.submit_many([[4], [5]], params)
            # Batched: what coalesced, then submit_many's own batch.
            return [await script.recv() for _ in range(2 if grant else 4)]

    plain = run(frames())
    assert plain == run(frames(tracer_provider=provider("never", ALWAYS_OFF)))
    streamed = {**params, "stream": True}
    if grant:
        assert plain[0][0] == packb([SUBMIT_BATCH, [[0, params, False], [1, streamed, False]]])
        assert plain[1][0] == packb([SUBMIT_BATCH, [[2, params, False], [3, params, False]]])
    else:
        assert [frames[0] for frames in plain] == [
            packb([SUBMIT, rid, p]) for rid, p in enumerate([params, streamed, params, params])
        ]
    traced = run(frames(tracer_provider=provider("always")))
    assert len(traced) == len(plain)
    for before, after in zip(plain, traced, strict=True):
        assert TRACEPARENT_MARK not in before[0]
        assert after[0].count(TRACEPARENT_MARK) == (2 if grant else 1)
        assert after[1:] == before[1:]  # the prompts


def test_importing_coordkit_imports_no_opentelemetry():
    code = (
        "import sys, coordkit, coordkit.client, coordkit.engine, coordkit.tracing;"
        "from coordkit.tools import fake_engine;"
        "from coordkit.tracing import tracer_of;"
        "assert tracer_of() is None;"
        "assert not [m for m in sys.modules if m.startswith('opentelemetry')], sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], env=python_env(), check=True, timeout=60)


def test_the_mark_is_the_packed_key_and_the_head_of_its_value():
    assert TRACEPARENT == "traceparent"
    assert TRACEPARENT_MARK == packb({TRACEPARENT: "0" * 55})[1:15]


# -- the commands ------------------------------------------------------------------------


def test_serve_takes_trace_sample(monkeypatch, capsys):
    """``coordkit serve --trace-sample P`` is Coordinator(trace_sample=P); a bad P, or no
    otel extra, is one line and exit status 2."""
    made: list[dict[str, Any]] = []

    def coordinator(*args: Any, **options: Any) -> Any:
        made.append(options)
        return Coordinator(*args, **options)

    monkeypatch.setattr(cli, "Coordinator", coordinator)
    bind = ["serve", "--bind", "tcp://127.0.0.1:0", "--implementation", "py"]
    assert cli.main([*bind, "--trace-sample", "2"]) == 2
    assert made[-1]["trace_sample"] == 2.0
    assert capsys.readouterr().err == (
        "coordkit serve: trace_sample must be a number between 0 and 1, not '2.0'\n"
    )
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    assert cli.main([*bind, "--trace-sample", "0.5"]) == 2
    assert made[-1]["trace_sample"] == 0.5
    assert (
        capsys.readouterr().err == f"coordkit serve: {MISSING_EXTRA.removeprefix('coordkit: ')}\n"
    )
