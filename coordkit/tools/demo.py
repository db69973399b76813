"""``coordkit demo``: a local cluster under a client load, and its results table.

Each run is a cluster of its own on ipc sockets in a temporary directory: the
coordinator on a thread of this process, ``coordkit fake-engine`` processes,
and an asyncio client keeping ``--concurrency`` requests in flight. The table
has one column per run; ``--compare-policies`` runs one cluster per policy, and
``--pd`` one aggregated, one disaggregated and one conditionally disaggregated
(:mod:`coordkit.tools.pd`), streaming, with their time to first token and
inter-token latency. :mod:`coordkit.tools.cli` parses the options.

``--trace-sample P`` traces that share of the requests (the otel extra): the client,
the coordinator and the engines export their spans to a receiver of the demo's own
(:mod:`coordkit.tools.otlp`), and the demo prints the slowest traced request's tree;
with ``OTEL_EXPORTER_OTLP_ENDPOINT`` set, they go there instead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from .. import Coordinator, Implementation
from ..client import Client, CoordinatorError
from ..tracing import span_exporters, tracer_provider
from .engines import fake_engine_processes
from .pd import PDRun, coordinator_options, pd_runs

__all__ = ["run", "COMPARED_POLICIES", "SUFFIX_TOKENS"]

COMPARED_POLICIES = ("least_loaded", "prefix")
SUFFIX_TOKENS = 32  # the unique part of a shared-prefix prompt: a short user turn
_WORKLOAD_SEED = 0  # every run draws the same prefixes in the same order
_ROUTER_OPTIONS = ("prefix_prefill_weight", "prefix_decode_tokens")  # None: the default
_REQUEST_SPANS = ("coordkit.submit", "coordkit.stream")  # the client's spans


@dataclass
class _Results:
    pd: PDRun | None = None  # --pd: which of its clusters
    latencies: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)  # streaming: to the first part
    itl: list[float] = field(default_factory=list)  # streaming: per request, first to last
    ranks: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    cached_blocks: int = 0
    prompt_blocks: int = 0
    start: float = 0.0
    end: float = 0.0
    interrupted: bool = False


class _Progress:
    """A tqdm bar if tqdm is installed, else a line on stderr at most once a second."""

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self._last_line = time.monotonic()
        try:
            from tqdm import tqdm
        except ImportError:
            self._bar = None
        else:
            self._bar = tqdm(total=total, unit="req", desc="coordkit demo", file=sys.stderr)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update()
        elif time.monotonic() - self._last_line >= 1.0 or self.done == self.total:
            self._last_line = time.monotonic()
            print(f"coordkit demo: {self.done}/{self.total} requests", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


@dataclass
class _Traces:
    """Where a traced demo's processes send their spans, and the providers of its own."""

    env: dict[str, str]  # the engine processes' OTEL_* variables
    client: Any  # the client's tracer provider
    coordinator: Any  # the coordinator's span exporter
    receiver: Any  # a coordkit.tools.otlp.Receiver, or None: an endpoint of the user's


@contextlib.contextmanager
def _traced(args: argparse.Namespace) -> Iterator[_Traces | None]:
    """With --trace-sample: the providers, and the receiver unless the environment names
    an OTLP endpoint; their spans flushed on exit."""
    if args.trace_sample is None:
        yield None
        return
    from .otlp import Receiver

    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    with contextlib.ExitStack() as stack:
        receiver = None
        if not endpoint:
            receiver = stack.enter_context(Receiver())
            endpoint = receiver.endpoint
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_TRACES_EXPORTER": "otlp"}
        environ = {**os.environ, **env}
        client = tracer_provider("coordkit-demo", args.trace_sample, environ=environ)
        stack.callback(client.shutdown)
        (coordinator,) = span_exporters(environ)
        stack.callback(coordinator.shutdown)
        yield _Traces(env, client, coordinator, receiver)


def run(impl: Implementation, args: argparse.Namespace) -> int:
    """Run the load on ``impl``'s coordinator, one cluster per policy (or per --pd
    run), and print the table."""
    policies = COMPARED_POLICIES if args.compare_policies else (args.policy,)
    plan: list[tuple[str, PDRun | None]] = [(policy, None) for policy in policies]
    if args.pd:
        if args.compare_policies:
            raise ValueError("--pd runs one policy (--policy), not --compare-policies")
        clusters = pd_runs(args.engines, args.prefill_engines, args.pd_threshold)
        for each in clusters:
            coordinator_options(each)  # a coordinator that does not run P/D: said at once
        plan = [(args.policy, each) for each in clusters]
        args.stream = True  # their times to first token
    prompt = _workload(args)
    runs: dict[str, _Results] = {}
    with _traced(args) as traces:
        for policy, cluster in plan:
            runs[policy if cluster is None else cluster.label] = results = _Results(cluster)
            try:
                _run_cluster(impl, policy, prompt, args, results, traces)
            except (ConnectionError, TimeoutError) as exc:
                print(f"coordkit demo: {exc}", file=sys.stderr)
                return 1
            if results.interrupted:
                break
        if traces is not None:
            traces.client.force_flush()
    _print_results(args, impl.name, runs)
    if traces is not None:
        _print_trace(traces)
    return 0


def _print_trace(traces: _Traces) -> None:
    """The tree of the slowest request the client traced (its engine's span may come
    last: the engine processes export theirs as they exit)."""
    from .otlp import tree

    if traces.receiver is None:
        print(f"traces sent to {traces.env['OTEL_EXPORTER_OTLP_ENDPOINT']}")
        return
    requests = [s for s in traces.receiver.spans() if s.name in _REQUEST_SPANS]
    if not requests:
        print("no request was traced")
        return
    slowest = max(requests, key=lambda span: span.seconds)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and not any(
        s.trace_id == slowest.trace_id and s.service != slowest.service
        for s in traces.receiver.spans()
    ):
        time.sleep(0.05)
    print(f"traced {len(requests)} requests; the slowest, trace {slowest.trace_id}:")
    for line in tree(traces.receiver.spans(), slowest.trace_id):
        print(f"  {line}")


def _workload(args: argparse.Namespace) -> Callable[[int], list[int]]:
    """Request ``i``'s prompt: the same in every run, so that runs compare."""
    if args.shared_prefixes is None:
        # A few distinct prompts, so that prefix routing has something to be affine to.
        prompts = [[k * 1000 + j for j in range(args.prompt_tokens)] for k in range(8)]
        return lambda i: prompts[i % len(prompts)]
    count, length = args.shared_prefixes, args.prefix_tokens
    prefixes = [list(range(k * length, (k + 1) * length)) for k in range(count)]
    # Drawn at random, not in turn: least_loaded rotates over the ranks, so prefixes in
    # turn could each land on one rank by accident, as if routed by prefix.
    rng = random.Random(_WORKLOAD_SEED)
    draws = [rng.randrange(count) for _ in range(args.requests)]

    def prompt(i: int) -> list[int]:
        # Suffix tokens occur in no prefix and no other suffix: their blocks never hit.
        suffix = count * length + i * SUFFIX_TOKENS
        return prefixes[draws[i]] + list(range(suffix, suffix + SUFFIX_TOKENS))

    return prompt


def _run_cluster(
    impl: Implementation,
    policy: str,
    prompt: Callable[[int], list[int]],
    args: argparse.Namespace,
    results: _Results,
    traces: _Traces | None,
) -> None:
    """Run the load on a cluster of its own, so that every run starts with cold caches."""
    with tempfile.TemporaryDirectory(prefix="coordkit-demo-") as tmp:
        address = f"ipc://{tmp}/coordinator.sock"
        options = {k: getattr(args, k) for k in _ROUTER_OPTIONS if getattr(args, k) is not None}
        if results.pd is not None:
            options.update(coordinator_options(results.pd))
        if traces is not None:
            options.update(trace_sample=args.trace_sample, trace_exporter=traces.coordinator)
        if args.kv_events:  # the engines announce their publishers at their hello
            options.update(kv_events={})
        coord = Coordinator(address, implementation=impl.name, policy=policy, **options)
        coord.start()
        env = traces.env if traces is not None else None
        client = traces.client if traces is not None else None
        roles = () if results.pd is None else results.pd.roles
        try:
            with fake_engine_processes(
                address, args.engines, _engine_options(args), roles, env
            ) as engines:
                load = _run_load(address, policy, prompt, args, results, engines, client)
                asyncio.run(load)
        except KeyboardInterrupt:
            results.interrupted = True
        finally:
            coord.stop()


def _engine_options(args: argparse.Namespace) -> list[str]:
    return ["--kv-events"] * args.kv_events + [
        "--latency",
        str(args.latency),
        "--output-tokens",
        str(args.output_tokens),
        "--cache-blocks",
        str(args.cache_blocks),
        "--prefix-block-size",
        str(args.block_size),
        "--cost-model",
        args.cost_model,
    ]


async def _run_load(
    address: str,
    policy: str,
    prompt: Callable[[int], list[int]],
    args: argparse.Namespace,
    results: _Results,
    engines: list[subprocess.Popen[bytes]],
    tracer_provider: Any,
) -> None:
    # With shared prefixes every policy gets the hashes, so that runs differ in routing only.
    hashed = policy == "prefix" or args.shared_prefixes is not None
    block_size = args.block_size if hashed else None
    async with await Client.connect(
        address, timeout=10.0, tracer_provider=tracer_provider
    ) as client:
        try:
            await client.wait_for_engines(args.engines, timeout=30.0)
        except TimeoutError as exc:
            codes = [engine.poll() for engine in engines]
            raise TimeoutError(f"{exc} (engine exit codes: {codes})") from None
        progress = _Progress(args.requests)
        indices = iter(range(args.requests))  # shared by the workers

        async def worker() -> None:
            for i in indices:
                tokens = prompt(i)
                sent = time.perf_counter()
                first = None
                try:
                    if args.stream:
                        async for part in client.stream(tokens, block_size=block_size):
                            first = first or time.perf_counter()
                            reply = part  # the last one is the final
                    else:
                        reply = await client.submit(tokens, block_size=block_size)
                except CoordinatorError as exc:
                    results.errors[getattr(exc.code, "name", str(exc.code))] += 1
                else:
                    done = time.perf_counter()
                    results.latencies.append(done - sent)
                    if first is not None:
                        results.ttft.append(first - sent)
                        if args.output_tokens > 1:
                            results.itl.append((done - first) / (args.output_tokens - 1))
                    results.ranks[reply["rank"]] += 1
                    results.cached_blocks += reply.get("cached_blocks", 0)
                    results.prompt_blocks += reply.get("prompt_blocks", 0)
                progress.update()
                results.end = time.perf_counter()

        results.start = time.perf_counter()
        try:
            await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        finally:
            progress.close()


def _print_results(
    args: argparse.Namespace, implementation: str, runs: dict[str, _Results]
) -> None:
    """The results table, with one column of values per run (policy)."""
    ranks = sorted({rank for results in runs.values() for rank in results.ranks})
    columns = []
    for policy, results in runs.items():
        rows = _rows(args, implementation, policy, results)
        rows.update((f"rank {rank}", str(results.ranks[rank])) for rank in ranks)
        columns.append(rows)
    name_width = max(16, *(len(name) + 2 for name in columns[0]))
    value_width = max(len(value) for rows in columns for value in rows.values()) + 2
    print("coordkit demo results")
    for name in columns[0]:
        *values, last = (rows[name] for rows in columns)
        print(f"  {name:<{name_width}}" + "".join(f"{v:<{value_width}}" for v in values) + last)


def _rows(
    args: argparse.Namespace, implementation: str, policy: str, results: _Results
) -> dict[str, str]:
    done = len(results.latencies)
    wall = max(results.end - results.start, 1e-9)
    latencies = sorted(results.latencies)
    requests = f"{done} of {args.requests}" + (" (interrupted)" if results.interrupted else "")
    errors = ", ".join(f"{n} {code}" for code, n in results.errors.items()) or "none"
    if args.shared_prefixes is None:
        prompts = {"prompt tokens": str(args.prompt_tokens)}
    else:
        prompts = {
            "prompt tokens": str(args.prefix_tokens + SUFFIX_TOKENS),
            "shared prefixes": f"{args.shared_prefixes} ({args.prefix_tokens} tokens each)",
        }
    rows = {
        "implementation": implementation,
        "policy": policy if results.pd is None else f"{args.policy}, {policy}",
        "engines": str(args.engines),
        "requests": requests,
        "errors": errors,
        **prompts,
        "streaming": "yes" if args.stream else "no",
        "wall time": f"{wall:.2f} s",
        "requests/s": f"{done / wall:.0f}",
        "latency p50": _percentile_ms(latencies, 50),
        "latency p99": _percentile_ms(latencies, 99),
    }
    if args.stream:
        ttft, itl = sorted(results.ttft), sorted(results.itl)
        rows["TTFT p50"], rows["TTFT p99"] = _percentile_ms(ttft, 50), _percentile_ms(ttft, 99)
        rows["ITL p50"], rows["ITL p99"] = _percentile_ms(itl, 50), _percentile_ms(itl, 99)
    if args.shared_prefixes is not None or args.compare_policies:
        rows["prefix cache"] = f"{args.cache_blocks} blocks of {args.block_size} tokens"
        rows["prefix cache hit rate"] = _hit_rate(results)
        rows["prefix index"] = "the engines' KV events" if args.kv_events else "guessed"
    return rows


def _hit_rate(results: _Results) -> str:
    if not results.prompt_blocks:
        return "-"
    return f"{100 * results.cached_blocks / results.prompt_blocks:.1f}% of prompt blocks"


def _percentile_ms(ordered: list[float], p: float) -> str:
    if not ordered:
        return "-"
    index = max(math.ceil(p / 100 * len(ordered)) - 1, 0)  # nearest rank
    return f"{ordered[index] * 1000:.1f} ms"
