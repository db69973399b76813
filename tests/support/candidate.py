"""A candidate of an etcd election in a process of its own, reporting on stdout.

Run as ``python -m tests.support.candidate ENDPOINT --ttl SECONDS --value VALUE``.
Each line is an event, a word, the epoch and a ``time.monotonic()`` (one clock
for every process of a Linux host, so lines of two candidates compare):

* ``waiting - T``: campaigning;
* ``leading EPOCH T``: elected; T is when its lease began (the lease grant
  was sent), no earlier than the previous leader's lease ended;
* ``serving EPOCH T``: at T its term was valid (``term.valid(T)``), checked
  as a coordinator would before acting, every 20 ms;
* ``lost EPOCH T REASON``: the term is over; then it exits;
* ``error - T MESSAGE``: campaign raised (it exits 1).

A line ``resign`` on stdin makes it resign. :class:`CandidateProcess` is the
test's side: it starts one and collects its lines.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from typing import NamedTuple

from coordkit.election import Election, Term
from tests.support.processes import ROOT, python_env

SERVE_INTERVAL = 0.02


def emit(word: str, epoch: int | str, at: float, rest: str = "") -> None:
    print(f"{word} {epoch} {at:.6f} {rest}".rstrip(), flush=True)


def serve(term: Term) -> None:
    resign = threading.Event()

    def read_commands() -> None:
        for line in sys.stdin:
            if line.strip() == "resign":
                resign.set()

    threading.Thread(target=read_commands, daemon=True).start()
    while True:
        now = time.monotonic()
        if not term.valid(now):
            emit("lost", term.epoch, now, term.reason or "past the deadline")
            return
        emit("serving", term.epoch, now)
        if resign.wait(SERVE_INTERVAL):
            term.resign()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("--ttl", type=float, default=1.0)
    parser.add_argument("--value", default="")
    parser.add_argument("--timeout", type=float)
    args = parser.parse_args()
    election = Election(args.endpoint, ttl=args.ttl, value=args.value)
    emit("waiting", "-", time.monotonic())
    try:
        term = election.campaign(args.timeout)
    except (ConnectionError, TimeoutError, RuntimeError) as exc:
        emit("error", "-", time.monotonic(), str(exc))
        return 1
    emit("leading", term.epoch, term.deadline - election.ttl)
    serve(term)
    return 0


class Line(NamedTuple):
    word: str
    epoch: int | None
    at: float
    rest: str


class CandidateProcess:
    """A candidate process for ``endpoint`` and the lines it printed so far."""

    def __init__(self, endpoint: str, ttl: float, value: str = ""):
        command = [sys.executable, "-m", "tests.support.candidate", endpoint]
        command += ["--ttl", str(ttl), "--value", value]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            env=python_env(), cwd=ROOT,
        )  # fmt: skip
        self.lines: list[Line] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for text in self.process.stdout:
            word, epoch, at, *rest = text.rstrip("\n").split(" ", 3)
            line = Line(word, None if epoch == "-" else int(epoch), float(at), " ".join(rest))
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append(Line("exited", None, time.monotonic(), ""))
            self._changed.notify_all()

    def first(self, word: str) -> Line | None:
        with self._changed:
            return next((line for line in self.lines if line.word == word), None)

    def wait_for(self, word: str, timeout: float) -> Line:
        """The first line of ``word``, waited for up to ``timeout`` seconds."""
        with self._changed:
            self._changed.wait_for(lambda: self.first(word) is not None, timeout)
        line = self.first(word)
        assert line is not None, f"no {word!r} within {timeout} s: {self.lines[-5:]}"
        return line

    def send(self, command: str) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()

    def signal(self, number: int) -> float:
        """Send a signal; the monotonic time it was sent at."""
        sent = time.monotonic()
        os.kill(self.process.pid, number)
        return sent

    def close(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)  # a stopped process dies of SIGKILL all the same
            self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    sys.exit(main())
