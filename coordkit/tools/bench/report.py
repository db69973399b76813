"""The bench's results: medians per point, the printed tables, the JSON records, the plot."""

from __future__ import annotations

import argparse
import itertools
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ... import IMPLEMENTATION, __version__
from . import failover, latency
from .workload import (
    BATCH,
    BLOCK_SIZE,
    DIRECT,
    ECHO_BATCH,
    KV_CACHE_BLOCKS,
    KV_EVENTS,
    MEGATRON_BODIES,
    MEGATRON_OUTPUT_TOKENS,
    MEMORY_PROMPT_TOKENS,
    OUTPUT_TOKENS,
    RANKS,
    SAMPLING,
    THRESHOLDS,
    TRACE_SAMPLES,
    VARIANTS,
    reply_body,
    requests_at,
)


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """prompt -> variant -> medians over the repetitions (and the total's range)."""
    groups: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for run in runs:
        groups.setdefault(run["prompt"], {}).setdefault(run["variant"], []).append(run)
    summary: dict[str, dict[str, dict[str, Any]]] = {}
    for prompt, variants in groups.items():
        summary[prompt] = {}
        for variant, group in variants.items():
            point: dict[str, Any] = {
                key: statistics.median(r[key] for r in group)
                for key in (
                    "total_us",
                    "user_us",
                    "sys_us",
                    "main_us",
                    "requests_per_s",
                    "reply_batch",
                )
            }
            counted = [r["syscalls_per_request"] for r in group]
            point["syscalls_per_request"] = None if None in counted else statistics.median(counted)
            point["switches_per_request"] = statistics.median(
                r["switches_per_request"] for r in group
            )
            for key in _KV_KEYS:  # c-kv-events': the events applied, per request
                if key in group[0]:
                    point[key] = statistics.median(r[key] for r in group)
            point["min_total_us"] = min(r["total_us"] for r in group)
            point["max_total_us"] = max(r["total_us"] for r in group)
            point["repetitions"] = len(group)
            point.update({k: group[0][k] for k in _PROMPT_KEYS})
            summary[prompt][variant] = point
    return summary


_PROMPT_KEYS = ("tokens", "ids", "prompt_bytes", "frame_bytes", "body")
_KV_KEYS = ("kv_batches_per_request", "kv_records_per_request", "kv_thread_us_per_request")


def _ratio(point: dict[str, dict[str, float]], a: str, b: str, key: str = "total_us") -> str:
    if a not in point or b not in point or not point[b][key]:
        return "-"
    return f"{point[a][key] / point[b][key]:.2f}"


#: The heading of _prompt_label's columns.
_PROMPT_HEAD = f"{'tokens':>6} {'ids':<6} {'bytes':>7} {'body':<9}"


def _prompt_label(point: dict[str, Any]) -> str:
    """``  2000 range     5619 realistic``: tokens, their ids, the bytes of the frame
    carrying them (exactly: the points either side of a threshold are a few bytes
    apart), and the reply body the point names (``-``: the workload's)."""
    body = point.get("body") or "-"
    return f"{point['tokens']:>6} {point['ids']:<6} {point['frame_bytes']:>7} {body:<9}"


def dialect(args: argparse.Namespace) -> str:
    """What the load speaks, for a table's title."""
    if args.dialect == "megatron-core":
        return f"megatron-core dialect, Megatron {args.megatron_version}'s layouts"
    return f"{args.dialect} dialect"


def print_cpu(args: argparse.Namespace, summary: dict[str, dict[str, dict[str, Any]]]) -> None:
    if not summary:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\ncoordinator CPU per request, median of {args.repeat} "
        f"({transport}, {dialect(args)}, policy {args.policy}, {RANKS} engine ranks, "
        f"window {args.window})"
    )
    edges = ", ".join(f"{name} at {size} B" for name, size in THRESHOLDS.items())
    print(f"(bytes: the frame carrying the prompt; the loop's thresholds: {edges})")
    if args.workload == "megatron":
        bodies = ", ".join(f"{b} {len(reply_body('megatron', b))} B" for b in MEGATRON_BODIES)
        print(f"(workload megatron: replies at once, up to {ECHO_BATCH} per message; {bodies})")
    print(
        "(syscalls: perf stat's raw_syscalls:sys_enter, '-' without perf; switches: "
        "voluntary and involuntary, from getrusage; both per request, every thread)"
    )
    head = _PROMPT_HEAD
    print(
        f"{head}  {'variant':<11} {'µs/req':>8} {'user':>8} {'sys':>8} "
        f"{'>floor':>8} {'req/s':>8} {'batch':>6} {'syscalls':>8} {'switches':>8}"
    )
    for point in summary.values():
        floor = point.get("floor", {}).get("total_us")
        for variant in VARIANTS:
            if variant not in point:
                continue
            p = point[variant]
            above = "-" if floor is None or variant == "floor" else f"{p['total_us'] - floor:.2f}"
            syscalls = p["syscalls_per_request"]
            print(
                f"{_prompt_label(p)}  {variant:<11} {p['total_us']:8.2f} {p['user_us']:8.2f} "
                f"{p['sys_us']:8.2f} {above:>8} {p['requests_per_s']:8.0f} "
                f"{p['reply_batch']:6.2f} "
                f"{'-' if syscalls is None else f'{syscalls:.2f}':>8} "
                f"{p['switches_per_request']:8.2f}"
            )
    ratios = f"{'c/floor':>8} {'py/c':>8} {'py/c user':>10} {'mono/c':>8} {'c-metrics/c':>12}"
    traced = [
        v
        for v in ("c-queued", *TRACE_SAMPLES, *KV_EVENTS)
        if any(v in point for point in summary.values())
    ]
    ratios += "".join(f" {v + '/c':>14}" for v in traced)
    print(f"\n{head}  {ratios}")
    for point in summary.values():
        print(
            f"{_prompt_label(next(iter(point.values())))}  {_ratio(point, 'c', 'floor'):>8} "
            f"{_ratio(point, 'py', 'c'):>8} {_ratio(point, 'py', 'c', 'user_us'):>10} "
            f"{_ratio(point, 'mono', 'c'):>8} {_ratio(point, 'c-metrics', 'c'):>12}"
            + "".join(f" {_ratio(point, v, 'c'):>14}" for v in traced)
        )
    _print_kv_events(summary)


def _print_kv_events(summary: dict[str, dict[str, dict[str, Any]]]) -> None:
    """c-kv-events' events per request; the loop's thread's CPU beside c's, measured
    side by side (its thread CPU clock); the events' thread's per event."""
    rows = [(point, point[v], v) for point in summary.values() for v in KV_EVENTS if v in point]
    if not rows:
        return
    print(
        f"\nKV events (every prompt's full blocks stored, an LRU of {KV_CACHE_BLOCKS} blocks "
        "per rank evicting; a batch per reply), per request: the batches and events; the "
        "CPU (µs) of the loop's thread (the request path) in c and here, and their ratio; "
        "the CPU of the events' thread (reading, decoding and counting them in the index, "
        "off the request path) per request and per event; the whole process's excess "
        "over c's per event"
    )
    print(
        f"{_PROMPT_HEAD}  {'variant':<11} {'batches':>8} "
        f"{'events':>8} {'loop c':>8} {'loop':>8} {'loop/c':>7} {'thread':>8} "
        f"{'thr/event':>9} {'µs/event':>9}"
    )
    for point, p, variant in rows:
        events, thread = p["kv_records_per_request"], p["kv_thread_us_per_request"]
        c = point.get("c")
        extra = p["total_us"] - c["total_us"] if c else None
        loop_c = "-" if c is None else f"{c['main_us']:.2f}"
        print(
            f"{_prompt_label(p)}  {variant:<11} {p['kv_batches_per_request']:8.3f} "
            f"{events:8.3f} {loop_c:>8} {p['main_us']:8.2f} "
            f"{_ratio(point, variant, 'c', 'main_us'):>7} {thread:8.2f} "
            f"{_per(thread, events):>9} {_per(extra, events):>9}"
        )


def _per(extra: float | None, count: float) -> str:
    return "-" if extra is None or not count else f"{extra / count:.2f}"


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
        summary.items(), key=lambda item: (item[0][0], item[1]["tokens"])
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
    for (_, variant, tokens), point in sorted(summary.items(), key=lambda item: item[1]["tokens"]):
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


def print_latency(args: argparse.Namespace, result: dict[str, Any]) -> None:
    points = result.get("points")
    if not points:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\nlatency under open-loop load (Poisson arrivals from {args.latency_clients} "
        f"sender process(es), {transport}, {dialect(args)}, policy {args.policy}, "
        f"{RANKS} engine ranks answering at once, {args.latency_seconds:g} s a point)"
    )
    print("(added: the variant's percentile minus direct's, the clients connected to the engine)")
    print(
        f"{'tokens':>6}  {'variant':<9} {'offered':>8} {'drawn':>8} {'sent':>8} {'answered':>8} "
        f"{'p50':>8} {'p99':>8} {'p99.9':>8}  {'raw p99':>8} {'late p99':>8}  note"
    )
    print(f"{'':>6}  {'':<9} {'requests/s':>35} {'added µs':>26}  {'µs':>17}")
    order = {v: i for i, v in enumerate((*DIRECT, *args.latency_variants))}
    low = {key: row["low_load_p99_us"] for key, row in result["summary"].items()}
    for p in sorted(points, key=lambda p: (p["tokens"], order.get(p["variant"], 99), p["offered"])):
        notes = []
        reference = low.get(f"{p['variant']}/{p['prompt']}")
        if reference is not None and latency.choked(p, reference):
            notes.append("choked")
        if not p["generator_kept_up"]:
            notes.append("senders behind")
        elif not p["on_schedule"]:
            notes.append("sends late")
        if p.get("direct_choked"):
            notes.append("direct choked")
        added = [p.get(f"added_{k}") for k in ("p50_us", "p99_us", "p999_us")]
        shown = " ".join(f"{a:>8.0f}" if a is not None else f"{'-':>8}" for a in added)
        print(
            f"{p['prompt']:>6}  {p['variant']:<9} {p['offered']:8.0f} {p['scheduled_rate']:8.0f} "
            f"{p['send_rate']:8.0f} {p['achieved']:8.0f} {shown}  {p['p99_us']:8.0f} "
            f"{p['lag_p99_us']:8.0f}  "
            f"{', '.join(notes)}"
        )
    print(
        f"\nsaturation: the highest offered rate below the choke that lasts (p99 above "
        f"{latency.CHOKE_P99:g}× the low-load p99, the least of the {latency.LOW_POINTS} lowest "
        f"rates', or answered/s below {latency.KEPT_UP:.0%} of scheduled, there and at every "
        f"higher rate)"
    )
    print(
        f"{'tokens':>6}  {'variant':<9} {'saturation':>10} {'chokes at':>10} {'by':>9} "
        f"{'low p99':>8} {'/floor':>7}  limit"
    )
    summary = result["summary"]
    for key, row in sorted(summary.items(), key=lambda kv: (kv[0].split("/")[1], kv[0])):
        variant, prompt = key.split("/", 1)
        floor = summary.get(f"floor/{prompt}", {}).get("saturation")
        ratio = f"{row['saturation'] / floor:.2f}" if floor and row["saturation"] else "-"
        saturation = f"{row['saturation']:.0f}" if row["saturation"] else "-"
        chokes = f"{row['chokes_at']:.0f}" if row["chokes_at"] else "none"
        if row["generator_limited"]:
            limit = "the senders (a lower bound: add --latency-clients)"
        elif row["chokes_at"]:
            limit = "the coordinator"
        else:
            limit = f"not reached by {row['highest_offered']:.0f}/s"
        if row.get("isolated_chokes"):
            stalls = ", ".join(f"{rate:.0f}" for rate in row["isolated_chokes"])
            limit += f"; isolated chokes (stalls) at {stalls}/s"
        print(
            f"{prompt:>6}  {variant:<9} {saturation:>10} {chokes:>10} {row['reason'] or '-':>9} "
            f"{row['low_load_p99_us']:8.0f} {ratio:>7}  {limit}"
        )
    late = sum(not p["on_schedule"] for p in points)
    if late:
        print(
            f"{late} of {len(points)} point(s) sent 1% of their requests more than "
            f"{latency.ON_SCHEDULE * 1e3:g} ms late (sends late: bursts, not Poisson arrivals)"
        )
    behind = [p for p in points if not p["generator_kept_up"]]
    if behind:
        lowest = min(p["offered"] for p in behind)
        print(
            f"the senders fell behind their schedule at {len(behind)} point(s), from "
            f"{lowest:.0f}/s offered: there the load generator, not the coordinator, was the limit"
        )


def print_scale(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\ncoordinator CPU per request against the fleet's size, median of {args.repeat} "
        f"({transport}, {args.scale_inflight} in flight at every point, replies of "
        f"{BATCH} per message)"
    )
    print(
        f"{'axis':<7} {'count':>6} {'tokens':>6}  {'variant':<16} {'µs/req':>8} {'user':>7} "
        f"{'sys':>7} {'×floor':>7} {'×first':>7} {'loop':>7} {'I/O':>7} {'loop×first':>10} "
        f"{'req/s':>8} {'batch':>6}"
    )
    for r in rows:
        to_floor = f"{r['to_floor']:.2f}" if r["to_floor"] and r["variant"] != "floor" else "-"
        print(
            f"{r['axis']:<7} {r['count']:>6} {r['prompt']:>6}  {r['variant']:<16} "
            f"{r['total_us']:8.2f} {r['user_us']:7.2f} {r['sys_us']:7.2f} {to_floor:>7} "
            f"{r['to_first']:7.2f} {r['loop_us']:7.2f} {r['io_us']:7.2f} "
            f"{r['loop_to_first']:10.2f} {r['requests_per_s']:8.0f} {r['reply_batch']:6.2f}"
        )
    print(
        "(×first: to the variant's own at the axis's first count; I/O: libzmq's I/O "
        "threads, loop: the rest)"
    )


def print_failover(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    transport = "tcp://127.0.0.1" if args.transport == "tcp" else "ipc://"
    print(
        f"\nthe coordinator (engine: an engine) SIGKILLed {args.kill_after:g} s into a steady "
        f"{args.failover_rate:g} requests/s ({args.failover_generate:g} s at the engine each, "
        f"1 in {failover.STREAM_EVERY} streaming; {failover.ENGINES} engine processes, "
        f"{transport}), median of {args.repeat}"
    )
    print(
        f"{'mode':<8} {'impl':<4} {'kill→reply':>10} {'kill→serve':>10} {'p99 before':>10} "
        f"{'p99 across':>10} {'added p99':>10} {'crossed':>7} {'lost':>5} {'failed':>6} "
        f"{'wrong':>5} {'twice':>5}  pause"
    )
    for r in rows:
        if "ttl_s" in r:
            pause = f"TTL {r['ttl_s']:g} s"
        elif "restart_delay_s" in r:
            pause = f"restart after {r['restart_delay_s']:g} s"
        else:  # engine: its requests moved on (twice: n/a, a migrated one starts again)
            pause = "-"
        print(
            f"{r['mode']:<8} {r['variant']:<4} {r['kill_to_first_reply_s']:9.3f}s "
            f"{r['kill_to_serving_s']:9.3f}s {r['p99_before_s']:9.3f}s {r['p99_crossed_s']:9.3f}s "
            f"{r['added_p99_s']:+9.3f}s {r['crossed']:7.0f} {r['lost']:5d} {r['failed']:6d} "
            f"{r['wrong']:5d} {r['started_twice']:5d}  {pause}"
        )
    for r in rows:
        if r["failed_by"]:
            kinds = ", ".join(f"{kind} {count}" for kind, count in sorted(r["failed_by"].items()))
            print(f"FAILED requests, {r['mode']} {r['variant']}: {kinds}")
    print(
        "(kill→reply: to the first reply after the new coordinator listened; added p99: of "
        "the requests in flight at the kill, over those answered before it; lost, failed, "
        "wrong, started twice: summed over the runs, each must be 0; engine: the engine's "
        "requests sent elsewhere, its streams going on from their tokens, every token "
        "checked against an undisturbed run)"
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
        "lengths": [p.key for p in args.lengths],
        "requests": {p.key: requests_at(args, p.tokens) for p in args.lengths},
        "thresholds": THRESHOLDS,
        "repeat": args.repeat,
        "variants": list(args.variants),
        "policy": args.policy,
        "dialect": args.dialect,
        "megatron_version": args.megatron_version,
        "window": args.window,
        "ranks": RANKS,
        "workload": args.workload,
        "reply_batch_max": ECHO_BATCH if args.workload == "megatron" else BATCH,
        "reply_at_once": args.workload == "megatron",
        "output_tokens": MEGATRON_OUTPUT_TOKENS if args.workload == "megatron" else OUTPUT_TOKENS,
        "reply_body_bytes": len(reply_body(args.workload)),
        "reply_bodies_bytes": {b: len(reply_body(args.workload, b)) for b in MEGATRON_BODIES},
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
        "latency": args.latency
        and {
            "variants": list(args.latency_variants),
            "senders": args.latency_clients,
            "seconds_per_point": args.latency_seconds,
            "min_rate": args.min_rate,
            "max_rate": args.max_rate,
            "sweep_from": args.sweep_from,
            "grid": f"{latency.BASE_RATE:.0f}/s × 2**(k/{latency.GRID})",
            "choke": f"p99 > {latency.CHOKE_P99:g} × the low-load p99 (the least of the "
            f"{latency.LOW_POINTS} lowest rates'), or answered/s < {latency.KEPT_UP:g} × scheduled",
            "engine_reply_batch_max": ECHO_BATCH,
        },
        "scale": args.scale
        and {
            "engines": list(args.scale_engines),
            "clients": list(args.scale_clients),
            "policies": list(args.scale_policies),
            "variants": list(args.scale_variants),
            "inflight": args.scale_inflight,
            "requests": args.scale_requests,
            "lengths": [p.key for p in args.scale_lengths],
            "reply_batch": BATCH,
        },
        "failover": args.failover
        and {
            "modes": list(args.failover_modes),
            "variants": list(args.failover_variants),
            "rate": args.failover_rate,
            "generate_s": args.failover_generate,
            "kill_after_s": args.kill_after,
            "restart_delay_s": args.restart_delay,
            "ttl_s": args.ha_ttl,
            "engines": failover.ENGINES,
            "stream_every": failover.STREAM_EVERY,
            "partial_every_s": failover.PARTIAL_EVERY,
            "prompt_tokens": failover.PROMPT_TOKENS,
            "coordinator_timeout_s": failover.COORDINATOR_TIMEOUT,
            "failover_timeout_s": failover.FAILOVER_TIMEOUT,
        },
    }


def plot(
    args: argparse.Namespace, summary: dict[str, dict[str, dict[str, Any]]], path: Path
) -> None:
    """µs/request against the bytes of the prompt's frame, the loop's thresholds marked."""
    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(7, 4.5))
    bodies = sorted({p.get("body", "") for point in summary.values() for p in point.values()})
    for variant, body in itertools.product(VARIANTS, bodies):
        points = sorted(
            (
                point[variant]
                for point in summary.values()
                if variant in point and point[variant].get("body", "") == body
            ),
            key=lambda p: p["frame_bytes"],
        )
        if not points:
            continue
        sizes = [p["frame_bytes"] for p in points]
        medians = [p["total_us"] for p in points]
        spread = [
            [m - p["min_total_us"] for m, p in zip(medians, points, strict=True)],
            [p["max_total_us"] - m for m, p in zip(medians, points, strict=True)],
        ]
        label = f"{variant}, {body} bodies" if body else variant
        axes.errorbar(sizes, medians, yerr=spread, marker="o", capsize=3, label=label)
    for name, size in THRESHOLDS.items():
        axes.axvline(size, color="grey", linestyle=":", linewidth=1)
        axes.annotate(name, (size, 1), xycoords=("data", "axes fraction"), fontsize=8,
                      rotation=90, va="top", ha="right", color="grey")  # fmt: skip
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.set_xlabel("bytes of the frame carrying the prompt")
    axes.set_ylabel("coordinator CPU per request (µs, user + sys)")
    axes.set_title(f"coordkit bench ({args.transport}, median of {args.repeat}, min-max bars)")
    _save(pyplot, figure, axes, path)


def plot_latency(args: argparse.Namespace, result: dict[str, Any], path: Path) -> None:
    """The choke curve: the client-observed p99 latency against the offered rate, one
    curve per variant and one, dashed, for direct (no coordinator: the transport's own),
    a panel per prompt; a cross where a point choked. The gap to direct is the latency
    the coordinator adds (plotted raw: noise makes a difference of two p99s negative)."""
    pyplot = _pyplot()
    prompts = list(dict.fromkeys(p["prompt"] for p in result["points"]))
    figure, panels = pyplot.subplots(
        1, len(prompts), figsize=(6 * len(prompts), 4.5), squeeze=False
    )
    for axes, prompt in zip(panels[0], prompts, strict=True):
        for variant in ("direct", *args.latency_variants):
            points = sorted(
                (p for p in result["points"] if (p["variant"], p["prompt"]) == (variant, prompt)),
                key=lambda p: p["offered"],
            )
            if not points:
                continue
            rates = [p["offered"] for p in points]
            p99 = [p["p99_us"] for p in points]
            if variant == "direct":
                axes.plot(rates, p99, "k--", linewidth=1, label="direct (no coordinator)")
                continue
            low = result["summary"].get(f"{variant}/{prompt}", {}).get("low_load_p99_us", math.inf)
            (line,) = axes.plot(rates, p99, marker="o", markersize=3, label=variant)
            chokes = [(r, v) for r, v, p in zip(rates, p99, points, strict=True)
                      if latency.choked(p, low)]  # fmt: skip
            if chokes:
                axes.scatter(*zip(*chokes, strict=True), marker="x", s=60, color=line.get_color())
        axes.set_xscale("log")
        axes.set_yscale("log")
        axes.set_xlabel("offered load (requests/s, Poisson)")
        axes.set_ylabel("p99 latency, client-observed (µs)")
        axes.set_title(f"{prompt} tokens ({args.transport}, {args.latency_clients} sender(s))")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    _save(pyplot, figure, None, path)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    from matplotlib import pyplot

    return pyplot


def _save(pyplot: Any, figure: Any, axes: Any, path: Path) -> None:
    if axes is not None:
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    pyplot.close(figure)
