"""The ``coordkit`` command: ``serve``, ``demo``, ``stats`` and ``bench``.

* ``coordkit serve --bind ADDRESS [options]`` runs a coordinator until
  SHUTDOWN, SIGINT or SIGTERM;
* ``coordkit demo`` runs a whole cluster on ipc sockets in a temporary
  directory (coordinator, fake engine processes, a client load) and prints
  a results table; ``--compare-policies`` runs one cluster per policy, with
  a column each;
* ``coordkit stats --address ADDRESS`` prints a coordinator's stats as JSON;
* ``coordkit bench ...`` runs the benchmarks (:mod:`coordkit.tools.bench`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import coordkit
from coordkit._routing_py import POLICIES
from coordkit.client import Client, CoordinatorError
from coordkit.engine import DEFAULT_CACHE_BLOCKS, DEFAULT_PREFIX_BLOCK_SIZE

__all__ = ["main"]

_ENGINE_STOP_TIMEOUT = 5.0  # seconds a terminated engine process gets before SIGKILL


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # bench parses its own options
        from . import bench

        return bench.main(argv[1:]) or 0
    args = _parser().parse_args(argv)
    return args.command(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="coordkit", description="A data-parallel inference coordinator."
    )
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run a coordinator")
    serve.set_defaults(command=_serve)
    serve.add_argument("--bind", required=True, metavar="ADDRESS", help="e.g. tcp://0.0.0.0:5555")
    _add_coordinator_choices(serve)
    serve.add_argument("--max-inflight", type=int, metavar="N")
    serve.add_argument("--max-inflight-per-engine", type=int, metavar="N", help="0: no cap")
    serve.add_argument(
        "--no-keep-prompts",
        dest="keep_prompts",
        action="store_false",
        default=None,
        help="do not keep prompts to re-send requests whose engine dies (less memory)",
    )
    serve.add_argument("--heartbeat-timeout", type=float, metavar="S", help="0: never expire")
    serve.add_argument("--drain-timeout", type=float, metavar="S")
    serve.add_argument("--max-message-size", type=int, metavar="BYTES")
    serve.add_argument(
        "--detokenizer",
        type=_import_callable,
        metavar="MODULE:CALLABLE",
        help="fills generated_text of replies flagged needs_detokenize",
    )
    serve.add_argument("--seed", type=int, metavar="N", help="for power_of_two")
    serve.add_argument("--prefix-alpha", type=float, metavar="F")
    serve.add_argument("--prefix-ttl", type=float, metavar="S")
    serve.add_argument("--prefix-max-entries", type=int, metavar="N")

    demo = commands.add_parser("demo", help="run a local cluster under a client load")
    demo.set_defaults(command=_demo)
    _add_coordinator_choices(demo)
    demo.add_argument("--engines", type=_positive_int, default=2, metavar="N")
    demo.add_argument("--requests", type=_positive_int, default=2000, metavar="N")
    demo.add_argument("--prompt-tokens", type=_positive_int, default=16, metavar="N")
    demo.add_argument("--output-tokens", type=_positive_int, default=8, metavar="N")
    demo.add_argument("--concurrency", type=_positive_int, default=64, metavar="N")
    demo.add_argument("--latency", type=float, default=0.0, metavar="S", help="per engine step")
    demo.add_argument("--stream", action="store_true", help="stream partial replies")
    demo.add_argument(
        "--shared-prefixes",
        type=_positive_int,
        metavar="N",
        help=f"each prompt: one of N shared system prompts, then {_SUFFIX_TOKENS} unique tokens",
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
        "--compare-policies",
        action="store_true",
        help=f"run {' then '.join(_COMPARED_POLICIES)} and show both (ignores --policy)",
    )

    stats = commands.add_parser("stats", help="print a coordinator's stats as JSON")
    stats.set_defaults(command=_stats)
    stats.add_argument("--address", required=True)
    stats.add_argument("--timeout", type=float, default=5.0, metavar="S")

    # Listed for --help only: main() hands `bench` its arguments before parsing.
    commands.add_parser("bench", help="run the benchmarks (coordkit bench --help)")
    return parser


def _add_coordinator_choices(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--policy", choices=POLICIES, default="least_loaded")
    parser.add_argument(
        "--implementation",
        choices=("c", "py"),
        default=coordkit.IMPLEMENTATION,
        help=f"coordinator implementation (default: {coordkit.IMPLEMENTATION})",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _import_callable(spec: str) -> Callable[..., Any]:
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)  # type: ignore[no-any-return]
    except (ImportError, AttributeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot import {spec!r}: {exc}") from None


def _load(name: str) -> SimpleNamespace:
    try:
        return coordkit.load_implementation(name)
    except ImportError as exc:
        raise SystemExit(f"coordkit: the {name!r} implementation is not available: {exc}") from None


# -- serve -----------------------------------------------------------------------------

_SERVE_OPTIONS = (
    "max_inflight",
    "max_inflight_per_engine",
    "keep_prompts",
    "heartbeat_timeout",
    "drain_timeout",
    "max_message_size",
    "detokenizer",
    "seed",
    "prefix_alpha",
    "prefix_ttl",
    "prefix_max_entries",
)


def _serve(args: argparse.Namespace) -> int:
    impl = _load(args.implementation)
    # Options not given keep the Coordinator's own defaults.
    options = {name: getattr(args, name) for name in _SERVE_OPTIONS}
    options = {name: value for name, value in options.items() if value is not None}
    try:
        coord = impl.Coordinator(args.bind, policy=args.policy, **options)
    except Exception as exc:  # a bad option or an address that cannot be bound
        raise SystemExit(f"coordkit serve: {exc}") from None

    failures: list[BaseException] = []

    def serve() -> None:
        try:
            coord.serve_forever()
        except BaseException as exc:
            failures.append(exc)
            raise

    # The loop runs on a thread so that the main thread stays free for signal handlers.
    thread = threading.Thread(target=serve, name="coordkit-serve")
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: coord.stop(timeout=0))
    thread.start()
    print(
        f"coordkit listening on {coord.address} (implementation {impl.name}, policy {args.policy})",
        file=sys.stderr,
        flush=True,
    )
    thread.join()
    return 1 if failures else 0


# -- stats -----------------------------------------------------------------------------


def _stats(args: argparse.Namespace) -> int:
    async def fetch() -> dict[str, Any]:
        async with await Client.connect(args.address, timeout=args.timeout) as client:
            return await client.stats(timeout=args.timeout)

    try:
        stats = asyncio.run(fetch())
    except (ConnectionError, TimeoutError) as exc:
        raise SystemExit(f"coordkit stats: {exc}") from None
    print(json.dumps(stats, indent=2, sort_keys=True))
    return 0


# -- demo ------------------------------------------------------------------------------

_COMPARED_POLICIES = ("least_loaded", "prefix")
_SUFFIX_TOKENS = 32  # the unique part of a shared-prefix prompt: a short user turn
_WORKLOAD_SEED = 0  # every run draws the same prefixes in the same order


@dataclass
class _Results:
    latencies: list[float] = field(default_factory=list)
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


def _demo(args: argparse.Namespace) -> int:
    impl = _load(args.implementation)
    policies = _COMPARED_POLICIES if args.compare_policies else (args.policy,)
    prompt = _workload(args)
    runs: dict[str, _Results] = {}
    for policy in policies:
        runs[policy] = results = _Results()
        try:
            _run_cluster(impl, policy, prompt, args, results)
        except (ConnectionError, TimeoutError) as exc:
            print(f"coordkit demo: {exc}", file=sys.stderr)
            return 1
        if results.interrupted:
            break
    _print_results(args, impl.name, runs)
    return 0


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
        suffix = count * length + i * _SUFFIX_TOKENS
        return prefixes[draws[i]] + list(range(suffix, suffix + _SUFFIX_TOKENS))

    return prompt


def _run_cluster(
    impl: SimpleNamespace,
    policy: str,
    prompt: Callable[[int], list[int]],
    args: argparse.Namespace,
    results: _Results,
) -> None:
    """Run the load on a cluster of its own, so that every run starts with cold caches."""
    with tempfile.TemporaryDirectory(prefix="coordkit-demo-") as tmp:
        address = f"ipc://{tmp}/coordinator.sock"
        coord = impl.Coordinator(address, policy=policy)
        coord.start()
        engines: list[subprocess.Popen[bytes]] = []
        try:
            engines += (_spawn_engine(address, rank, args) for rank in range(args.engines))
            asyncio.run(_run_load(address, policy, prompt, args, results, engines))
        except KeyboardInterrupt:
            results.interrupted = True
        finally:
            # Engines first, while the coordinator can still take their DISCONNECT.
            _stop_processes(engines)
            coord.stop()


def _spawn_engine(address: str, rank: int, args: argparse.Namespace) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    # The child must import this very coordkit, installed or not.
    package_root = str(Path(coordkit.__file__).parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    env["COORDKIT_PUREPYTHON"] = "1"  # an engine runs no coordinator: skip loading the extension
    command = [
        sys.executable,
        "-m",
        "coordkit.engine",
        "--address",
        address,
        "--rank",
        str(rank),
        "--latency",
        str(args.latency),
        "--output-tokens",
        str(args.output_tokens),
        "--cache-blocks",
        str(args.cache_blocks),
        "--prefix-block-size",
        str(args.block_size),
    ]
    # Its own session: Ctrl-C reaches only the demo, which then stops the engines itself.
    return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, start_new_session=True)


def _stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    deadline = time.monotonic() + _ENGINE_STOP_TIMEOUT
    for process in processes:
        try:
            process.wait(max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def _run_load(
    address: str,
    policy: str,
    prompt: Callable[[int], list[int]],
    args: argparse.Namespace,
    results: _Results,
    engines: list[subprocess.Popen[bytes]],
) -> None:
    # With shared prefixes every policy gets the hashes, so that runs differ in routing only.
    hashed = policy == "prefix" or args.shared_prefixes is not None
    block_size = args.block_size if hashed else None
    async with await Client.connect(address, timeout=10.0) as client:
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
                try:
                    if args.stream:
                        stream = client.stream(tokens, block_size=block_size)
                        reply = [part async for part in stream][-1]
                    else:
                        reply = await client.submit(tokens, block_size=block_size)
                except CoordinatorError as exc:
                    results.errors[getattr(exc.code, "name", str(exc.code))] += 1
                else:
                    results.latencies.append(time.perf_counter() - sent)
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
            "prompt tokens": str(args.prefix_tokens + _SUFFIX_TOKENS),
            "shared prefixes": f"{args.shared_prefixes} ({args.prefix_tokens} tokens each)",
        }
    rows = {
        "implementation": implementation,
        "policy": policy,
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
    if args.shared_prefixes is not None or args.compare_policies:
        rows["prefix cache"] = f"{args.cache_blocks} blocks of {args.block_size} tokens"
        rows["prefix cache hit rate"] = _hit_rate(results)
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
