"""``coordkit bench --fairness``: how the coordinator shares engines among tenants under
overload (docs/queueing.md).

Real processes: a ``coordkit serve`` coordinator, ``--fairness-engines`` FakeEngine
processes of a fixed capacity (``CAPACITY`` requests at once each, ``--fairness-step``
seconds a step, ``--fairness-tokens`` steps a request), and one client process per
tenant, all started together. A *flood* tenant keeps ``FLOOD`` times the fleet's
capacity in flight (a closed window: it sends again as each request ends); a *light*
one sends Poisson arrivals at ``LIGHT`` of the fleet's service rate (capacity /
seconds per request). Scenarios, each with the criterion it is held to:

* ``alone``: the light tenant by itself: the reference p99;
* ``flood``: a flood beside the light tenant: the light p99 within 3× of alone's,
  nothing refused;
* ``weights``: two floods weighted 3:1 (``--tenant-weight``): their dispatches 3:1
  within 15%;
* ``equal``: four floods of equal weight: Jain's index of their dispatches >= 0.95;
* ``priority``: a light tenant of priority -1 beside a flood of priority 5: its p99
  within 3× of alone's.

Each runs *queued*: the engines declare their capacity (``fake-engine --batch``) and
the coordinator caps them too (``--max-inflight-per-engine``), so that what finds no
room waits at the coordinator (where it does not queue yet, it is refused: BUSY, which
the report counts). ``flood`` also runs *unqueued*: nothing declared, the engines take
everything and queue it themselves, first come first served; ``--plot`` draws the light
tenant's latency over time in both. Dispatches are counted as the requests answered
between the first and the last fifth of the run, when every flood has work waiting.

The figures are measurements; the criteria say whether a run met them (``PASS``,
``FAIL``), and nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import random
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from ...client import Client, CoordinatorError
from ..engines import CoordinatorProcess, fake_engine_processes

#: Requests each fake engine runs at once: its cost model's batch, the same whether it
#: declares it (queued) or not (unqueued), so that only where the rest waits differs.
CAPACITY = 64
#: A flood keeps this many times the fleet's capacity in flight; a light tenant sends
#: this fraction of the fleet's service rate.
FLOOD, LIGHT = 10, 0.05
#: Seconds a flood's slot waits after a refusal before it sends again (a coordinator that
#: refuses would otherwise be asked again at once, in a loop that only burns CPU).
REFUSED_BACKOFF = 0.01
#: What the scenarios are held to (docs/queueing.md).
LATENCY_RATIO, SHARE_TOLERANCE, MIN_JAIN = 3.0, 0.15, 0.95
SCENARIOS = ("alone", "flood", "weights", "equal", "priority")
#: Seconds from the tenants' start to their loads' (their processes start and connect
#: meanwhile), and past the loads' end that their last requests may take.
START_AFTER, RESULTS_WITHIN = 5.0, 120.0
_SPAWN = multiprocessing.get_context("spawn")


@dataclass(frozen=True)
class Tenant:
    """One tenant's load: a flood (``window`` > 0) or Poisson arrivals at ``rate``."""

    name: str
    priority: int = 0
    window: int = 0
    rate: float = 0.0


@dataclass(frozen=True)
class Scenario:
    name: str
    tenants: tuple[Tenant, ...]
    weights: tuple[tuple[str, float], ...] = ()
    queued: bool = True

    @property
    def label(self) -> str:
        return self.name if self.queued else f"{self.name} (unqueued)"


def scenarios(engines: int, seconds_per_request: float) -> list[Scenario]:
    """The scenarios of the docstring, for a fleet of ``engines`` fake engines."""
    capacity = engines * CAPACITY
    window, rate = FLOOD * capacity, LIGHT * capacity / seconds_per_request
    light, flood = Tenant("light", rate=rate), Tenant("flood", window=window)
    return [
        Scenario("alone", (light,)),
        Scenario("flood", (flood, light)),
        Scenario("flood", (flood, light), queued=False),
        Scenario(
            "weights",
            (Tenant("heavy", window=window), Tenant("lighter", window=window)),
            (("heavy", 3.0), ("lighter", 1.0)),
        ),
        Scenario("equal", tuple(Tenant(f"equal-{i}", window=window) for i in range(4))),
        Scenario("priority", (Tenant("flood", 5, window=window), Tenant("urgent", -1, rate=rate))),
    ]


# -- a tenant's process ----------------------------------------------------------------------


def tenant_child(
    conn: Connection, address: str, engines: int, tenant: Tenant, start_at: float, seconds: float
) -> None:
    """One tenant's client: once ``engines`` are registered, its load from ``start_at``
    (time.time()) for ``seconds``; sends back (whether the coordinator queues,
    [(sent, latency or None, outcome)])."""
    conn.send(asyncio.run(_tenant_load(address, engines, tenant, start_at, seconds)))
    conn.close()


async def _tenant_load(
    address: str, engines: int, tenant: Tenant, start_at: float, seconds: float
) -> tuple[bool, list[tuple[float, float | None, str]]]:
    records: list[tuple[float, float | None, str]] = []
    async with await Client.connect(address, tenant=tenant.name, failover_timeout=0) as client:
        await client.wait_for_engines(engines, timeout=60.0)
        await asyncio.sleep(max(start_at - time.time(), 0.0))
        started = time.monotonic()
        end = started + seconds

        async def one() -> None:
            sent = time.monotonic()
            try:
                await client.submit([1, 2, 3], priority=tenant.priority)
                records.append((sent - started, time.monotonic() - sent, "ok"))
            except CoordinatorError as exc:
                records.append((sent - started, None, getattr(exc.code, "name", str(exc.code))))
                if tenant.window:
                    await asyncio.sleep(REFUSED_BACKOFF)

        tasks: set[asyncio.Task[None]] = set()
        if tenant.window:
            while time.monotonic() < end:
                while len(tasks) < tenant.window:
                    tasks.add(asyncio.ensure_future(one()))
                done, tasks = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        else:
            draw = random.Random(tenant.name)
            due = started
            while (due := due + draw.expovariate(tenant.rate)) < end:
                await asyncio.sleep(max(due - time.monotonic(), 0.0))
                tasks.add(asyncio.ensure_future(one()))
        await asyncio.gather(*tasks)
        return client.qos, records


# -- one scenario ------------------------------------------------------------------------------


def run_scenario(scenario: Scenario, args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """The scenario's processes, their load, and what each tenant saw."""
    address = f"ipc://{directory}/fairness-{len(list(Path(directory).iterdir()))}.sock"
    options = ["--implementation", args.fairness_implementation, "--policy", "least_loaded"]
    engine_options = [
        "--latency", str(args.fairness_step),
        "--output-tokens", str(args.fairness_tokens),
        "--heartbeat", "0",
    ]  # fmt: skip
    if scenario.queued:
        options += ["--max-inflight-per-engine", str(CAPACITY)]
        engine_options += ["--batch", str(CAPACITY)]
    for name, weight in scenario.weights:
        options += ["--tenant-weight", f"{name}={weight}"]
    log = Path(directory) / f"coordinator-{scenario.name}-{int(scenario.queued)}.log"
    coordinator = CoordinatorProcess(address, options, log)
    try:
        with fake_engine_processes(address, args.fairness_engines, engine_options):
            results = _load(address, args.fairness_engines, scenario, args.fairness_seconds)
    finally:
        coordinator.stop()
    return {
        "scenario": scenario.name,
        "label": scenario.label,
        "queued": scenario.queued,
        # whether the coordinator granted priorities and deadlines: it queues
        "queue": all(granted for granted, _ in results.values()),
        "tenants": {
            tenant.name: summarize_tenant(tenant, results[tenant.name][1], args.fairness_seconds)
            for tenant in scenario.tenants
        },
        "records": {name: records for name, (_, records) in results.items()},
    }


def _load(
    address: str, engines: int, scenario: Scenario, seconds: float
) -> dict[str, tuple[bool, list[tuple[float, float | None, str]]]]:
    """Every tenant's process, their loads started together (once all connected)."""
    start_at = time.time() + START_AFTER
    children = []
    for tenant in scenario.tenants:
        ours, theirs = _SPAWN.Pipe()
        process = _SPAWN.Process(
            target=tenant_child,
            args=(theirs, address, engines, tenant, start_at, seconds),
            name=f"coordkit-fairness-{tenant.name}",
            daemon=True,
        )
        process.start()
        children.append((tenant, process, ours))
    results = {}
    try:
        for tenant, process, conn in children:
            if not conn.poll(START_AFTER + seconds + RESULTS_WITHIN):
                raise RuntimeError(f"{scenario.label}: tenant {tenant.name} sent no results")
            try:
                results[tenant.name] = conn.recv()
            except EOFError:
                raise RuntimeError(f"{scenario.label}: tenant {tenant.name} failed") from None
            process.join()
    finally:
        for _, process, _ in children:
            if process.is_alive():
                process.kill()
    return results


# -- the figures ---------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """The ``p``-th percentile (nearest rank) of ``values``; None for none."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(p / 100 * len(ordered)) - 1)]


def jain(values: list[float]) -> float | None:
    """Jain's fairness index: 1 when every value is equal, 1/n when one takes all."""
    if not values or not any(values):
        return None
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values))


def summarize_tenant(
    tenant: Tenant, records: list[tuple[float, float | None, str]], seconds: float
) -> dict[str, Any]:
    """Sent, answered, refused (BUSY) and failed otherwise; the answered ones' latency
    percentiles; and ``steady``: those answered among the requests sent between the
    first and the last fifth of the run (when every flood has work waiting)."""
    latencies = [latency for _, latency, _ in records if latency is not None]
    steady = [r for r in records if seconds / 5 <= r[0] < seconds * 4 / 5 and r[2] == "ok"]
    return {
        "priority": tenant.priority,
        "kind": "flood" if tenant.window else "light",
        "sent": len(records),
        "answered": len(latencies),
        "refused": sum(outcome == "BUSY" for *_, outcome in records),
        "failed": sum(outcome not in ("ok", "BUSY") for *_, outcome in records),
        "p50_s": percentile(latencies, 50),
        "p99_s": percentile(latencies, 99),
        "steady": len(steady),
    }


def criteria(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each queued scenario held to its criterion: the figure, the bound, whether met."""
    by_label = {run["label"]: run for run in runs}
    alone = by_label.get("alone", {}).get("tenants", {}).get("light", {}).get("p99_s")
    checks = []

    def check(name: str, figure: float | None, bound: str, met: bool) -> None:
        checks.append({"criterion": name, "figure": figure, "bound": bound, "met": met})

    if (flood := by_label.get("flood")) is not None:
        p99 = flood["tenants"]["light"]["p99_s"]
        ratio = p99 / alone if p99 is not None and alone else None
        check("flood: light p99 / alone's", ratio, f"<= {LATENCY_RATIO}",
              ratio is not None and ratio <= LATENCY_RATIO)  # fmt: skip
        refused = sum(t["refused"] for t in flood["tenants"].values())
        check("flood: requests refused", refused, "== 0", refused == 0)
    if (weights := by_label.get("weights")) is not None:
        heavy, lighter = (weights["tenants"][n]["steady"] for n in ("heavy", "lighter"))
        share = heavy / lighter if lighter else None
        check("weights 3:1: dispatches heavy / lighter", share,
              f"3 ± {SHARE_TOLERANCE:.0%}",
              share is not None and abs(share / 3 - 1) <= SHARE_TOLERANCE)  # fmt: skip
    if (equal := by_label.get("equal")) is not None:
        index = jain([t["steady"] for t in equal["tenants"].values()])
        check("equal: Jain's index of dispatches", index, f">= {MIN_JAIN}",
              index is not None and index >= MIN_JAIN)  # fmt: skip
    if (priority := by_label.get("priority")) is not None:
        p99 = priority["tenants"]["urgent"]["p99_s"]
        ratio = p99 / alone if p99 is not None and alone else None
        check("priority: urgent (-1) p99 / alone's", ratio, f"<= {LATENCY_RATIO}",
              ratio is not None and ratio <= LATENCY_RATIO)  # fmt: skip
    return checks


# -- the mode ------------------------------------------------------------------------------------


def measure_fairness(
    args: argparse.Namespace, directory: str, result: dict[str, Any], failures: dict[str, str]
) -> None:
    """Every scenario asked for, in turn; ``result`` gets the runs and the criteria."""
    seconds_per_request = args.fairness_step * args.fairness_tokens
    runs = []
    for scenario in scenarios(args.fairness_engines, seconds_per_request):
        if scenario.name not in args.fairness_scenarios:
            continue
        try:
            run = run_scenario(scenario, args, directory)
        except (ConnectionError, RuntimeError) as exc:
            failures[f"fairness {scenario.label}"] = str(exc)
            continue
        runs.append(run)
        light = [
            f"{n}: p99 {_ms(t['p99_s'])}" for n, t in run["tenants"].items() if t["kind"] == "light"
        ]
        print(
            f"fairness {scenario.label:>18}: "
            + ", ".join(
                f"{n} {t['steady']} answered, {t['refused']} refused"
                for n, t in run["tenants"].items()
            )
            + ("; " + ", ".join(light) if light else ""),
            file=sys.stderr,
        )
    result["runs"] = runs
    result["criteria"] = criteria(runs)


def print_fairness(result: dict[str, Any]) -> None:
    """The runs, tenant by tenant, then each criterion with its figure."""
    if not result.get("runs"):
        return
    print("\nfairness (docs/queueing.md): per tenant, the run's requests")
    print(f"{'scenario':>20} {'queue':>5} {'tenant':>10} {'prio':>4} {'sent':>7} {'answered':>8} "
          f"{'refused':>7} {'steady':>7} {'p50':>9} {'p99':>9}")  # fmt: skip
    for run in result["runs"]:
        for name, t in run["tenants"].items():
            print(
                f"{run['label']:>20} {'yes' if run['queued'] else 'no':>5} {name:>10} "
                f"{t['priority']:>4} {t['sent']:>7} {t['answered']:>8} {t['refused']:>7} "
                f"{t['steady']:>7} {_ms(t['p50_s']):>9} {_ms(t['p99_s']):>9}"
            )
    for check in result["criteria"]:
        figure = check["figure"]
        shown = "-" if figure is None else f"{figure:.3g}"
        verdict = "PASS" if check["met"] else "FAIL"
        print(f"  {verdict} {check['criterion']}: {shown} (bound {check['bound']})")


def plot_fairness(result: dict[str, Any], path: Path) -> None:
    """The light tenant's latency against its send time, beside a flood, with the queue
    and without (the engines queueing everything themselves)."""
    from .report import _pyplot, _save

    pyplot = _pyplot()
    figure, axes = pyplot.subplots(figsize=(8, 4.5))
    for run in result.get("runs", []):
        if run["scenario"] != "flood":
            continue
        points = [(sent, latency * 1000) for sent, latency, _ in run["records"]["light"]
                  if latency is not None]  # fmt: skip
        if points:
            where = "at the coordinator" if run["queued"] else "in the engines (none declared)"
            axes.scatter(*zip(*points, strict=True), s=6, label=f"capacity full: waits {where}")
    axes.set_yscale("log")
    axes.set_xlabel("time (s)")
    axes.set_ylabel("light tenant's latency (ms)")
    axes.set_title(f"beside a flood at {FLOOD}x capacity (light: {LIGHT:.0%} of it)")
    _save(pyplot, figure, axes, path)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}ms"
