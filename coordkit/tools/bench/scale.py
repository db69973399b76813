"""``coordkit bench --scale``: the coordinator's CPU per request against the fleet's size.

The cost table's method (``getrusage`` of the coordinator process around a
measured closed-window load, medians of ``--repeat``) at points of two axes:

* engines: ``--scale-engines`` ranks (2, 64, 512, 1 000), all hosted by one
  engine process, each rank its own connection and identity (:mod:`.load`),
  for the floor and ``c`` under each of ``--scale-policies``, one client;
* clients: ``--scale-clients`` clients (1, 100, 1 000, 10 000), all hosted by
  one client process likewise, for the floor and ``c`` (``--policy``), two ranks.

**Batching held equal.** Every rank answers in messages of exactly
``BATCH`` requests (it waits for its batch to fill; short batches go out
only at the end of a load), and the same number of requests is in flight at
every point of both axes (``--scale-inflight``, at least ``2 × BATCH`` per
rank of the largest fleet, so that every rank's batches fill): the
coordinator then gets the same messages per request and holds the same
number of requests at every point, and only the number of peers it spreads
them over differs. The clients share the window evenly (20 000 over 10 000
clients: 2 each, each sending its next request when one of its replies
comes). The floor's engine echoes every request on its own (a proxy cannot
batch), at every point alike. ``max_engines`` and ``max_clients`` are raised
where a point needs more than their defaults; every process lifts its
open-file limit to the hard one, which must allow a descriptor per connection.

Reported per point: µs/request (user + sys), its ratio to the floor's at the
same point and to the variant's own at the axis's first point; and that CPU
split between libzmq's I/O threads (``I/O``: the sockets' reads and writes, the
transport's share) and the rest (``loop``: the thread that runs the loop, with
the libzmq calls it makes), with the loop's ratio to its own at the first point.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
from typing import Any

from ... import Coordinator
from .session import Failure, Session
from .workload import BATCH, RANKS

ENGINE_COUNTS = (2, 64, 512, 1000)
CLIENT_COUNTS = (1, 100, 1000, 10_000)
INFLIGHT = 20_000
SCALE_VARIANTS = ("floor", "c", "py")
_FIGURES = ("total_us", "user_us", "sys_us", "loop_us", "io_us", "requests_per_s", "reply_batch")


def _default(option: str) -> int:
    return int(inspect.signature(Coordinator).parameters[option].default)


def measure_scale(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    """Both axes: each point's sessions alive together, the variants taking turns."""
    for axis, counts in (("engines", args.scale_engines), ("clients", args.scale_clients)):
        for count in counts:
            ranks, clients = (count, 1) if axis == "engines" else (RANKS, count)
            plan = []  # (label, variant, policy)
            for variant in args.scale_variants:
                if variant == "floor":
                    plan.append(("floor", variant, args.policy))
                elif axis == "engines":
                    plan += [(f"{variant} {p}", variant, p) for p in args.scale_policies]
                else:
                    plan.append((f"{variant} {args.policy}", variant, args.policy))
            options = {
                "max_engines": max(ranks, _default("max_engines")),
                "max_clients": max(clients, _default("max_clients")),
            }
            where = (axis, count, ranks, clients)
            _measure_point(args, directory, where, plan, options, runs, failures)


def _measure_point(
    args: argparse.Namespace,
    directory: str,
    where: tuple[str, int, int, int],
    plan: list[tuple[str, str, str]],
    options: dict[str, Any],
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    axis, count, ranks, clients = where
    sessions: dict[str, Session] = {}
    try:
        for label, variant, policy in plan:
            point_args = argparse.Namespace(**{**vars(args), "policy": policy})
            try:
                sessions[label] = Session(
                    variant, point_args, directory, options, ranks=ranks, clients=clients
                )
            except Failure as exc:
                failures[f"scale {label} at {count} {axis}"] = str(exc)
        window = args.scale_inflight
        for repetition in range(args.repeat):
            for prompt in args.scale_lengths:
                n = args.scale_requests
                for label in list(sessions):
                    try:
                        run = sessions[label].run(prompt, n, 2 * window, window)
                    except Failure as exc:
                        failures[f"scale {label} at {count} {axis}"] = str(exc)
                        sessions.pop(label).close()
                        continue
                    run.update(axis=axis, count=count, label=label, repetition=repetition)
                    run.update(prompt.describe())
                    runs.append(run)
                    print(
                        f"[{repetition + 1}/{args.repeat}] scale {count:>6} {axis:<7} "
                        f"{label:<18} {prompt.key:>6} tokens: {run['total_us']:8.2f} µs/request, "
                        f"{run['requests_per_s']:8.0f} req/s, reply batch {run['reply_batch']:.1f}",
                        file=sys.stderr,
                    )
    finally:
        for session in sessions.values():
            session.close()


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (axis, prompt, count, variant): medians, and the two ratios."""
    groups: dict[tuple[str, str, int, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["axis"], run["prompt"], run["count"], run["label"]), []).append(run)
    rows = {
        key: {
            "axis": key[0],
            "prompt": key[1],
            "count": key[2],
            "variant": key[3],
            "repetitions": len(group),
            **{f: statistics.median(r[f] for r in group) for f in _FIGURES},
        }
        for key, group in groups.items()
    }
    for (axis, prompt, count, label), row in rows.items():
        floor = rows.get((axis, prompt, count, "floor"))
        first = min(c for a, p, c, v in rows if (a, p, v) == (axis, prompt, label))
        own = rows[(axis, prompt, first, label)]
        row["to_floor"] = row["total_us"] / floor["total_us"] if floor else None
        row["to_first"] = row["total_us"] / own["total_us"]
        row["loop_to_first"] = row["loop_us"] / own["loop_us"]
        row["first_count"] = first
    return sorted(rows.values(), key=lambda r: (r["axis"], r["prompt"], r["count"]))


def check(args: argparse.Namespace, error: Any) -> None:
    """The window must fill every rank's batches and give every client one request."""
    largest = max(args.scale_engines)
    if args.scale_inflight < 2 * BATCH * largest:
        error(
            f"--scale-inflight {args.scale_inflight} is below 2 × {BATCH} × {largest} ranks: "
            "the ranks' batches would not fill"
        )
    if args.scale_inflight < max(args.scale_clients):
        error("--scale-inflight must give each of --scale-clients a request in flight")
    if min(args.scale_engines + args.scale_clients) < 1:
        error("--scale-engines and --scale-clients must be positive")
