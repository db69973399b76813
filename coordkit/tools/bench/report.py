"""The bench's results: medians per point, the printed tables, the JSON records, the plot."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ... import IMPLEMENTATION, __version__
from .workload import (
    BATCH,
    BLOCK_SIZE,
    MEMORY_PROMPT_TOKENS,
    OUTPUT_TOKENS,
    RANKS,
    SAMPLING,
    VARIANTS,
    reply_body,
    requests_at,
)


def summarize(runs: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, float]]]:
    """tokens -> variant -> medians over the repetitions (and the total's range)."""
    groups: dict[int, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        groups.setdefault(run["tokens"], {}).setdefault(run["variant"], []).append(run)
    summary: dict[int, dict[str, dict[str, float]]] = {}
    for tokens, variants in sorted(groups.items()):
        summary[tokens] = {}
        for variant, group in variants.items():
            point = {
                key: statistics.median(r[key] for r in group)
                for key in ("total_us", "user_us", "sys_us", "requests_per_s", "reply_batch")
            }
            point["min_total_us"] = min(r["total_us"] for r in group)
            point["max_total_us"] = max(r["total_us"] for r in group)
            point["repetitions"] = len(group)
            summary[tokens][variant] = point
    return summary


def _ratio(point: dict[str, dict[str, float]], a: str, b: str, key: str = "total_us") -> str:
    if a not in point or b not in point or not point[b][key]:
        return "-"
    return f"{point[a][key] / point[b][key]:.2f}"


def print_cpu(args: argparse.Namespace, summary: dict[int, dict[str, dict[str, float]]]) -> None:
    if not summary:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\ncoordinator CPU per request, median of {args.repeat} "
        f"({transport}, {args.dialect} dialect, policy {args.policy}, {RANKS} engine ranks, "
        f"window {args.window})"
    )
    print(
        f"{'tokens':>6}  {'variant':<7} {'µs/req':>8} {'user':>8} {'sys':>8} "
        f"{'>floor':>8} {'req/s':>8} {'batch':>6}"
    )
    for tokens, point in summary.items():
        floor = point.get("floor", {}).get("total_us")
        for variant in VARIANTS:
            if variant not in point:
                continue
            p = point[variant]
            above = "-" if floor is None or variant == "floor" else f"{p['total_us'] - floor:.2f}"
            print(
                f"{tokens:>6}  {variant:<7} {p['total_us']:8.2f} {p['user_us']:8.2f} "
                f"{p['sys_us']:8.2f} {above:>8} {p['requests_per_s']:8.0f} "
                f"{p['reply_batch']:6.2f}"
            )
    print(
        f"\n{'tokens':>6}  {'c/floor':>8} {'py/c':>8} {'py/c user':>10} {'mono/c':>8} "
        f"{'c-metrics/c':>12}"
    )
    for tokens, point in summary.items():
        print(
            f"{tokens:>6}  {_ratio(point, 'c', 'floor'):>8} {_ratio(point, 'py', 'c'):>8} "
            f"{_ratio(point, 'py', 'c', 'user_us'):>10} {_ratio(point, 'mono', 'c'):>8} "
            f"{_ratio(point, 'c-metrics', 'c'):>12}"
        )


def keyed(summary: dict[tuple[Any, ...], Any]) -> dict[str, Any]:
    """A summary keyed by tuples, as JSON can hold it: "peer/variant/tokens"."""
    return {"/".join(str(k) for k in key if k is not None): v for key, v in summary.items()}


def print_clients(args: argparse.Namespace, summary: dict[tuple[Any, ...], Any]) -> None:
    if not summary:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\nclient process CPU per request, median of {args.repeat} "
        f"({transport}, window {args.window}, replies of at most 16 per message)"
    )
    print(
        f"{'peer':<12} {'tokens':>6}  {'client':<16} {'µs/req':>8} {'main':>6} {'I/O':>6} "
        f"{'plain/this':>10} {'req/s':>8}  batches"
    )
    for (peer, variant, tokens), point in sorted(
        summary.items(), key=lambda item: (item[0][0], item[0][2])
    ):
        plain = summary.get((peer, "plain", tokens))
        ratio = f"{plain['client_us'] / point['client_us']:.1f}" if plain else "-"
        io = point["client_us"] - point["client_main_us"]
        print(
            f"{peer:<12} {tokens:>6}  {variant:<16} {point['client_us']:8.2f} "
            f"{point['client_main_us']:6.2f} {io:6.2f} {ratio:>10} "
            f"{point['requests_per_s']:8.0f}  {'granted' if point['batch'] else 'no'}"
        )
    print("(main: the event loop's thread, Python and the core; I/O: libzmq's I/O thread)")


def print_end_to_end(args: argparse.Namespace, summary: dict[tuple[Any, ...], Any]) -> None:
    if not summary:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\nend to end: one client process, a coordinator, two engine processes; "
        f"median of {args.repeat} ({transport}, window {args.window})"
    )
    print(
        f"{'tokens':>6}  {'client':<12} {'req/s':>8} {'client':>8} {'coord':>8} "
        f"{'engines':>8} {'per engine':>16} {'reply':>6}  batches"
    )
    print(f"{'':>6}  {'':<12} {'':>8} {'µs/request of each process':>42}")
    for (_, variant, tokens), point in sorted(summary.items(), key=lambda item: item[0][2]):
        per_engine = " ".join(f"{us:.2f}" for us in point["engine_us"])
        print(
            f"{tokens:>6}  {variant:<12} {point['requests_per_s']:8.0f} "
            f"{point['client_us']:8.2f} {point['coordinator_us']:8.2f} "
            f"{point['engines_us']:8.2f} {per_engine:>16} {point['reply_batch']:6.1f}  "
            f"{'granted' if point['batch'] else 'no'}"
        )


def print_memory(memory: list[dict[str, Any]]) -> None:
    if not memory:
        return
    print(f"\ncoordinator memory with requests in flight ({MEMORY_PROMPT_TOKENS}-token prompts)")
    print(
        f"{'variant':<7} {'in flight':>10} {'prompts kept':>13} {'RSS before':>11} "
        f"{'RSS with':>11} {'per request':>12}"
    )
    for m in memory:
        print(
            f"{m['variant']:<7} {m['inflight']:>10} {'yes' if m['keep_prompts'] else 'no':>13} "
            f"{m['rss_before'] / 2**20:>7.1f} MiB "
            f"{m['rss_with'] / 2**20:>7.1f} MiB {m['bytes_per_request']:>8.0f} B"
        )


def environment(args: argparse.Namespace) -> dict[str, Any]:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            cpu = next(line.split(":", 1)[1].strip() for line in cpuinfo if "model name" in line)
    except (OSError, StopIteration):
        cpu = platform.processor()
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
        "coordkit": __version__,
        "transport": "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg": os.getloadavg(),  # before the run: others sharing the CPUs disturb it
    }


def config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "lengths": list(args.lengths),
        "requests": {str(t): requests_at(args, t) for t in args.lengths},
        "repeat": args.repeat,
        "variants": list(args.variants),
        "policy": args.policy,
        "dialect": args.dialect,
        "window": args.window,
        "ranks": RANKS,
        "reply_batch_max": BATCH,
        "output_tokens": OUTPUT_TOKENS,
        "reply_body_bytes": len(reply_body()),
        "sampling_params": SAMPLING,
        "block_size": BLOCK_SIZE if args.policy == "prefix" else None,
        "inflight": args.inflight,
        "inflight_large": args.inflight_large,
        "quick": args.quick,
        "client": args.client,
        "end_to_end": args.end_to_end,
        "clients": list(args.clients),
        "peers": list(args.peers),
        "end_to_end_clients": list(args.end_to_end_clients),
        "implementation": IMPLEMENTATION,
    }


def plot(
    args: argparse.Namespace, summary: dict[int, dict[str, dict[str, float]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    from matplotlib import pyplot

    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    for variant in VARIANTS:
        lengths = [t for t in summary if variant in summary[t]]
        if not lengths:
            continue
        points = [summary[t][variant] for t in lengths]
        medians = [p["total_us"] for p in points]
        spread = [
            [m - p["min_total_us"] for m, p in zip(medians, points, strict=True)],
            [p["max_total_us"] - m for m, p in zip(medians, points, strict=True)],
        ]
        axes.errorbar(lengths, medians, yerr=spread, marker="o", capsize=3, label=variant)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("prompt length (tokens)")
    axes.set_ylabel("coordinator CPU per request (µs, user + sys)")
    axes.set_title(f"coordkit bench ({args.transport}, median of {args.repeat}, min-max bars)")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
