"""``coordkit bench``: the coordinator process's own CPU time per request, side by side.

Every variant runs in its own process, with one client process and one engine
process (``RANKS`` engine sockets) as lean raw-pyzmq load generators:

* ``floor`` -- libzmq's ``zmq.proxy`` between a ROUTER (clients) and a DEALER
  (engines) carrying the same frames; no decoding, no state: this machine's limit;
* ``c`` / ``py`` -- the Cython and the reference coordinator, on the
  multipart protocol (:mod:`coordkit.protocol`); ``c-metrics`` -- ``c``
  serving Prometheus metrics, its latency histograms kept;
* ``mono`` -- the design before the split, Megatron-Core 0.19's: one msgpack
  message per request, unpacked and repacked whole by a Python loop
  (:class:`.servers._Mono`).

``--dialect megatron-core`` makes every variant's load speak 0.19's single
frames (``c``, ``py`` serving them with ``dialect="megatron-core"``).

For each prompt length the client first warms the path up, then the bench
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

Here: the options, the points in order and the results. :mod:`.session`
starts and drives a variant's processes, :mod:`.servers` is the coordinator
child, :mod:`.load` the client and engine children, :mod:`.endpoints` the
endpoint modes, :mod:`.report` the summaries, tables, JSON records and plot;
:mod:`.workload` holds what they share.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..._policies import POLICIES
from ..._shared import DIALECTS
from . import endpoints, report
from .session import Failure, Session
from .workload import IMPLEMENTATIONS, LENGTHS, VARIANTS, requests_at

__all__ = ["main", "VARIANTS", "LENGTHS", "IMPLEMENTATIONS"]


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
    failures: dict[str, str] = {}
    interrupted = False
    coordinator_mode = not (args.client or args.end_to_end)
    with tempfile.TemporaryDirectory(prefix="coordkit-bench-") as directory:
        try:
            if coordinator_mode:
                _measure_cpu(args, directory, runs, failures)
                _measure_memory(args, directory, memory, failures)
            if args.client:
                endpoints.measure_clients(args, directory, client_runs, failures)
            if args.end_to_end:
                endpoints.measure_end_to_end(args, directory, end_to_end_runs, failures)
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
    for variant, reason in failures.items():
        print(f"FAILED {variant}: {reason}")
    if args.json:
        result: dict[str, Any] = {
            "environment": environment,
            "config": report.config(args),
            "failures": failures,
            "seconds": round(time.monotonic() - started, 1),
        }
        if coordinator_mode:
            result.update(runs=runs, summary={str(t): s for t, s in summary.items()}, memory=memory)
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
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot:
        report.plot(args, summary, Path(args.plot))
    return 130 if interrupted else 1 if failures else 0


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="coordkit bench",
        description="Coordinator CPU time per request (user and sys of its own process) "
        "and memory per request in flight, for floor, c, py and mono side by side; "
        "with --client or --end-to-end, the endpoints' instead.",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument(
        "--client",
        action="store_true",
        help="client process CPU per request: coordkit's Client beside a plain pyzmq client",
    )
    parser.add_argument(
        "--end-to-end",
        action="store_true",
        help="client, coordinator and two engine ranks as processes: requests/s and "
        "every process's CPU per request",
    )
    parser.add_argument(
        "--clients",
        nargs="+",
        choices=endpoints.CLIENT_VARIANTS,
        default=endpoints.CLIENT_VARIANTS,
        help="--client: the client variants",
    )
    parser.add_argument(
        "--peers",
        nargs="+",
        choices=endpoints.PEERS,
        default=endpoints.PEERS,
        help="--client: what the clients talk to (a coordinator and an echo engine, "
        "or a stand-in that grants batches)",
    )
    parser.add_argument(
        "--end-to-end-clients",
        nargs="+",
        choices=endpoints.END_TO_END_VARIANTS,
        default=endpoints.END_TO_END_VARIANTS,
        help="--end-to-end: the client variants",
    )
    parser.add_argument("--lengths", type=int, nargs="+", metavar="TOKENS")
    parser.add_argument(
        "--requests",
        type=int,
        metavar="N",
        help="measured requests per point up to 2000 tokens; longer prompts get "
        "proportionally fewer, at least N/8 (default 60000, --quick 2000)",
    )
    parser.add_argument("--repeat", type=int, metavar="N", help="default 5, --quick 1")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=VARIANTS)
    parser.add_argument("--policy", choices=POLICIES, default="least_loaded", help="c and py")
    parser.add_argument(
        "--dialect",
        choices=DIALECTS,
        default="multipart",
        help="the format every variant's load speaks: megatron-core is Megatron-Core "
        "0.19's single frame per message (mono speaks it in either)",
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
    parser.add_argument("--transport", choices=("tcp", "ipc"), default="tcp")
    parser.add_argument("--json", metavar="PATH", help="write every repetition here")
    parser.add_argument("--plot", metavar="PATH", help="PNG of µs/request against prompt length")
    args = parser.parse_args(argv)
    quick = args.quick
    endpoint_lengths = [16, 2000]
    if args.lengths is None:
        args.lengths = endpoint_lengths if args.client or args.end_to_end else list(LENGTHS)
    if args.window is None:
        args.window = 4096 if args.end_to_end and not quick else 512
    full_requests = 200_000 if args.end_to_end else 40_000 if args.client else 60_000
    for name, full, smoke in (
        ("requests", full_requests, 2_000),
        ("repeat", 5, 1),
        ("inflight", 200_000, 20_000),
        ("inflight_large", 1_000_000, 0),
    ):
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else full)
    if min(args.lengths) < 1 or args.requests < 1 or args.repeat < 1 or args.window < 1:
        parser.error("--lengths, --requests, --repeat and --window must be positive")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib: pip install 'coordkit[bench]'")
    return args


def _measure_cpu(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    sessions: dict[str, Session] = {}
    try:
        for variant in args.variants:
            try:
                sessions[variant] = Session(variant, args, directory)
            except Failure as exc:
                failures[variant] = str(exc)
        # Variants interleave within each repetition, so drift hits them all alike.
        for repetition in range(args.repeat):
            for tokens in args.lengths:
                n = requests_at(args, tokens)
                warmup = min(n, max(2 * args.window, n // 20))
                for variant in list(sessions):
                    try:
                        run = sessions[variant].run(tokens, n, warmup, args.window)
                    except Failure as exc:
                        failures[variant] = f"at {tokens} tokens: {exc}"
                        sessions.pop(variant).close()
                        continue
                    run.update(variant=variant, tokens=tokens, repetition=repetition)
                    runs.append(run)
                    print(
                        f"[{repetition + 1}/{args.repeat}] {tokens:>6} tokens {variant:>5}: "
                        f"{run['total_us']:8.2f} µs/request, {run['requests_per_s']:8.0f} req/s",
                        file=sys.stderr,
                    )
    finally:
        for session in sessions.values():
            session.close()


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
