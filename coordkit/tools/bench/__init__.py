"""``coordkit bench``: the coordinator process's own CPU time per request, side by side.

Every variant runs in its own process, with one client process and one engine
process (``RANKS`` engine ranks) as lean raw-pyzmq load generators:

* ``floor`` -- libzmq's ``zmq.proxy`` between a ROUTER (clients) and a DEALER
  (engines) carrying the same frames; no decoding, no state: this machine's limit;
* ``c`` / ``py`` -- the Cython and the reference coordinator, on the
  multipart protocol (:mod:`coordkit.protocol`); ``c-metrics`` -- ``c``
  serving Prometheus metrics, its latency histograms kept;
* ``mono`` -- the design before the split, Megatron-Core 0.19's: one msgpack
  message per request, unpacked and repacked whole by a Python loop
  (:class:`.servers._Mono`);
* ``c-queued`` (by name only) -- ``c`` with a cap per engine rank
  (``workload.QUEUED_CAPACITY``) well under the client's window: nearly every request
  waits in the coordinator's queue, then is dispatched (the cost per queued request);
* ``c-trace-1``, ``c-trace-100`` (by name only, the otel extra) -- ``c`` tracing 1%
  and 100% of its requests (``trace_sample``), its spans exported over OTLP/HTTP to a
  receiver in the bench's own process (or to ``OTEL_EXPORTER_OTLP_ENDPOINT``): the
  coordinator's CPU then includes making and exporting them;
* ``c-kv-events`` (by name only) -- ``c`` reading each engine rank's KV-cache events
  (vLLM's wire format, the publishers named as ``serve --kv-events`` names them), which
  the engine process publishes as if every prompt missed its cache (:mod:`.kvevents`).

``--dialect megatron-core`` makes every variant's load speak Megatron-Core's
single frames (``c``, ``py`` serving them with ``dialect="megatron-core"``):
0.19's, or with ``--megatron-version main`` main's (the five-field SUBMIT, c and
py with ``megatron_version="main"``, mono decoding and re-encoding all five).

The prompts cross every size threshold of the loop: besides random token ids
of 16 to 32 000 tokens, small ids (``list(range(n))``, which pack smaller)
and, computed from the packing, lengths whose frame sits just below and just
above each of ``workload.THRESHOLDS`` (a kept prompt copied or shared, a
forwarded one from malloc or the buffer pool); each point is labelled by its
tokens and bytes.

For each prompt the client first warms the path up, then the bench
reads the coordinator's ``getrusage`` (user and sys, all its threads,
libzmq's I/O thread included) right before the load and right after its last
reply: CPU time, not wall time, is the figure, because the load generators
share the cores. The memory test holds requests in flight at the engines and
reads the coordinator's VmRSS before and with them. Linux only (/proc).

``--client`` and ``--end-to-end`` measure the endpoints instead
(:mod:`.endpoints`): a client process's own CPU per request, coordkit's
Client beside a plain pyzmq client doing what Megatron-LM's does; and a whole
deployment (client, coordinator, two engine ranks, each its own process),
its requests per second and every process's CPU per request.

``--latency`` (:mod:`.latency`) measures the latency each variant adds under
open-loop Poisson load, up to its saturation and past it; ``--scale``
(:mod:`.scale`) the cost per request against the number of engines and of
clients; ``--failover`` (:mod:`.failover`) what a coordinator's SIGKILL costs
the requests in flight, with a restart at the same address or a standby
taking over through an etcd lease; ``--fairness`` (:mod:`.fairness`) how the
coordinator's queue shares fake engines of a fixed capacity among tenants under
overload.

Here: the options, the points in order and the results. :mod:`.session`
starts and drives a variant's processes, :mod:`.servers` is the coordinator
child, :mod:`.load` the client and engine children, :mod:`.endpoints`,
:mod:`.latency`, :mod:`.scale`, :mod:`.failover` and :mod:`.fairness` the other modes,
:mod:`.report` the summaries, tables, JSON records and plots (``--fairness`` its own);
:mod:`.workload` holds what they share.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ..._policies import POLICIES
from ..._shared import DIALECTS
from ...election import DEFAULT_TTL
from ..options import Parser
from . import endpoints, failover, fairness, latency, pd, report, scale
from .latency import LATENCY_LENGTHS, LATENCY_VARIANTS
from .session import Failure, Session, run_interleaved
from .workload import (
    DEFAULT_VARIANTS,
    IMPLEMENTATIONS,
    LENGTHS,
    MEGATRON_LENGTHS,
    REQUIRES,
    SUBMIT_FIELDS,
    TRACE_SAMPLES,
    VARIANTS,
    WORKLOADS,
    Prompt,
    megatron_prompts,
    parse_prompt,
    standard_prompts,
)

__all__ = ["main", "VARIANTS", "LENGTHS", "IMPLEMENTATIONS", "standard_prompts"]


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    started = time.monotonic()
    environment = report.environment(args)
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > cpus / 2:
        print(
            f"coordkit bench: warning: load average {load:.1f} on {cpus} CPUs; "
            "other processes will disturb the figures",
            file=sys.stderr,
        )
    runs: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    client_runs: list[dict[str, Any]] = []
    end_to_end_runs: list[dict[str, Any]] = []
    latency_result: dict[str, Any] = {}
    scale_runs: list[dict[str, Any]] = []
    failover_runs: list[dict[str, Any]] = []
    fairness_result: dict[str, Any] = {}
    pd_runs: list[dict[str, Any]] = []
    failures: dict[str, str] = {}
    interrupted = False
    with (
        tempfile.TemporaryDirectory(prefix="coordkit-bench-") as directory,
        _trace_receiver(args.variants),
    ):
        try:
            if args.cost:
                _measure_cpu(args, directory, runs, failures)
                _measure_memory(args, directory, memory, failures)
            if args.client:
                endpoints.measure_clients(args, directory, client_runs, failures)
            if args.end_to_end:
                endpoints.measure_end_to_end(args, directory, end_to_end_runs, failures)
            if args.latency:
                latency.measure_latency(args, directory, latency_result, failures)
            if args.scale:
                scale.measure_scale(args, directory, scale_runs, failures)
            if args.failover:
                failover.measure_failover(args, directory, failover_runs, failures)
            if args.fairness:
                fairness.measure_fairness(args, directory, fairness_result, failures)
            if args.pd:
                pd.measure_pd(args, directory, pd_runs, failures)
        except KeyboardInterrupt:
            interrupted = True
            print("coordkit bench: interrupted; reporting what was measured", file=sys.stderr)
    summary = report.summarize(runs)
    report.print_cpu(args, summary)
    report.print_memory(memory)
    client_summary = endpoints.summarize(
        client_runs, ("client_us", "client_main_us", "requests_per_s")
    )
    report.print_clients(args, client_summary)
    end_to_end_keys = ("requests_per_s", "client_us", "coordinator_us", "engines_us", "reply_batch")
    end_to_end_summary = endpoints.summarize(end_to_end_runs, end_to_end_keys)
    report.print_end_to_end(args, end_to_end_summary)
    report.print_latency(args, latency_result)
    scale_rows = scale.summarize(scale_runs)
    report.print_scale(args, scale_rows)
    failover_rows = failover.summarize(failover_runs)
    report.print_failover(args, failover_rows)
    fairness.print_fairness(fairness_result)
    pd_rows = pd.summarize(pd_runs)
    pd.print_pd(args, pd_rows)
    for variant, reason in failures.items():
        print(f"FAILED {variant}: {reason}")
    if args.json:
        result: dict[str, Any] = {
            "environment": environment,
            "config": report.config(args),
            "failures": failures,
            "seconds": round(time.monotonic() - started, 1),
        }
        if args.cost:
            result.update(runs=runs, summary=summary, memory=memory)
        if args.client:
            result["client"] = {
                "runs": client_runs,
                "summary": report.keyed(client_summary),
            }
        if args.end_to_end:
            result["end_to_end"] = {
                "runs": end_to_end_runs,
                "summary": report.keyed(end_to_end_summary),
            }
        if args.latency:
            result["latency"] = latency_result
        if args.scale:
            result["scale"] = {"runs": scale_runs, "summary": scale_rows}
        if args.failover:
            result["failover"] = {"runs": failover_runs, "summary": failover_rows}
        if args.fairness:
            result["fairness"] = fairness_result
        if args.pd:
            result["pd"] = {"runs": pd_runs, "summary": pd_rows}
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        if args.fairness:
            fairness.plot_fairness(fairness_result, Path(args.plot))
        elif args.latency:
            if latency_result.get("points"):
                report.plot_latency(args, latency_result, Path(args.plot))
        elif summary:
            report.plot(args, summary, Path(args.plot))
    return 130 if interrupted else 1 if failures else 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="coordkit bench",
        description="Coordinator CPU time per request (user and sys of its own process) "
        "and memory per request in flight, for floor, c, py and mono side by side; "
        "with --client, --end-to-end, --latency, --scale, --failover or --fairness, those "
        "measures instead "
        "(any of them in one run).",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="standard",
        help="the cost table's load: standard (full reply batches of 8, every threshold's "
        "prompts) or megatron (as Megatron's peers make it: one client, replies at once "
        "in batches of up to 16; prompts of "
        f"{' '.join(map(str, MEGATRON_LENGTHS))} random and small ('range') ids and "
        "either side of every threshold, each with small (~200 B) and realistic (~1.5 KB: "
        "log probs and per-token times) bodies; 40000 requests after 10000 of warm-up, "
        "variants floor c, 3 repetitions) (default standard)",
    )
    modes = parser.add_argument_group("modes (default: the coordinator cost table)")
    modes.add_argument(
        "--client",
        action="store_true",
        help="client process CPU per request: coordkit's Client beside a plain pyzmq client",
    )
    modes.add_argument(
        "--end-to-end",
        action="store_true",
        help="client, coordinator and two engine ranks as processes: requests/s and "
        "every process's CPU per request",
    )
    modes.add_argument(
        "--latency",
        action="store_true",
        help="client-observed latency under open-loop Poisson load, minus the same load's "
        "with no coordinator, from a tenth of each variant's saturation to past it: "
        "saturation rates and the choke curve (--plot)",
    )
    modes.add_argument(
        "--scale",
        action="store_true",
        help="coordinator CPU per request against the engine count and the client count, "
        "per policy and for the floor",
    )
    modes.add_argument(
        "--failover",
        action="store_true",
        help="the coordinator SIGKILLed with requests in flight, restarted or taken over by "
        "a standby: time from the kill to the first reply after it, the added p99 of the "
        "requests that crossed it, and every request's completion",
    )
    modes.add_argument(
        "--pd",
        action="store_true",
        help="coordinator CPU per disaggregated request (a prefill and a decode FakeEngine, "
        "pd_mode always) against the same requests run whole by two engines without a role",
    )
    modes.add_argument(
        "--fairness",
        action="store_true",
        help="tenants sharing fake engines of a fixed capacity under overload: a flood at "
        f"{fairness.FLOOD}x capacity beside a light tenant, weights 3:1, equal tenants, "
        "priorities; each held to its criterion (docs/queueing.md)",
    )
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=endpoints.CLIENT_VARIANTS,
        default=endpoints.CLIENT_VARIANTS,
        help=f"--client: the client variants (default {' '.join(endpoints.CLIENT_VARIANTS)})",
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=endpoints.PEERS,
        default=endpoints.PEERS,
        help="--client: what the clients talk to, a coordinator and an echo engine, "
        f"or a stand-in that grants batches (default {' '.join(endpoints.PEERS)})",
    )
    parser.add_argument(
        "--end-to-end-clients",
        nargs="+",
        choices=endpoints.END_TO_END_VARIANTS,
        default=endpoints.END_TO_END_VARIANTS,
        help="--end-to-end: the client variants "
        f"(default {' '.join(endpoints.END_TO_END_VARIANTS)})",
    )
    parser.add_argument(
        "--lengths",
        type=parse_prompt,
        nargs="+",
        metavar="TOKENS[:range][/BODY]",
        help="prompt lengths, random token ids unless ':range' (list(range(TOKENS))), "
        "answered with the workload's body unless '/small' or '/realistic'; "
        "default: the cost table's standard set (random 16 256 2000 8000 32000, range 16 "
        "2000, and lengths just below and above each size threshold of the loop, "
        "computed from the packing; --workload megatron's own), 16 2000 for --client, "
        "--end-to-end and --latency, 16 for --scale",
    )
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="measured requests per point up to 2000 tokens; longer prompts get "
        "proportionally fewer, at least N/8 (default 60000, --client 40000, "
        "--end-to-end 200000, --scale 100000; --quick 2000)",
    )
    parser.add_argument(
        "--repeat", type=int, metavar="N", help="repetitions; medians (default 5, --quick 1)"
    )
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        help=f"default: {' '.join(VARIANTS)}; --latency {' '.join(LATENCY_VARIANTS)}; "
        f"--scale floor c (of {' '.join(scale.SCALE_VARIANTS)})",
    )
    parser.add_argument(
        "--policy",
        choices=POLICIES,
        default="least_loaded",
        help="the routing policy of c and py (default least_loaded)",
    )
    parser.add_argument(
        "--dialect",
        choices=DIALECTS,
        default="multipart",
        help="the format every variant's load speaks: megatron-core is Megatron-Core "
        "0.19's single frame per message (mono speaks it in either) (default multipart)",
    )
    parser.add_argument(
        "--megatron-version",
        choices=tuple(SUBMIT_FIELDS),
        default="0.19",
        help="megatron-core: the release whose layouts the load speaks, main's five-field "
        "SUBMIT or 0.19's four (default 0.19)",
    )
    parser.add_argument(
        "--inflight",
        type=int,
        metavar="N",
        help="requests held in flight by c and py in the memory test; 0 skips "
        "(default 200000, --quick 20000)",
    )
    parser.add_argument(
        "--inflight-large",
        type=int,
        metavar="N",
        help="c alone, the 256 MiB target; 0 skips (default 1000000, --quick 0)",
    )
    parser.add_argument(
        "--window",
        type=int,
        help="requests in flight per client (default 512, --end-to-end 4096)",
    )
    parser.add_argument(
        "--transport", choices=("tcp", "ipc"), default="tcp", help="default tcp (on loopback)"
    )
    parser.add_argument("--json", metavar="PATH", help="write every measurement (default: none)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="a PNG: µs/request against prompt bytes, or with --latency the choke curve "
        "(default: none; needs matplotlib)",
    )
    open_loop = parser.add_argument_group("--latency")
    open_loop.add_argument(
        "--latency-clients",
        type=int,
        metavar="N",
        default=1,
        help="sender processes sharing each point's rate (default 1)",
    )
    open_loop.add_argument(
        "--latency-seconds",
        type=float,
        metavar="S",
        help="seconds of arrivals per point, longer at low rates to get 1000 requests, at "
        "most 4×S (default 2, --quick 0.5)",
    )
    open_loop.add_argument(
        "--min-rate",
        type=float,
        metavar="R",
        default=1000.0,
        help="requests/s the search for each variant's saturation starts at (default 1000)",
    )
    open_loop.add_argument(
        "--max-rate",
        type=float,
        metavar="R",
        help="requests/s the search stops at (default 200000, --quick 16000)",
    )
    open_loop.add_argument(
        "--sweep-from",
        type=float,
        metavar="F",
        default=0.1,
        help="the sweep starts at this fraction of each variant's saturation (default 0.1)",
    )
    fleet = parser.add_argument_group("--scale")
    fleet.add_argument(
        "--scale-engines",
        type=int,
        nargs="+",
        metavar="N",
        help="engine ranks per point, one engine process hosting them "
        f"(default {' '.join(map(str, scale.ENGINE_COUNTS))}, --quick 2 64)",
    )
    fleet.add_argument(
        "--scale-clients",
        type=int,
        nargs="+",
        metavar="N",
        help="clients per point, one client process hosting them "
        f"(default {' '.join(map(str, scale.CLIENT_COUNTS))}, --quick 1 100)",
    )
    fleet.add_argument(
        "--scale-policies",
        nargs="+",
        choices=POLICIES,
        default=list(POLICIES),
        help=f"the policies of the engine axis (default {' '.join(POLICIES)})",
    )
    fleet.add_argument(
        "--scale-inflight",
        type=int,
        metavar="N",
        help="requests in flight at every point, at least 2 × 8 per rank of the largest "
        f"engine count (default {scale.INFLIGHT}, --quick 1024)",
    )
    takeover = parser.add_argument_group("--failover")
    takeover.add_argument(
        "--failover-modes",
        nargs="+",
        choices=failover.MODES,
        help="restart: a new coordinator at the same address after --restart-delay; "
        "standby: two --ha candidates on an etcd server the bench starts, the leader killed "
        "(pip install 'coordkit[bench]') (default: both)",
    )
    takeover.add_argument(
        "--failover-rate",
        type=float,
        metavar="R",
        help="requests/s the client submits, steadily (default 300, --quick 100)",
    )
    takeover.add_argument(
        "--failover-generate",
        type=float,
        metavar="S",
        help="seconds an engine generates for each request; in flight: rate × S "
        "(default 1, --quick 0.5)",
    )
    takeover.add_argument(
        "--kill-after",
        type=float,
        metavar="S",
        help="seconds of load before the kill, and of load past the takeover "
        "(default 3, --quick 1.5)",
    )
    takeover.add_argument(
        "--restart-delay",
        type=float,
        metavar="S",
        default=0.5,
        help="restart: seconds from the kill to the new coordinator's start (default 0.5)",
    )
    takeover.add_argument(
        "--ha-ttl",
        type=int,
        metavar="S",
        help=f"standby: the lease's TTL in whole seconds (default {DEFAULT_TTL}, --quick 2: "
        "1 loses terms to slow keepalives on a loaded host)",
    )
    shares = parser.add_argument_group("--fairness")
    shares.add_argument(
        "--fairness-scenarios",
        nargs="+",
        choices=fairness.SCENARIOS,
        default=list(fairness.SCENARIOS),
        help=f"the scenarios (default {' '.join(fairness.SCENARIOS)}; alone is the "
        "reference of the latency criteria)",
    )
    shares.add_argument(
        "--fairness-engines",
        type=int,
        metavar="N",
        help=f"fake engine processes, {fairness.CAPACITY} requests at once each "
        "(default 2, --quick 1)",
    )
    shares.add_argument(
        "--fairness-seconds",
        type=float,
        metavar="S",
        help="seconds of load per scenario (default 20, --quick 3)",
    )
    shares.add_argument(
        "--fairness-step",
        type=float,
        metavar="S",
        help="seconds per engine step (default 0.02, --quick 0.05)",
    )
    shares.add_argument(
        "--fairness-tokens",
        type=int,
        metavar="N",
        help="steps per request (default 8, --quick 2)",
    )
    shares.add_argument(
        "--fairness-implementation",
        choices=("c", "py"),
        default="c",
        help="the coordinator's (default c)",
    )
    args = parser.parse_args(argv)
    quick = args.quick
    megatron = args.workload == "megatron"
    args.cost = not (
        args.client
        or args.end_to_end
        or args.latency
        or args.scale
        or args.failover
        or args.fairness
        or args.pd
    )
    given_lengths, given_variants = args.lengths, args.variants
    if args.megatron_version != "0.19" and args.dialect != "megatron-core":
        parser.error(f"--megatron-version {args.megatron_version} needs --dialect megatron-core")
    if given_lengths is None:
        single_frame = args.dialect == "megatron-core"
        fields = SUBMIT_FIELDS[args.megatron_version]
        # --pd's: 16 tokens' prompt frame (73 bytes) below the size under which a kept
        # frame may be copied (COPY_BELOW, 8 KiB), 2 000's (8 248) just above, 32 000 long.
        if megatron and args.cost:
            args.lengths = megatron_prompts(single_frame, fields)
        elif args.pd and not args.latency:
            args.lengths = [Prompt(n) for n in MEGATRON_LENGTHS]
        elif args.cost:
            args.lengths = standard_prompts(single_frame, fields)
        else:
            args.lengths = [Prompt(n) for n in LATENCY_LENGTHS]
    args.scale_lengths = given_lengths or [Prompt(16)]
    default_variants = ["floor", "c"] if megatron else list(DEFAULT_VARIANTS)
    args.variants = _installed(given_variants or default_variants, given_variants, parser.error)
    args.latency_variants = given_variants or list(LATENCY_VARIANTS)
    args.scale_variants = [v for v in given_variants or ("floor", "c") if v in scale.SCALE_VARIANTS]
    args.failover_variants = [
        v for v in given_variants or failover.VARIANTS if v in failover.VARIANTS
    ]
    if args.window is None:
        args.window = 4096 if args.end_to_end and not quick else 512
    # --pd's FakeEngines pace it: a few thousand requests per second
    mode_requests = 20_000 if args.pd else 40_000 if args.client or megatron else 60_000
    full_requests = 200_000 if args.end_to_end else mode_requests
    for name, full, smoke in (
        ("repeat", 3 if megatron or args.pd else 5, 1),
        ("inflight", 200_000, 20_000),
        ("inflight_large", 1_000_000, 0),
        ("latency_seconds", 2.0, 0.5),
        ("max_rate", 200_000.0, 16_000.0),
        ("scale_engines", list(scale.ENGINE_COUNTS), [2, 64]),
        ("scale_clients", list(scale.CLIENT_COUNTS), [1, 100]),
        ("scale_inflight", scale.INFLIGHT, 1024),
        ("failover_rate", 300.0, 100.0),
        ("failover_generate", 1.0, 0.5),
        ("kill_after", 3.0, 1.5),
        ("ha_ttl", DEFAULT_TTL, 2),
        ("fairness_engines", 2, 1),
        ("fairness_seconds", 20.0, 3.0),
        ("fairness_step", 0.02, 0.05),
        ("fairness_tokens", 8, 2),
    ):
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else full)
    args.scale_requests = args.requests or (2_000 if quick else 100_000)
    if args.requests is None:
        args.requests = 2_000 if quick else full_requests
    if args.requests < 1 or args.repeat < 1 or args.window < 1:
        parser.error("--requests, --repeat and --window must be positive")
    if args.latency:
        if args.latency_clients < 1 or args.latency_seconds <= 0:
            parser.error("--latency-clients and --latency-seconds must be positive")
        if not 0 < args.min_rate <= args.max_rate:
            parser.error("--min-rate must be positive and at most --max-rate")
        if not 0 < args.sweep_from <= 1:
            parser.error("--sweep-from must be in (0, 1]")
    if args.scale:
        scale.check(args, parser.error)
    if args.failover:
        _check_failover(args, parser.error)
    if args.fairness and (
        min(args.fairness_engines, args.fairness_tokens) < 1
        or min(args.fairness_seconds, args.fairness_step) <= 0
    ):
        parser.error("--fairness-engines, -seconds, -step and -tokens must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'coordkit[bench]'")
    return args


def _check_failover(args: argparse.Namespace, error: Callable[[str], object]) -> None:
    """The failover options, and the standby's etcd (skipped unless asked for by name)."""
    if not args.failover_variants:
        error(f"--failover runs {' and '.join(failover.VARIANTS)}: none of them in --variants")
    if min(args.failover_rate, args.failover_generate, args.kill_after, args.ha_ttl) <= 0:
        error("--failover-rate, --failover-generate, --kill-after and --ha-ttl must be positive")
    if args.restart_delay < 0:
        error("--restart-delay must not be negative")
    asked = args.failover_modes
    args.failover_modes = list(asked or failover.MODES)
    missing = failover.ha_missing() if "standby" in args.failover_modes else None
    if missing and asked:
        error(missing)
    if missing:
        print(f"coordkit bench: skipping the standby: {missing}", file=sys.stderr, flush=True)
        args.failover_modes.remove("standby")


def _installed(
    variants: list[str], asked: list[str] | None, error: Callable[[str], object]
) -> list[str]:
    """The variants whose optional dependency is installed; each other one is skipped
    with a line saying why, or refused (``error``) when asked for by name."""
    kept = []
    for variant in variants:
        module, extra = REQUIRES.get(variant, ("", ""))
        if module:
            try:
                importlib.import_module(module)
            except ImportError:
                why = f"it needs {module} (pip install 'coordkit[{extra}]')"
                if asked:
                    error(f"--variants {variant}: {why}")
                print(f"coordkit bench: skipping {variant}: {why}", file=sys.stderr, flush=True)
                continue
        kept.append(variant)
    return kept


@contextlib.contextmanager
def _trace_receiver(variants: list[str]) -> Iterator[None]:
    """With a traced variant and no OTEL_EXPORTER_OTLP_ENDPOINT: an OTLP receiver in this
    process (what it costs to take the spans is not the coordinator's), named in the
    environment its coordinator children inherit."""
    if not set(variants) & set(TRACE_SAMPLES) or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        yield
        return
    from ..otlp import Receiver

    with Receiver() as receiver:
        os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        try:
            yield
        finally:
            del os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]


def _measure_cpu(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    at_once = args.workload == "megatron"
    starts = {
        variant: functools.partial(Session, variant, args, directory, at_once=at_once)
        for variant in args.variants
    }
    run_interleaved(args, starts, runs, failures, "variant")


def _measure_memory(
    args: argparse.Namespace,
    directory: str,
    memory: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    # The large run goes twice: keeping each prompt to re-send it, and not.
    plan = [(v, args.inflight, True) for v in ("c", "py")]
    plan += [("c", args.inflight_large, keep) for keep in (True, False)]
    for variant, n, keep_prompts in plan:
        if n <= 0 or variant not in args.variants or variant in failures:
            continue
        warmup = min(n, 2 * args.window)
        session = None
        options = {"max_inflight": n, "keep_prompts": keep_prompts}
        try:
            session = Session(variant, args, directory, options, hold_after=warmup)
            result = session.fill(n, warmup, args.window)
            result["keep_prompts"] = keep_prompts
        except Failure as exc:
            failures[f"{variant} memory"] = f"holding {n} requests: {exc}"
            continue
        finally:
            if session is not None:
                session.close()
        memory.append(result)
        print(
            f"memory {variant:>5}: {n} in flight, {result['bytes_per_request']:.0f} bytes each, "
            f"RSS {result['rss_with'] / 2**20:.1f} MiB",
            file=sys.stderr,
        )
