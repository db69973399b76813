"""One variant's processes, started and driven from the bench's own process.

A :class:`Session` spawns the variant's coordinator child
(:mod:`.servers`), then its engine and client load generators (:mod:`.load`),
each with a pipe for commands and answers; a child that fails, dies or falls
silent becomes a :class:`Failure` naming it.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from . import kvevents
from .load import client_child, engine_child, fake_engines_child
from .pd6675 import megatron_pd_engines_child
from .servers import coordinator_child
from .workload import (
    DIRECT,
    IMPLEMENTATIONS,
    KV_EVENTS,
    MEMORY_PROMPT_TOKENS,
    QUEUED_CAPACITY,
    RANKS,
    SUBMIT_FIELDS,
    TIMEOUT,
    TRACE_SAMPLES,
    Prompt,
    reply_body,
    requests_at,
    warmup_at,
)

_STOP_TIMEOUT = 10.0  # seconds the coordinator gets to exit before it is terminated
_GRACE = 2.0  # the same for a load generator, and for any process after SIGTERM
_SPAWN = multiprocessing.get_context("spawn")  # children hold no state of ours
_SPARE_FDS = 64  # descriptors a process needs besides its connections
_SESSIONS = itertools.count()
_SYSCALLS = "raw_syscalls:sys_enter"  # perf's tracepoint: every system call's entry
_PERF_ATTACH = 0.3  # seconds perf stat takes to attach to a process's threads, at most


class Failure(Exception):
    """A benchmark process failed; the message says which one and why."""


@dataclass
class _Proc:
    name: str  # "coordinator", "engine" or "client"
    process: BaseProcess
    conn: Connection  # commands to it, answers from it


class Processes:
    """Child processes of one bench session, each with a pipe: started, asked, stopped.

    ``variant`` names them (``coordkit-bench-<variant>-<name>``); a child that
    fails, dies or falls silent becomes a :class:`Failure` naming it.
    """

    def __init__(self, variant: str):
        self.variant = variant
        self.procs: list[_Proc] = []

    def close(self) -> None:
        """Stop the processes, the coordinator first (its peers' exits then go unlogged).

        A client stopped in the middle of a load (a failure, Ctrl-C) does not
        read its commands: it is terminated after a short grace.
        """
        for proc in self.procs:
            try:
                proc.conn.send(("stop",))
            except OSError:
                pass  # it is gone already
            # The coordinator may have many requests in flight to fail first.
            proc.process.join(_STOP_TIMEOUT if proc is self.procs[0] else _GRACE)
            if proc.process.exitcode is None:
                proc.process.terminate()
                proc.process.join(_GRACE)
            if proc.process.exitcode is None:
                proc.process.kill()
                proc.process.join()
            proc.conn.close()
        self.procs = []

    def _start(self, name: str, target: Callable[..., None], *args: Any) -> _Proc:
        ours, theirs = _SPAWN.Pipe()
        process = _SPAWN.Process(
            target=_child,
            args=(theirs, target, *args),
            name=f"coordkit-bench-{self.variant}-{name}",
            daemon=True,
        )
        process.start()
        theirs.close()  # so that its death reads as EOF here
        proc = _Proc(name, process, ours)
        self.procs.append(proc)
        return proc

    def _call(self, proc: _Proc, command: tuple[Any, ...]) -> Any:
        proc.conn.send(command)
        return self._receive(proc)

    def _receive(self, proc: _Proc, timeout: float | None = TIMEOUT) -> Any:
        """``proc``'s next message; a failure if it reports one, or any process dies."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not proc.conn.poll(0.1):
            self._check_alive()
            if deadline is not None and time.monotonic() > deadline:
                raise Failure(f"the {proc.name} did not answer within {timeout:.0f} s")
        try:
            message = proc.conn.recv()
        except EOFError:
            proc.process.join(_STOP_TIMEOUT)
            raise Failure(f"the {proc.name} exited (code {proc.process.exitcode})") from None
        if message[0] == "error":
            raise Failure(f"{proc.name}: {message[1]}")
        return message

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.process.exitcode is None:
                continue
            reason = f"exited with code {proc.process.exitcode}"
            if proc.conn.poll():  # its last word, when it had the time to say it
                try:
                    message = proc.conn.recv()
                except EOFError:
                    message = ()
                if message[:1] == ("error",):
                    reason = message[1]
            raise Failure(f"the {proc.name} {reason}")

    def _wait(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + TIMEOUT
        while not condition():
            self._check_alive()
            if time.monotonic() > deadline:
                raise Failure(f"timed out waiting for {what}")
            time.sleep(0.01)


class Session(Processes):
    """One variant's coordinator, engine and client processes, and how to drive them.

    ``hold_after`` makes it a memory session: the engine answers that many
    requests (the warm-up), then holds every later one without replying.
    ``ranks`` engine ranks share the engine process, ``clients`` clients the
    client process (none: the caller starts its own); ``at_once`` has the
    engine answer what it reads at once instead of in full batches. The
    variants ``direct`` and ``direct-sf`` have no coordinator: the clients
    connect to the engine. The load speaks the dialect's frames, mono's single
    frames always, or as ``single_frame`` says. ``roles`` serves it with FakeEngine
    ranks of those roles instead (None: aggregated), one rank each (``--pd``).
    """

    def __init__(
        self,
        variant: str,
        args: argparse.Namespace,
        directory: str,
        coordinator_options: dict[str, Any] | None = None,
        hold_after: int | None = None,
        *,
        ranks: int = RANKS,
        clients: int = 1,
        at_once: bool = False,
        single_frame: bool | None = None,
        roles: tuple[str | None, ...] | None = None,
    ):
        super().__init__(variant)
        self.held = _SPAWN.Value("q", 0, lock=False)  # requests the engine holds
        # mono is Megatron-Core 0.19's design: its load speaks that format in any dialect.
        if single_frame is None:
            single_frame = variant == "mono" or args.dialect == "megatron-core"
        self.single_frame = single_frame
        self.fields = SUBMIT_FIELDS[args.megatron_version]  # of its single-frame SUBMITs
        self.prefix = args.policy == "prefix" and variant in IMPLEMENTATIONS
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if ranks + clients + _SPARE_FDS > hard:
            raise Failure(
                f"{ranks} engine and {clients} client connections need as many file "
                f"descriptors; RLIMIT_NOFILE allows {hard}"
            )
        self.roles = roles
        if roles is not None:
            ranks = len(roles)
        self.workload = getattr(args, "workload", "standard")
        self.body = ""  # MEGATRON_BODIES's the engine answers with ("": the workload's)
        try:
            self.address = self._servers(
                args, directory, coordinator_options, hold_after, ranks, at_once
            )
            if clients:
                self.client = self._start(
                    "client",
                    client_child,
                    variant,
                    self.single_frame,
                    self.address,
                    self.prefix,
                    self.held,
                    clients,
                    self.fields,
                )
                self._receive(self.client)
        except BaseException:
            self.close()
            raise

    def _servers(
        self,
        args: argparse.Namespace,
        directory: str,
        coordinator_options: dict[str, Any] | None,
        hold_after: int | None,
        ranks: int,
        at_once: bool,
    ) -> str:
        """Start the coordinator and the engine; the address the clients connect to."""
        if args.transport == "tcp":
            endpoints = ["tcp://127.0.0.1:*"] * 2  # the ports are read back once bound
        else:  # sessions of one variant may be alive together (--scale: one per policy)
            name = f"{directory}/{self.variant}-{next(_SESSIONS)}"
            endpoints = [f"ipc://{name}-{side}" for side in ("front", "back")]

        def engine(address: str) -> str:
            if self.roles is not None:
                # a #6675 fleet: the PR's engines' frames; else coordkit's FakeEngines
                child = megatron_pd_engines_child if args.megatron_version == "pr6675" else None
                self.engine = self._start(
                    "engine", child or fake_engines_child, address, self.roles
                )
                return str(self._receive(self.engine)[1])
            self.engine = self._start(
                "engine",
                engine_child,
                self.variant,
                self.single_frame,
                address,
                ranks,
                at_once,
                hold_after,
                self.held,
                self.workload,
                self.variant in KV_EVENTS,
            )
            return str(self._receive(self.engine)[1])

        if self.variant in DIRECT:
            return engine(endpoints[0])
        options = dict(coordinator_options or {})
        if args.dialect == "megatron-core" and self.variant in IMPLEMENTATIONS:
            options["dialect"] = args.dialect
            options["megatron_version"] = args.megatron_version
        if self.variant == "c-metrics":  # served on a free port, the latency histograms kept
            options["metrics_port"] = 0
        if self.variant == "c-queued":  # most of the window waits at the coordinator
            options["max_inflight_per_engine"] = QUEUED_CAPACITY
        if self.variant in TRACE_SAMPLES:  # exported to the bench's receiver (main())
            options["trace_sample"] = TRACE_SAMPLES[self.variant]
        elif self.variant in IMPLEMENTATIONS:  # untraced, whatever OTEL_* the run set
            options["trace_sample"] = 0
        where: list[tuple[str, str]] = []
        if self.variant in KV_EVENTS:  # each rank's publisher, as `serve --kv-events` names it
            where = kvevents.endpoints(directory, f"{self.variant}-{next(_SESSIONS)}", ranks)
            options["kv_events"] = {rank: ",".join(pair) for rank, pair in enumerate(where)}
        self.coordinator = self._start(
            "coordinator", coordinator_child, self.variant, endpoints, args.policy, options
        )
        _, client_address, engine_address = self._receive(self.coordinator)
        engine(engine_address)
        # c and py would drop a plain client's requests while no engine is registered.
        self._wait(
            lambda: self._call(self.coordinator, ("engines",))[1] >= ranks,
            f"the {ranks} engine ranks to register",
        )
        if self.variant in KV_EVENTS:
            # The ranks are given in the order the registrations came: each route of the
            # engine process (its identities engine_child's) publishes where the
            # coordinator reads its rank's events.
            identities = self._call(self.coordinator, ("identities",))[1]
            ranked = [where[identities.index(f"mp-coord-{i}")] for i in range(ranks)]
            self._call(self.engine, ("publish", ranked))
        return str(client_address)

    def run(self, prompt: Prompt, n: int, warmup: int, window: int) -> dict[str, Any]:
        """Warm up, then ``n`` requests with the coordinator's CPU sampled around them."""
        if prompt.body != self.body and self.roles is None:
            self._call(self.engine, ("body", reply_body(self.workload, prompt.body)))
            self.body = prompt.body
        self.client.conn.send(("load", prompt, n, warmup, window))
        self._receive(self.client, timeout=None)  # warm: the client progresses or says why not
        _, messages0, entries0 = self._call(self.engine, ("stats",))
        kv0 = self._kv_events()
        with SyscallCounter(self.coordinator.process.pid) as syscalls:
            before = self._call(self.coordinator, ("sample",))[1]
            self.client.conn.send(("go",))
            wall = self._receive(self.client, timeout=None)[1]
            self._kv_events()  # the events of the load all applied: their CPU counted
            after = self._call(self.coordinator, ("sample",))[1]
        _, messages1, entries1 = self._call(self.engine, ("stats",))
        kv: dict[str, float] = {k: count - kv0[k] for k, count in self._kv_events().items()}
        if kv:  # the thread that reads and decodes them, apart
            kv["thread_us"] = (after["kv"] - before["kv"]) * 1e6
        switches = after["switches"] - before["switches"]
        user, sys_ = after["user"] - before["user"], after["sys"] - before["sys"]
        io = after["io"] - before["io"]
        return {
            "requests": n,
            "total_us": (user + sys_) / n * 1e6,
            "user_us": user / n * 1e6,
            "sys_us": sys_ / n * 1e6,
            "loop_us": (user + sys_ - io) / n * 1e6,  # every thread but libzmq's I/O threads
            "io_us": io / n * 1e6,
            "main_us": (after["main"] - before["main"]) / n * 1e6,  # the loop's thread alone
            "requests_per_s": n / wall,
            "wall_s": wall,
            "reply_batch": (entries1 - entries0) / max(messages1 - messages0, 1),
            "context_switches": switches,
            "involuntary_switches": after["involuntary"] - before["involuntary"],
            "switches_per_request": switches / n,
            # perf's count (None without a usable perf); from the attach to the detach
            "syscalls_per_request": None if syscalls.count is None else syscalls.count / n,
            "page_faults": after["page_faults"] - before["page_faults"],
            "rss_before": before["rss"],
            "rss_after": after["rss"],
            **{f"kv_{key}_per_request": count / n for key, count in kv.items()},
        }

    def _kv_events(self) -> dict[str, int]:
        """The coordinator's KV-event counts (none but c-kv-events'), once it has decoded
        every batch the engine published (it may lag behind the replies)."""
        if self.variant not in KV_EVENTS:
            return {}
        published = self._call(self.engine, ("kv_batches",))[1]
        counts: dict[str, int] = {}

        def caught_up() -> bool:
            counts.update(self._call(self.coordinator, ("kv_events",))[1])
            return counts["batches"] >= published

        self._wait(caught_up, f"the coordinator to read the {published} batches of KV events")
        return counts

    def fill(self, n: int, warmup: int, window: int) -> dict[str, Any]:
        """Hold ``n`` requests at the engine; the coordinator's RSS before and with them."""
        self.client.conn.send(("fill", Prompt(MEMORY_PROMPT_TOKENS), n, warmup, window))
        self._receive(self.client, timeout=None)
        before = self._call(self.coordinator, ("sample",))[1]
        self.client.conn.send(("go",))
        wall = self._receive(self.client, timeout=None)[1]
        self._wait(lambda: self.held.value >= n, f"the engine to hold {n} requests")
        held = self._call(self.coordinator, ("sample",))[1]
        cpu = held["user"] + held["sys"] - before["user"] - before["sys"]
        return {
            "variant": self.variant,
            "inflight": n,
            "prompt_tokens": MEMORY_PROMPT_TOKENS,
            "rss_before": before["rss"],
            "rss_with": held["rss"],
            "bytes_per_request": (held["rss"] - before["rss"]) / n,
            "submit_cpu_us": cpu / n * 1e6,
            "fill_s": wall,
        }


def run_interleaved(
    args: argparse.Namespace,
    starts: Mapping[str, Callable[[], Session]],
    runs: list[dict[str, Any]],
    failures: dict[str, str],
    key: str,
    prefix: str = "",
) -> None:
    """Start each named session, then run every prompt of ``args.lengths`` on each in
    turn within each repetition, so drift hits them all alike. A run records its name
    under ``key``; a session that fails is dropped, its failure recorded under
    ``prefix`` + its name, and the others go on."""
    sessions: dict[str, Session] = {}
    try:
        for name, start in starts.items():
            try:
                sessions[name] = start()
            except Failure as exc:
                failures[prefix + name] = str(exc)
        for repetition in range(args.repeat):
            for prompt in args.lengths:
                n = requests_at(args, prompt.tokens)
                warmup = warmup_at(args, n)
                for name in list(sessions):
                    session = sessions[name]
                    try:
                        run = session.run(prompt, n, warmup, args.window)
                    except Failure as exc:
                        failures[prefix + name] = f"at {prompt.key} tokens: {exc}"
                        sessions.pop(name).close()
                        continue
                    run.update({key: name, "repetition": repetition})
                    run.update(prompt.describe(session.single_frame, session.fields))
                    runs.append(run)
                    print(
                        f"[{repetition + 1}/{args.repeat}] {prefix}{prompt.key:>10} tokens "
                        f"{name:>5}: {run['total_us']:8.2f} µs/request, "
                        f"{run['requests_per_s']:8.0f} req/s",
                        file=sys.stderr,
                    )
    finally:
        for session in sessions.values():
            session.close()


class SyscallCounter:
    """The system calls of process ``pid`` (every thread) while the block runs, counted
    by ``perf stat`` on its ``raw_syscalls:sys_enter`` tracepoint; ``count`` stays None
    where perf is missing or not allowed to (kernel.perf_event_paranoid, no root)."""

    _usable: bool | None = None  # perf works here: tried once per process

    def __init__(self, pid: int | None):
        self.pid = pid
        self.count: int | None = None
        self._perf: subprocess.Popen[str] | None = None

    @classmethod
    def usable(cls) -> bool:
        if cls._usable is None:
            try:
                probe = subprocess.run(
                    ["perf", "stat", "-x,", "-e", _SYSCALLS, "true"],
                    capture_output=True,
                    text=True,
                    timeout=30,
                )
                cls._usable = probe.returncode == 0 and _SYSCALLS in probe.stderr
            except (OSError, subprocess.SubprocessError):
                cls._usable = False
        return cls._usable

    def __enter__(self) -> SyscallCounter:
        if self.pid is not None and self.usable():
            self._perf = subprocess.Popen(
                ["perf", "stat", "-x,", "-e", _SYSCALLS, "-p", str(self.pid)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(_PERF_ATTACH)  # no sign when it is attached: a bound on how long it takes
        return self

    def __exit__(self, *exc: object) -> None:
        if self._perf is None:
            return
        self._perf.send_signal(signal.SIGINT)
        try:
            _, errors = self._perf.communicate(timeout=_GRACE * 5)
        except subprocess.TimeoutExpired:
            self._perf.kill()
            self._perf.communicate()
            return
        for line in errors.splitlines():
            fields = line.split(",")
            if len(fields) > 2 and fields[2] == _SYSCALLS and fields[0].isdigit():
                self.count = int(fields[0])


def _child(conn: Connection, target: Callable[..., None], *args: Any) -> None:
    """A child's entry point: failures are reported to the bench, not just printed."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the bench's to handle
    try:
        target(conn, *args)
    except EOFError:
        pass  # the bench is gone: so are we
    except BaseException as exc:
        traceback.print_exc()
        try:
            conn.send(("error", "".join(traceback.format_exception_only(exc)).strip()))
        except OSError:
            pass
        raise SystemExit(1) from None
