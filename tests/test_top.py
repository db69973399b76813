"""``coordkit top`` as a person runs it: in a terminal (tmux), on a coordinator under load.

The view is read back with ``capture-pane`` until it shows the engines with their
requests/s and errors, a rate, the latency percentiles (from the STATS_REPLY, or from
``--metrics``) and the clients; then ``q`` is typed and the process must exit 0.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.load import client_load
from tests.support.processes import coordkit_command, engine_processes, python_env

SIZE = ("100", "30")  # columns, lines: the view must fit a small terminal
SHOWN_WITHIN = 30.0  # seconds for the view to show what the test waits for
EXIT_WITHIN = 5.0  # seconds from q to the process's exit


class Terminal:
    """A detached tmux session of its own server (socket in ``directory``) running one
    command, whose exit status the shell around it writes to a file (tmux's own
    ``pane_dead_status`` is not always filled in)."""

    def __init__(self, directory: Path):
        self.socket = directory / "tmux.sock"
        self.status = directory / "exit-status"

    def tmux(self, *args: str) -> str:
        command = ["tmux", "-S", str(self.socket), "-f", "/dev/null", *args]
        return subprocess.run(
            command, env=python_env(), capture_output=True, text=True, check=True, timeout=10
        ).stdout

    def start(self, command: list[str]) -> None:
        shell = f"{shlex.join(command)}; echo $? > {shlex.quote(str(self.status))}"
        self.tmux("new-session", "-d", "-s", "top", "-x", SIZE[0], "-y", SIZE[1], shell)

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top")

    def exit_status(self) -> int | None:
        """The command's exit status once it ended, else None."""
        text = self.status.read_text() if self.status.exists() else ""
        return int(text) if text.endswith("\n") else None

    def wait_for_screen(self, *patterns: str) -> str:
        deadline = time.monotonic() + SHOWN_WITHIN
        while True:
            screen = self.screen()
            if all(re.search(pattern, screen) for pattern in patterns):
                return screen
            assert self.exit_status() is None, f"it ended:\n{screen}"
            assert time.monotonic() < deadline, f"not shown: {patterns}\n{screen}"
            time.sleep(0.25)

    def wait_for_exit(self) -> int:
        deadline = time.monotonic() + EXIT_WITHIN
        while (status := self.exit_status()) is None:
            assert time.monotonic() < deadline, f"still running:\n{self.screen()}"
            time.sleep(0.1)
        return status


@pytest.fixture
def terminal(tmp_path) -> Iterator[Terminal]:
    if shutil.which("tmux") is None:
        pytest.skip("no tmux binary (apt-get install tmux): coordkit top not run in a terminal")
    terminal = Terminal(tmp_path)
    try:
        yield terminal
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            terminal.tmux("kill-server")


@pytest.mark.parametrize("read", ["stats", "metrics-url"])
def test_top_shows_engines_rates_and_latency_then_quits_on_q(make_cluster, terminal, impl, read):
    """The histograms come with the stats (STATS with {"metrics": 1}), or from --metrics."""
    pytest.importorskip("textual", reason="no textual (pip install 'coordkit[top]')")
    with make_cluster(transport="tcp", metrics_port=0) as c:
        metrics = f"http://127.0.0.1:{c.coord.metrics_port}/metrics"
        with engine_processes(c.coord.address, 2, "--quiet", "--latency", "0.005"):
            with client_load(c.coord.address, engines=2) as load:
                command = coordkit_command("top", c.coord.address, "--interval", "0.5")
                if read == "metrics-url":
                    command += ["--metrics", metrics]
                terminal.start(command)
                screen = terminal.wait_for_screen(
                    rf"implementation {impl.name}",
                    r"engine-0\s+alive\s+\d+\s+\d+%\s+[1-9][\d,]*\.\d/s\s+0\b",  # req/s, errors
                    r"engine-1\s+alive",
                    r"requests\s+[1-9][\d,]*\.\d/s",  # a rate, and not 0
                    r"request p50 / p99\s+[\d,.]+ ms / [\d,.]+ ms",
                    r"\n\s*c[0-9a-f]{14}\s+\d+\s+[1-9]\d*\s",  # a client, what it submitted
                )
                terminal.tmux("send-keys", "-t", "top", "q")
                assert terminal.wait_for_exit() == 0, terminal.screen()
            assert not load.failures, load.failures
    assert re.search(r"queued\s+\d+", screen)  # the queue's depth


def test_top_without_the_extra_says_what_to_install(make_cluster, tmp_path, impl):
    # A textual that does not import, first on the path: as if it were not installed.
    (tmp_path / "textual").mkdir()
    (tmp_path / "textual" / "__init__.py").write_text("raise ImportError(name='textual')\n")
    with make_cluster(transport="tcp") as c:
        env = python_env()
        env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
        result = subprocess.run(
            coordkit_command("top", c.coord.address),
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert result.stderr == (
        "coordkit top: needs textual and prometheus_client: pip install 'coordkit[top]' "
        "(textual is missing)\n"
    )


def test_top_refused_is_one_line(make_cluster, tmp_path, impl):
    pytest.importorskip("textual", reason="no textual (pip install 'coordkit[top]')")
    with make_cluster(transport="tcp") as c:
        with socket.socket() as closed:  # a port nothing listens on
            closed.bind(("127.0.0.1", 0))
            metrics = f"http://127.0.0.1:{closed.getsockname()[1]}/metrics"
            refusals = {
                "no coordinator answered": [f"ipc://{tmp_path}/none.sock", "--timeout", "1"],
                f"cannot read metrics at {metrics}": [c.coord.address, "--metrics", metrics],
            }
            for what, args in refusals.items():
                result = subprocess.run(
                    coordkit_command("top", *args),
                    env=python_env(),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert result.returncode == 2, result
                assert result.stderr.startswith(f"coordkit top: {what}"), result
                assert result.stderr.count("\n") == 1, result
