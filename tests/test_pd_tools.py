"""``coordkit demo --pd`` and ``coordkit replay --pd``: their three clusters, the
engines' roles, the coordinator's options, the table's TTFT and ITL, and the one
line a coordinator that does not run P/D gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import zmq

from coordkit.protocol import unpackb
from coordkit.tools import pd, replay
from coordkit.tools.cli import _parser, main
from coordkit.tools.engines import fake_engine_processes
from tests.support.cluster import bind_address
from tests.support.peers import ENGINE_HELLO

TRACE = Path(__file__).parent.parent / "bench" / "traces" / "mooncake_synthetic_last1000.jsonl"


def test_the_three_runs():
    aggregated, always, conditional = pd.pd_runs(5, None, 128)
    assert (aggregated.label, aggregated.roles, aggregated.mode) == (
        "aggregated",
        (None,) * 5,
        None,
    )
    assert always.label == "P/D 2+3" and always.mode == "always"
    assert always.roles == ("prefill", "prefill", "decode", "decode", "decode")
    assert (conditional.label, conditional.mode, conditional.threshold) == (
        "conditional P/D 2+3",
        "conditional",
        128,
    )
    assert conditional.roles == always.roles and conditional.prefill_engines == 2
    assert pd.pd_runs(4, 3, 0)[1].roles == ("prefill",) * 3 + ("decode",)


@pytest.mark.parametrize(
    ("engines", "prefills", "reason"),
    [
        (1, None, "0 of 1 engines prefill"),
        (4, 4, "4 of 4 engines prefill"),
    ],
)
def test_each_role_needs_an_engine(engines, prefills, reason):
    with pytest.raises(ValueError, match=reason):
        pd.pd_runs(engines, prefills, 256)


def test_the_coordinators_options(monkeypatch):
    aggregated, always, conditional = pd.pd_runs(2, None, 64)

    class Runs:  # a coordinator that runs P/D
        def __init__(self, address: str, pd_mode: str = "conditional", pd_threshold: int = 256):
            pass

    class DoesNot:
        def __init__(self, address: str):
            pass

    monkeypatch.setattr(pd, "Coordinator", Runs)
    assert pd.coordinator_options(aggregated) == {}
    assert pd.coordinator_options(always) == {"pd_mode": "always", "pd_threshold": 64}
    assert pd.coordinator_options(conditional) == {"pd_mode": "conditional", "pd_threshold": 64}
    monkeypatch.setattr(pd, "Coordinator", DoesNot)
    assert pd.coordinator_options(aggregated) == {}
    with pytest.raises(ValueError, match="does not run disaggregated prefill/decode yet"):
        pd.coordinator_options(always)


@pytest.mark.parametrize(
    ("command", "reason"),
    [
        (["replay", str(TRACE), "--pd", "--compare-policies"], "--pd runs one policy"),
        (["replay", str(TRACE), "--pd", "--failover-at", "0.5"], "--pd runs one policy"),
        (["replay", str(TRACE), "--pd", "--engines", "1"], "needs a prefill engine"),
        (["demo", "--pd", "--compare-policies"], "--pd runs one policy"),
        (["demo", "--pd", "--engines", "3", "--prefill-engines", "3"], "3 of 3 engines"),
    ],
)
def test_what_pd_cannot_run_is_one_line(capsys, command, reason):
    assert main(command) == 2
    err = capsys.readouterr().err
    assert reason in err and len(err.strip().splitlines()) == 1


def test_without_a_pd_coordinator_the_tools_say_so_in_one_line(capsys, monkeypatch):
    class DoesNot:
        def __init__(self, address: str):
            pass

    monkeypatch.setattr(pd, "Coordinator", DoesNot)
    for command in (["replay", str(TRACE), "--pd"], ["demo", "--pd"]):
        assert main(command) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"coordkit {command[0]}: this coordinator does not run")
        assert len(err.strip().splitlines()) == 1


def test_the_engines_of_a_pd_run_say_their_roles(tmp_path):
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.RCVTIMEO, 10_000)
    router.setsockopt(zmq.LINGER, 0)
    address = bind_address("ipc", tmp_path)
    router.bind(address)
    roles = pd.pd_runs(3, 1, 256)[1].roles
    try:
        with fake_engine_processes(address, 3, ["--heartbeat", "0"], roles):
            hellos = {}
            while len(hellos) < 3:
                identity, frame = router.recv_multipart()
                if frame:
                    header, hello = unpackb(frame)
                    assert header == ENGINE_HELLO
                    hellos[identity] = hello.get("role")
    finally:
        router.close()
    assert hellos == {b"engine-0": "prefill", b"engine-1": "decode", b"engine-2": "decode"}


def test_the_replay_table_has_ttft_itl_and_the_cost_model(tmp_path):
    args = _parser().parse_args(["replay", str(TRACE), "--pd", "--engines", "4"])
    trace = replay.load_trace(TRACE, limit=3)
    runs = []
    for n, cluster in enumerate(pd.pd_runs(4, None, args.pd_threshold)):
        results = replay._Results(args.policy, None, cluster)
        results.ttft = [0.1 * (n + 1), 0.3 * (n + 1)]
        results.latency = [1.0, 2.0]
        results.itl = [0.020 + n / 1000, 0.050]
        results.ranks.update({2: 2} if cluster.mode else {0: 1, 1: 1})
        runs.append(results)
    table = replay._table(trace, args, "py", runs)
    assert "P/D: 2 prefill and 2 decode engines, policy prefix; a KV transfer takes 2 ms" in table
    assert "100000 tokens/s (h100); conditional: at most 256 uncached prompt tokens" in table
    lines = {line.split("  ")[1]: line for line in table.splitlines() if line.startswith("  ")}
    assert lines["run"].split()[1:] == ["aggregated", "P/D", "2+2", "conditional", "P/D", "2+2"]
    assert lines["ITL p50"].split()[2:] == ["20.0", "ms", "21.0", "ms", "22.0", "ms"]
    assert "prefill: 0 req" in lines["engine 0"] and "decode: 2 req" in lines["engine 2"]
    report = replay._report(trace, args, "py", runs)
    assert report["options"]["pd"] is True and report["options"]["pd_threshold"] == 256
    assert report["results"]["P/D 2+2"]["itl"] == [0.021, 0.050]
    assert report["results"]["P/D 2+2"]["itl_p99"] == 0.050
    json.dumps(report)


def test_replay_without_pd_reports_itl_too(impl, capsys, tmp_path):
    trace = tmp_path / "slice.jsonl"
    trace.write_text("".join(TRACE.read_text().splitlines(keepends=True)[:6]))
    report = tmp_path / "report.json"
    command = ["replay", str(trace), "--engines", "2", "--speedup", "200"]
    command += ["--max-output-tokens", "4", "--implementation", impl.name]
    assert main([*command, "--json", str(report), "--no-progress"]) == 0
    table = capsys.readouterr().out
    assert "ITL p50" in table and "ITL p99" in table
    [results] = json.loads(report.read_text())["results"].values()
    assert len(results["itl"]) == results["completed"] == 6  # every output is 4 tokens
    assert all(itl > 0 for itl in results["itl"])
