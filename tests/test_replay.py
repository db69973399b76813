"""``coordkit replay``: traces read, and replayed end to end through a coordinator and engines.

The replays are small (tens of requests, outputs capped, time compressed) and
run in this process: the coordinator on a thread, the fake engines as
processes. Nothing here asserts a time.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from coordkit._policies import POLICIES
from coordkit.tools.cli import main
from coordkit.tools.replay import TraceRequest, load_trace

TRACE = Path(__file__).parent.parent / "bench" / "traces" / "mooncake_synthetic_last1000.jsonl"


def write_trace(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def replay(capsys, *args: str) -> tuple[str, dict]:
    """Run ``coordkit replay`` in this process; its table and its JSON report."""
    report = Path(args[0]).with_suffix(".report.json")
    assert main(["replay", *args, "--json", str(report), "--no-progress"]) == 0
    return capsys.readouterr().out, json.loads(report.read_text())


def test_load_trace(tmp_path):
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 2000, "input_length": 5, "output_length": 1, "hash_ids": [3]},
            {"timestamp": 500, "input_length": 0, "output_length": 9, "hash_ids": []},
            {"timestamp": 2000, "input_length": 7, "output_length": 2, "hash_ids": [1, 2]},
        ],
    )
    assert load_trace(path) == [
        TraceRequest(0.5, 0, 9, ()),
        TraceRequest(2.0, 5, 1, (3,)),  # equal timestamps keep their order
        TraceRequest(2.0, 7, 2, (1, 2)),
    ]
    assert len(load_trace(path, limit=2)) == 2
    assert len(load_trace(TRACE)) == 1000


@pytest.mark.parametrize(
    "line",
    [
        "not json",
        '{"timestamp": 0, "input_length": 1, "output_length": 1}',
        '{"timestamp": 0, "input_length": -1, "output_length": 1, "hash_ids": []}',
        '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": [-1]}',
    ],
)
def test_load_trace_names_the_bad_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": []}\n')
    path.write_text(path.read_text() + line + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:2:"):
        load_trace(path)


def test_replay_compares_every_policy(impl, capsys, tmp_path):
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:30]))
    table, report = replay(
        capsys,
        str(trace),
        "--compare-policies",
        "--engines",
        "2",
        "--speedup",
        "50",
        "--max-output-tokens",
        "4",
        "--implementation",
        impl.name,
    )
    assert re.search(r"^  policy\s+" + r"\s+".join(POLICIES) + r"\s*$", table, re.M)
    assert re.search(r"^  completed\s+(30 of 30\s+){3}30 of 30\s*$", table, re.M)
    assert re.search(r"^  errors\s+(none\s+){3}none\s*$", table, re.M)
    assert report["requests"] == 30 and report["options"]["implementation"] == impl.name
    assert list(report["results"]) == list(POLICIES)
    for results in report["results"].values():
        assert results["completed"] == 30 and results["errors"] == {}
        assert len(results["ttft"]) == 30
        assert sum(results["requests_per_engine"]) == 30
        assert results["ttft_p50"] <= results["ttft_p99"] <= results["latency_p99"]
        assert 0 <= results["hit_rate"] <= 1
        assert all(busy > 0 for busy in results["busy_per_engine"])


def test_replay_keeps_a_shared_prefix_on_one_engine(impl, capsys, tmp_path):
    # 16 requests, one every 4 s of trace: an 8-block prefix and a block of their own.
    records = [
        {
            "timestamp": 4000 * i,
            "input_length": 9 * 16,
            "output_length": 3,
            "hash_ids": [*range(8), 100 + i],
        }
        for i in range(16)
    ]
    trace = write_trace(tmp_path / "shared.jsonl", records)
    options = ["--block-size", "16", "--engines", "2", "--speedup", "40"]
    options += ["--implementation", impl.name]
    _, prefix = replay(capsys, str(trace), "--policy", "prefix", *options)
    _, least = replay(capsys, str(trace), "--policy", "least_loaded", *options)
    prefix, least = prefix["results"]["prefix"], least["results"]["least_loaded"]
    assert sorted(prefix["requests_per_engine"]) == [0, 16]
    # One engine's cache: the first request misses its 9 blocks, each other 1 of 9.
    assert prefix["hit_rate"] == pytest.approx(15 * 8 / (16 * 9))
    assert min(least["requests_per_engine"]) > 0
    assert least["hit_rate"] < prefix["hit_rate"]


def test_replay_plots_the_ttft_cdf(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    records = [{"timestamp": 0, "input_length": 32, "output_length": 2, "hash_ids": [1, 2]}]
    trace = write_trace(tmp_path / "one.jsonl", records)
    plot = tmp_path / "ttft.png"
    replay(capsys, str(trace), "--block-size", "16", "--engines", "1", "--plot", str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_replay_without_matplotlib_says_so(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    trace = write_trace(tmp_path / "t.jsonl", [])
    with pytest.raises(SystemExit, match=r"--plot needs matplotlib .*coordkit\[bench\]"):
        main(["replay", str(trace), "--plot", str(tmp_path / "x.png")])


def test_replay_of_a_missing_or_empty_trace_fails(capsys, tmp_path):
    assert main(["replay", str(tmp_path / "missing.jsonl"), "--no-progress"]) == 1
    assert main(["replay", str(write_trace(tmp_path / "e.jsonl", [])), "--no-progress"]) == 1
    assert "the trace is empty" in capsys.readouterr().err


def test_replay_with_a_failover_keeps_the_affinity(impl, capsys, tmp_path):
    """--failover-at: the coordinator SIGKILLed and started again halfway. The engines'
    HELD reports give the new one the prefix table: the hit rate is the same as
    without the failover; with the reports off (--held-hashes 0) it drops."""
    # 4 prefixes of 8 blocks on 2 engines: the first half, 0 1 2 3 twice, puts 0 and 2
    # on one engine, 1 and 3 on the other. The second half comes 100 s of trace later
    # (the restart's time), as 0 2 1 3: a table started afresh splits 0 and 2 (and 1
    # and 3), and two of the four prefixes are prefilled again. Between them, the
    # request in flight at the SIGKILL has no prefix: it goes to whichever engine came
    # back first, and what it does to the cache does not depend on that.
    order = [0, 1, 2, 3] * 2 + [None] + [0, 2, 1, 3] * 2
    records = [
        {
            "timestamp": 4000 * i + (100_000 if i > 8 else 0),
            "input_length": (1 if p is None else 9) * 16,
            "output_length": 2,
            "hash_ids": [*([] if p is None else range(100 * p, 100 * p + 8)), 1000 + i],
        }
        for i, p in enumerate(order)
    ]
    trace = str(write_trace(tmp_path / "halves.jsonl", records))
    options = ["--block-size", "16", "--engines", "2", "--speedup", "40"]
    options += ["--implementation", impl.name, "--failover-at", str(9 / 17)]
    table, report = replay(capsys, trace, *options)
    assert re.search(r"^  policy\s+prefix\s+prefix \+ failover\s*$", table, re.M)
    killed = r"SIGKILLed before request 10, restarted; engines back in \d+\.\d s"
    assert re.search(r"^  coordinator\s+kept\s+" + killed, table, re.M)
    kept, failover = report["results"]["prefix"], report["results"]["prefix + failover"]
    assert report["options"]["failover_at"] == 9 / 17
    assert failover["failover_before_request"] == 9 and kept["failover_before_request"] is None
    assert 0 < failover["failover_engines_back_s"] < 60
    assert kept["completed"] == 17 and failover["completed"] >= 16  # one may find no engine
    # One engine per prefix: each prefix's first request misses its 8 blocks, and every
    # request its own block.
    assert kept["hit_rate"] == pytest.approx(12 * 8 / (16 * 9 + 1))
    assert failover["hit_rate"] >= kept["hit_rate"] - 0.05
    _, unreported = replay(capsys, trace, *options, "--held-hashes", "0")
    assert unreported["results"]["prefix + failover"]["hit_rate"] < failover["hit_rate"] - 0.05


def test_replay_on_clusters_of_coordinators(impl, capsys, tmp_path, etcd):
    """--coordinators 1,2 --kv-events: each N's members (on the replay's own etcd; the
    ``etcd`` fixture only says whether etcd runs here) share the engines and take turns
    at the requests. A prefix the requests share, each request from the other member
    than the one before: with the events, both members send every request to the engine
    that caches it, as one coordinator does."""
    records = [
        {
            "timestamp": 8000 * i,
            "input_length": 9 * 16,
            "output_length": 3,
            "hash_ids": [*range(8), 100 + i],
        }
        for i in range(12)
    ]
    trace = write_trace(tmp_path / "shared.jsonl", records)
    options = ["--block-size", "16", "--engines", "2", "--speedup", "40", "--kv-events"]
    options += ["--coordinators", "1,2", "--clients-per-coordinator", "2"]
    table, report = replay(capsys, str(trace), "--implementation", impl.name, *options)
    labels = ["prefix, 1 coord.", "prefix, 2 coord."]
    labels += ["prefix + KV events, 1 coord.", "prefix + KV events, 2 coord."]
    assert list(report["results"]) == labels
    assert report["options"]["coordinators"] == [1, 2]
    assert re.search(r"^  errors\s+(none\s+){3}none\s*$", table, re.M)
    assert re.search(r"^  requests per coordinator\s+12\s+6 6\s+12\s+6 6\s*$", table, re.M)
    for label, results in report["results"].items():
        assert results["completed"] == 12, label
        assert results["coordinators"] == int(label[-8])
    one = report["results"]["prefix + KV events, 1 coord."]
    two = report["results"]["prefix + KV events, 2 coord."]
    # One engine's cache: the first request misses its 9 blocks, each other 1 of 9.
    assert one["hit_rate"] == two["hit_rate"] == pytest.approx(11 * 8 / (12 * 9))
    assert sorted(two["requests_per_engine"]) == [0, 12]
    assert two["predicted_per_cached"] == pytest.approx(1.0)


def test_replay_coordinators_refuses_a_failover(capsys, tmp_path):
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:2]))
    assert main(["replay", str(trace), "--coordinators", "2", "--failover-at", "0.5"]) == 2
    assert "--coordinators runs without --pd and --failover-at" in capsys.readouterr().err
