"""``coordkit demo`` end to end, as a subprocess: its table, and its cleanup on Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.support.processes import coordkit_command, python_env

TIMEOUT = 120.0


def demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        coordkit_command("demo", *args),
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


def table(stdout: str) -> dict[str, str]:
    """The results table as {row name: value}."""
    assert "coordkit demo results" in stdout
    return {
        match[1]: match[2] for match in re.finditer(r"^  (\S+(?: \S+)*?)\s{2,}(.+)$", stdout, re.M)
    }


def test_demo(impl):
    result = demo("--requests", "200", "--implementation", impl.name)
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert rows["implementation"] == impl.name
    assert rows["policy"] == "least_loaded"
    assert rows["requests"] == "200 of 200"
    assert rows["errors"] == "none"
    assert float(rows["requests/s"]) > 0
    assert rows["latency p50"].endswith(" ms") and rows["latency p99"].endswith(" ms")
    assert int(rows["rank 0"]) + int(rows["rank 1"]) == 200
    assert "prefix cache hit rate" not in rows  # only with shared prefixes or a comparison


def test_demo_streaming_with_prefix_routing(impl):
    args = ["--stream", "--policy", "prefix", "--engines", "3", "--requests", "150"]
    result = demo(*args, "--prompt-tokens", "40", "--implementation", impl.name)
    assert result.returncode == 0, result.stderr
    rows = table(result.stdout)
    assert (rows["policy"], rows["streaming"], rows["requests"]) == ("prefix", "yes", "150 of 150")
    assert sum(int(rows.get(f"rank {rank}", 0)) for rank in range(3)) == 150


def hit_rate(value: str) -> float:
    assert value.endswith("% of prompt blocks"), value
    return float(value.partition("%")[0])


def test_demo_compares_prefix_cache_hit_rates(impl):
    args = ["--shared-prefixes", "4", "--engines", "4", "--compare-policies", "--requests", "400"]
    result = demo(*args, "--implementation", impl.name)
    assert result.returncode == 0, result.stderr
    # One column per run: least_loaded, then prefix.
    rows = {name: re.split(r"\s{2,}", value) for name, value in table(result.stdout).items()}
    assert rows["policy"] == ["least_loaded", "prefix"]
    assert rows["requests"] == ["400 of 400"] * 2 and rows["errors"] == ["none"] * 2
    assert rows["prompt tokens"] == ["544"] * 2  # 512 shared and 32 unique
    assert all(float(value) > 0 for value in rows["requests/s"])
    least_loaded, prefix = map(hit_rate, rows["prefix cache hit rate"])
    # Every engine's cache holds all four prefixes, so only a prefix's first request on an
    # engine misses its 32 blocks (the 2 suffix blocks always miss). least_loaded spreads
    # each over all 4: ~16 such misses. Prefix routing keeps a prefix on one engine (4
    # misses) until that engine's queued work outweighs the prefill the prefix saves, so
    # with 64 requests in flight it may spread a few, but never more than least_loaded.
    assert 0 < least_loaded <= prefix <= round(100 * 32 * (400 - 4) / (34 * 400), 1)


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
        except (OSError, ValueError):
            continue  # not a process, or gone meanwhile
        if entry.name.isdigit() and int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def test_demo_cleans_up_on_ctrl_c(impl):
    process = subprocess.Popen(
        coordkit_command("demo", "--requests", "1000000", "--latency", "0.01")
        + ["--implementation", impl.name],
        env=python_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As at a terminal: a runner started in the background may pass SIGINT on ignored.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    started = threading.Event()

    def read_stderr() -> None:
        # The progress bar appears once the engines have registered and the load runs.
        seen = ""
        while chunk := process.stderr.read(64):
            seen = (seen + chunk)[-128:]
            if "coordkit demo" in seen:
                started.set()
        started.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        assert started.wait(TIMEOUT)
        engines = children(process.pid)
        assert len(engines) == 2
        address = Path(f"/proc/{engines[0]}/cmdline").read_bytes().split(b"\0")
        socket_dir = Path(address[address.index(b"--address") + 1].decode()[6:]).parent
        process.send_signal(signal.SIGINT)
        process.wait(TIMEOUT)
        stdout = process.stdout.read()
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 0
    assert "(interrupted)" in table(stdout)["requests"]
    assert not any(Path(f"/proc/{pid}").exists() for pid in engines)
    assert not socket_dir.exists()


# -- the examples ------------------------------------------------------------------------------

EXAMPLES = Path(__file__).parent.parent / "examples"


def example(name: str, *args: str, **options) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLES / name), *args], env=python_env(), text=True, **options
    )


def test_example_cluster():
    process = example("cluster.py", stdout=subprocess.PIPE)
    stdout, _ = process.communicate(timeout=TIMEOUT)
    assert process.returncode == 0
    assert len(re.findall(r"^rank [01]: \[", stdout, re.M)) == 8


def test_examples_over_tcp():
    coordinator = example("tcp_coordinator.py", "0", stdout=subprocess.PIPE)
    engine = None
    try:
        listening = coordinator.stdout.readline()
        port = re.search(r"listening on tcp://0\.0\.0\.0:(\d+)", listening)[1]
        assert "coordkit fake-engine --address tcp://" in coordinator.stdout.readline() + (
            coordinator.stdout.readline()
        )
        address = f"tcp://127.0.0.1:{port}"
        engine = example("minimal_engine.py", address, "0")
        client = example("minimal_client.py", address, stdout=subprocess.PIPE)
        stdout, _ = client.communicate(timeout=TIMEOUT)
        assert client.returncode == 0
        assert "'echo': [2003, 2009, 101]" in stdout
        assert stdout.count("stream:") == 1  # the echo engine sends no partials
        coordinator.send_signal(signal.SIGINT)
        assert coordinator.wait(TIMEOUT) == 0
    finally:
        for process in (coordinator, engine):
            if process is not None:
                process.kill()
                process.wait()


def test_demo_prints_a_traced_requests_tree(impl):
    """--trace-sample: the client's and the engines' spans reach the demo's own receiver,
    and the slowest request's tree shows the engine's span under the client's."""
    args = ["--requests", "40", "--trace-sample", "1", "--implementation", impl.name]
    result = demo(*args)
    assert result.returncode == 0, result.stderr
    assert table(result.stdout)["requests"] == "40 of 40"
    _, _, traced = result.stdout.partition("traced 40 requests; the slowest, trace ")
    lines = traced.splitlines()[1:]
    assert lines[0].startswith("  coordkit.submit [coordkit-demo] ")
    assert any(line.startswith("    fake-engine.request [coordkit-fake-engine] ") for line in lines)
