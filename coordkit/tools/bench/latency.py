"""``coordkit bench --latency``: the latency a coordinator adds under open-loop load.

A closed window hides queueing: its clients wait for replies before they
send again, so a slow coordinator only slows the load down. Here the
clients send on a schedule whatever the replies do -- Poisson arrivals at a
fixed offered rate per point, from one or several client processes (each a
raw pyzmq socket with its share of the rate; superposed Poisson processes
are one) -- and every request's client-observed latency is recorded: the
time from its send to its reply's arrival. An engine process (two ranks)
answers what it reads at once, up to ``ECHO_BATCH`` per reply.

**Pacing.** A sender that sleeps per message cannot keep 50 000/s. Each
client draws its schedule first, then sends whatever is due in bursts
against the clock, and between bursts waits on its socket (``select`` on
libzmq's descriptor, with the time to the next send as the timeout), so
that replies are timestamped as they come. Each request's scheduled and
actual send times are kept: the JSON says how late the sends were (``lag``)
and whether the senders kept up (``send_rate`` against the rate scheduled).

**The floor of the transport.** The same load runs with no coordinator
(``direct``: the clients connected to the engine itself) at every offered
rate a variant is measured at, in the same run; each point reports its
latency percentiles minus direct's at that rate.

**The sweep.** Offered rates sit on one grid, ``1000/s × 2**(k/4)``, so that
variants share rates and direct is measured once per rate. From
``--min-rate`` the rate doubles until the variant chokes -- its p99 above
10× its low-load p99 (the least p99 of its three lowest offered rates:
noise only ever raises one), or its replies per second below 95% of the
requests scheduled -- then bisects to one grid step; the highest rate
below the choke that lasts (every higher rate chokes too) is its saturation
throughput. A point that chokes is
measured again and the better of the two kept (the other's figures under
``discarded``): a stall of a shared machine seldom strikes twice, a queue
always does. Then the sweep fills in every other grid step from a tenth of
the saturation (``--sweep-from``) to two steps past it.

A point's statistics are those of the requests scheduled after its first
tenth (the queues filling): their latency percentiles, and how many of them
were sent and answered before the point's end, per second (``send_rate``,
``achieved``). Every request is answered before the next point, so no point
inherits another's backlog. ``on_schedule`` says whether 99% of the sends
left within 1 ms of their time (a sender that falls behind and catches up
keeps its rate but sends bursts instead of Poisson arrivals).

**The generator's own limit.** A point whose senders sent less than 95% of
what they scheduled was limited by the load generator (or by what the
machine left it), not by the coordinator: its flag ``generator_kept_up`` is
false, a variant whose choke point has it false has a saturation that is a
lower bound, and the report says so (``--latency-clients`` adds senders).
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import resource
import select
import sys
import time
from array import array
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from .load import commands, connect_client, frames_sender, head_receiver, read_rid, submitter
from .session import Failure, Session
from .workload import DIRECT, TIMEOUT, Prompt

GRID = 4  # grid steps per doubling of the offered rate
BASE_RATE = 1000.0  # requests/s at grid step 0
CHOKE_P99 = 10.0  # a point chokes when its p99 exceeds this many times the low-load p99
KEPT_UP = 0.95  # ... or when fewer replies than this share of the scheduled requests came
LOW_POINTS = 3  # the low-load p99 is the least of this many lowest rates'
WARM_FRACTION = 0.1  # the part of a point its statistics leave out
LATENCY_LENGTHS = (16, 2000)
LATENCY_VARIANTS = ("floor", "c", "py", "mono")
ON_SCHEDULE = 1e-3  # seconds: a point whose sends are this late at p99 was not on schedule
MIN_REQUESTS = 1000  # a point lasts long enough for this many requests, up to 4 × its seconds
_LEAD = 0.02  # seconds between a point's start and its first scheduled send
_BURST = 64  # sends before the client reads its replies again
_SEARCH_DOWN = 3  # octaves below --min-rate the search goes when that already chokes


def rate_at(k: int) -> float:
    return BASE_RATE * 2 ** (k / GRID)


def grid_at(rate: float) -> int:
    return round(GRID * math.log2(rate / BASE_RATE))


# -- the client ---------------------------------------------------------------------------


def open_loop_child(
    conn: Connection,
    variant: str,
    single_frame: bool,
    address: str,
    prefix: bool,
    index: int,
    fields: int,
) -> None:
    """One sender: Poisson arrivals at the rate it is given, every time recorded."""
    context = zmq.Context()
    try:
        sock = connect_client(context, variant, address)
        conn.send(("ready",))
        rid = 0  # never reused: a coordinator would refuse a duplicate in flight
        for _, prompt, rate, seconds in commands(conn):
            # the same arrivals for every variant (and direct) at a rate
            schedule = _poisson(random.Random(f"{index}/{rate}/{seconds}"), rate, seconds)
            submit = submitter(single_frame, prompt, prefix, fields)
            conn.send(("prepared",))
            start = conn.recv()[1]  # ("go", start): the same for every sender
            before = _cpu()
            gc.disable()  # no collector's pause in the middle of a schedule
            try:
                sent, received = _open_loop(sock, submit, rid, schedule, start)
            finally:
                gc.enable()
            cpu = _cpu() - before
            rid += len(schedule)
            arrays = (schedule.tobytes(), sent.tobytes(), received.tobytes())
            conn.send(("done", cpu, *arrays))
    finally:
        context.destroy(linger=0)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _poisson(rng: random.Random, rate: float, seconds: float) -> array[float]:
    """Send times (seconds from the start) of a Poisson process of ``rate`` over ``seconds``."""
    times = array("d")
    t = rng.expovariate(rate)
    while t < seconds:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def _open_loop(
    sock: zmq.Socket,
    submit: Callable[[int], list[Any]],
    first: int,
    schedule: array[float],
    start: float,
) -> tuple[array[float], array[float]]:
    """Send request ``first + i`` at ``start + schedule[i]`` (``time.perf_counter``, the
    same clock in every process); when each was sent and its reply came, from ``start``.
    Returns once every request is answered."""
    n = len(schedule)
    sent = array("d", bytes(8 * n))
    received = array("d", [math.nan]) * n
    perf, send, receive = time.perf_counter, frames_sender(sock), head_receiver(sock, 1)
    events = sock.getsockopt
    fd = int(sock.getsockopt(zmq.FD))
    i = done = 0
    while done < n:
        now = perf() - start
        burst = 0
        while i < n and schedule[i] <= now and burst < _BURST:
            send(submit(first + i))
            sent[i] = perf() - start
            i += 1
            burst += 1
        while True:
            try:
                metadata = receive()[0]
            except zmq.Again:
                break
            if metadata[1:2] != b"\x15":  # [21, ...]: ENGINE_REPLY
                raise RuntimeError(f"unexpected reply {metadata[:80]!r}")
            received[read_rid(metadata) - first] = perf() - start
            done += 1
        if done == n:
            break
        if burst == _BURST or int(events(zmq.EVENTS)) & zmq.POLLIN:
            continue  # more is due, or came: no wait
        # libzmq's descriptor signals a change of its events (edge-triggered): read above.
        wait = schedule[i] - (perf() - start) if i < n else TIMEOUT
        if wait > 0 and not select.select([fd], [], [], wait)[0] and i == n:
            raise TimeoutError(f"no reply for {TIMEOUT:.0f} s ({done} of {n} answered)")
    return sent, received


# -- a point ------------------------------------------------------------------------------


class OpenLoop(Session):
    """A variant's coordinator and engine (``direct``: the engine alone), with
    ``--latency-clients`` senders."""

    def __init__(
        self,
        variant: str,
        args: argparse.Namespace,
        directory: str,
        single_frame: bool | None = None,
    ):
        super().__init__(
            variant, args, directory, clients=0, at_once=True, single_frame=single_frame
        )
        try:
            self.senders = [
                self._start(
                    f"client-{index}",
                    open_loop_child,
                    variant,
                    self.single_frame,
                    self.address,
                    self.prefix,
                    index,
                    self.fields,
                )
                for index in range(args.latency_clients)
            ]
            for sender in self.senders:
                self._receive(sender)
        except BaseException:
            self.close()
            raise

    def point(self, prompt: Prompt, rate: float, seconds: float) -> dict[str, Any]:
        for sender in self.senders:  # they draw their schedules
            sender.conn.send(("point", prompt, rate / len(self.senders), seconds))
        for sender in self.senders:
            self._receive(sender)
        served = self.variant not in DIRECT
        before = self._call(self.coordinator, ("sample",))[1] if served else None
        start = time.perf_counter() + _LEAD
        for sender in self.senders:
            sender.conn.send(("go", start))
        records, cpu = [], 0.0
        for sender in self.senders:
            _, used, *arrays = self._receive(sender, timeout=None)
            records.append([array("d", data) for data in arrays])
            cpu += used
        point = _statistics(records, rate, seconds)
        point["senders"] = len(self.senders)
        n = max(sum(len(r[0]) for r in records), 1)
        # the senders' own CPU (every thread): what the generator needs at this rate
        point["sender_cpu_us"] = cpu / n * 1e6
        if before is not None:
            # the coordinator's (every thread, libzmq's I/O thread included) and its
            # context switches, per request: on a shared machine, steadier than latency
            after = self._call(self.coordinator, ("sample",))[1]
            used = after["user"] + after["sys"] - before["user"] - before["sys"]
            point["coordinator_cpu_us"] = used / n * 1e6
            point["coordinator_switches"] = (after["switches"] - before["switches"]) / n
        return point


def _statistics(records: list[list[array[float]]], rate: float, seconds: float) -> dict[str, Any]:
    """A point's figures from every sender's (scheduled, sent, received) times."""
    skip = seconds * WARM_FRACTION
    span = seconds - skip
    latencies: list[float] = []
    lags: list[float] = []
    sends = replies = 0
    for schedule, sent, received in records:
        for scheduled, at, back in zip(schedule, sent, received, strict=True):
            if scheduled >= skip:  # of the window's requests, those sent and answered in it
                latencies.append(back - at)
                lags.append(at - scheduled)
                sends += at < seconds
                replies += back < seconds
    latencies.sort()
    lags.sort()
    scheduled_rate = len(latencies) / span
    send_rate = sends / span
    return {
        "offered": rate,
        "seconds": seconds,
        "requests": len(latencies),
        "scheduled_rate": scheduled_rate,
        "send_rate": send_rate,
        "achieved": replies / span,
        "p50_us": _percentile(latencies, 0.5) * 1e6,
        "p99_us": _percentile(latencies, 0.99) * 1e6,
        "p999_us": _percentile(latencies, 0.999) * 1e6,
        "max_us": latencies[-1] * 1e6 if latencies else math.nan,
        # how far the sends were from their schedule
        "lag_p50_us": _percentile(lags, 0.5) * 1e6,
        "lag_p99_us": _percentile(lags, 0.99) * 1e6,
        "lag_max_us": lags[-1] * 1e6 if lags else math.nan,
        "late_1ms": sum(lag > 1e-3 for lag in lags) / max(len(lags), 1),
        "generator_kept_up": send_rate >= KEPT_UP * scheduled_rate,
        # kept up on average, and each send close to its time: the arrivals were Poisson
        "on_schedule": _percentile(lags, 0.99) <= ON_SCHEDULE,
    }


def _percentile(ordered: list[float], q: float) -> float:
    """Nearest rank."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# -- the sweep ----------------------------------------------------------------------------


def low_load_p99(points: dict[int, dict[str, Any]]) -> float:
    """The p99 at low load: the least of the lowest three rates' (a noisy point is high)."""
    return min(points[k]["p99_us"] for k in sorted(points)[:LOW_POINTS])


def choked(point: dict[str, Any], low_p99_us: float) -> bool:
    return bool(
        point["achieved"] < KEPT_UP * point["scheduled_rate"]
        or point["p99_us"] > CHOKE_P99 * low_p99_us
    )


def sweep(measure: Callable[[int], dict[str, Any]], args: argparse.Namespace) -> dict[int, Any]:
    """Points (grid step -> figures) from a search for the choke and a sweep around it."""
    points: dict[int, dict[str, Any]] = {}

    def at(k: int) -> dict[str, Any]:
        if k not in points:
            measure_into(points, k, measure)
        return points[k]

    def chokes(k: int) -> bool:
        return choked(at(k), low_load_p99(points))

    low, top = grid_at(args.min_rate), grid_at(args.max_rate)
    good: int | None = None
    bad: int | None = None
    k = low
    while not chokes(k):  # doubling up
        good = k
        if k >= top:
            break
        k = min(k + GRID, top)
    else:
        bad = k
    k = low
    while good is None and k > low - _SEARCH_DOWN * GRID:  # the first rate choked: halving
        k -= GRID
        if chokes(k):
            bad = k
        else:
            good = k
    while good is not None and bad is not None and bad - good > 1:  # bisecting
        middle = (good + bad) // 2
        if chokes(middle):
            bad = middle
        else:
            good = middle
    if good is not None:  # from --sweep-from of the saturation, every other step, to past it
        down = math.ceil(-GRID * math.log2(args.sweep_from))
        steps = set(range(good - down, good, 2)) | {good - 1}
        steps |= {bad, bad + 1} if bad is not None else set()
        for k in sorted(steps):
            at(k)
    return points


def measure_into(
    points: dict[int, dict[str, Any]], k: int, measure: Callable[[int], dict[str, Any]]
) -> None:
    """``points[k]``, measured again if it chokes: of the two, the one that did not
    choke, else the lower p99 (a stall of the machine seldom strikes twice, a queue
    always does)."""
    points[k] = measure(k)
    if choked(points[k], low_load_p99(points)):
        first, again = points[k], measure(k)
        low = low_load_p99({**points, k: again})
        kept, other = sorted((first, again), key=lambda p: (choked(p, low), p["p99_us"]))
        kept["discarded"] = {f: other[f] for f in ("p50_us", "p99_us", "achieved", "send_rate")}
        points[k] = kept


def summarize(points: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """A variant's saturation: the highest offered rate below the choke that lasts (from
    which every higher rate measured chokes too). A choke below a rate that kept up,
    confirmed twice all the same, is a stall of the machine, not a queue: listed under
    ``isolated_chokes``, not taken for the saturation."""
    ordered = sorted(points)
    low_p99 = low_load_p99(points)
    chokes = {k: choked(points[k], low_p99) for k in ordered}
    chokes_at = None
    for k in reversed(ordered):
        if not chokes[k]:
            break
        chokes_at = k
    below = [k for k in ordered if chokes_at is None or k < chokes_at]
    saturation = below[-1] if below else None
    choke = points[chokes_at] if chokes_at is not None else None
    reason = None
    if choke is not None:
        reason = "achieved" if choke["achieved"] < KEPT_UP * choke["scheduled_rate"] else "p99"
    return {
        "saturation": None if saturation is None else rate_at(saturation),
        "chokes_at": None if choke is None else choke["offered"],
        "reason": reason,
        "low_load_p99_us": low_p99,
        # a choke the senders did not keep up at is theirs: the saturation is a lower bound
        "generator_limited": bool(choke is not None and not choke["generator_kept_up"]),
        "highest_offered": rate_at(ordered[-1]),
        "isolated_chokes": [points[k]["offered"] for k in below if chokes[k]],
    }


def measure_latency(
    args: argparse.Namespace,
    directory: str,
    result: dict[str, Any],
    failures: dict[str, str],
) -> None:
    """Every variant's sweep at every prompt, direct measured at each rate they reach."""
    points: list[dict[str, Any]] = result.setdefault("points", [])
    summary: dict[str, dict[str, Any]] = result.setdefault("summary", {})
    baselines = _Baselines(args, directory, points)
    try:
        for prompt in args.lengths:
            for variant in args.latency_variants:
                try:
                    found = _sweep_variant(variant, prompt, baselines, args, directory, points)
                except Failure as exc:  # its own failure, or direct's
                    failures[f"latency {variant} at {prompt.key} tokens"] = str(exc)
                    continue
                summary[f"{variant}/{prompt.key}"] = summarize(found)
    finally:
        baselines.close()


class _Baselines:
    """Direct's points, in the frames of the variant's load (mono's are single frames
    whatever the dialect: its baseline is ``direct-sf`` then), each measured the first
    time a variant reaches its rate at its prompt; one that chokes is measured again,
    as a variant's point is, its noise being subtracted from every variant's."""

    def __init__(self, args: argparse.Namespace, directory: str, points: list[Any]):
        self.args, self.directory, self.points = args, directory, points
        self.sessions: dict[bool, OpenLoop] = {}
        self.measured: dict[tuple[bool, str], dict[int, dict[str, Any]]] = {}

    def __call__(self, single_frame: bool, prompt: Prompt, k: int) -> dict[str, Any]:
        session = self.sessions.get(single_frame)
        if session is None:
            own = single_frame == (self.args.dialect == "megatron-core")
            session = OpenLoop(DIRECT[not own], self.args, self.directory, single_frame)
            self.sessions[single_frame] = session
        measured = self.measured.get((single_frame, prompt.key))
        if measured is None:
            _warm(session, prompt, self.args)
            measured = self.measured[(single_frame, prompt.key)] = {}
        if k not in measured:

            def measure(k: int) -> dict[str, Any]:
                point = _measure(session, prompt, k, self.args)
                _progress(point)
                return point

            measure_into(measured, k, measure)
            self.points.append(measured[k])
        return measured[k]

    def low_load(self, session: OpenLoop, prompt: Prompt) -> float:
        """Direct's low-load p99 at ``prompt``, in the frames of ``session``'s load."""
        return low_load_p99(self.measured[(session.single_frame, prompt.key)])

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()


def _sweep_variant(
    variant: str,
    prompt: Prompt,
    baselines: _Baselines,
    args: argparse.Namespace,
    directory: str,
    points: list[dict[str, Any]],
) -> dict[int, dict[str, Any]]:
    session = OpenLoop(variant, args, directory)
    try:
        _warm(session, prompt, args)

        def measure(k: int) -> dict[str, Any]:
            point = _measure(session, prompt, k, args)
            direct = baselines(session.single_frame, prompt, k)
            for key in ("p50_us", "p99_us", "p999_us"):
                point[f"added_{key}"] = point[key] - direct[key]
            # a baseline that choked itself (its one engine process saturated, or its
            # senders fell behind) says little of what the variant adds
            point["direct_kept_up"] = direct["generator_kept_up"]
            point["direct_choked"] = choked(direct, baselines.low_load(session, prompt))
            _progress(point)
            return point

        found = sweep(measure, args)
    finally:
        session.close()
    points.extend(found[k] for k in sorted(found))
    return found


def _measure(session: OpenLoop, prompt: Prompt, k: int, args: argparse.Namespace) -> dict[str, Any]:
    rate = rate_at(k)
    point = session.point(prompt, rate, seconds_at(rate, args))
    point.update(variant=session.variant, **prompt.describe(session.single_frame, session.fields))
    return point


def _warm(session: OpenLoop, prompt: Prompt, args: argparse.Namespace) -> None:
    """Connections, caches and the allocator warmed up at a low rate; not recorded."""
    session.point(prompt, args.min_rate, max(0.2, args.latency_seconds / 4))


def seconds_at(rate: float, args: argparse.Namespace) -> float:
    """How long a point's arrivals last."""
    return min(4 * args.latency_seconds, max(args.latency_seconds, MIN_REQUESTS / rate))


def _progress(point: dict[str, Any]) -> None:
    added = f" (+{point['added_p99_us']:.0f})" if "added_p99_us" in point else ""
    cost = ""
    if "coordinator_cpu_us" in point:
        cost = f", coordinator CPU {point['coordinator_cpu_us']:.1f} µs/request"
    kept = "" if point["generator_kept_up"] else ", the senders fell behind"
    print(
        f"latency {point['prompt']:>6} tokens {point['variant']:>6} "
        f"{point['offered']:8.0f}/s offered: {point['send_rate']:8.0f} sent "
        f"{point['achieved']:8.0f} answered/s, p50 {point['p50_us']:8.0f} "
        f"p99 {point['p99_us']:8.0f}{added} µs{cost}, sends late p99 "
        f"{point['lag_p99_us']:.0f} µs{kept}",
        file=sys.stderr,
    )
