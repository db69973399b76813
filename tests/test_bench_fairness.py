"""``coordkit bench --fairness``: its figures from a run's records, and one short run on
real processes (a coordinator, a fake engine, a client per tenant).

What the run finds is not asserted (docs/design.md: benchmarks, not tests), only that
every request is accounted for, and what it says of the queue: a coordinator that does
not queue (it grants no "qos") refuses what finds no room (BUSY); one that queues
refuses nothing below its limit.
"""

from __future__ import annotations

import json

import pytest

from coordkit.tools import bench
from coordkit.tools.bench.fairness import (
    LATENCY_RATIO,
    Tenant,
    criteria,
    jain,
    percentile,
    summarize_tenant,
)


def test_percentiles_and_jain():
    assert percentile([], 99) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([float(i) for i in range(1, 101)], 99) == 99.0
    assert jain([5, 5, 5, 5]) == 1.0
    assert jain([4, 0, 0, 0]) == 0.25
    assert jain([0, 0]) is None


def test_a_tenant_summarized():
    records = [(0.1, 0.5, "ok"), (1.0, None, "BUSY"), (2.0, 0.25, "ok"), (4.5, None, "TIMED_OUT")]
    summary = summarize_tenant(Tenant("t", priority=-1, rate=3.0), records, 5.0)
    assert summary == {
        "priority": -1,
        "kind": "light",
        "sent": 4,
        "answered": 2,
        "refused": 1,
        "failed": 1,
        "p50_s": 0.25,
        "p99_s": 0.5,
        "steady": 1,  # sent between 1 s and 4 s, answered
    }


def _run(label, **tenants):
    scenario = label.split(" ")[0]
    filled = {
        name: {"p99_s": None, "refused": 0, "steady": 0, **figures}
        for name, figures in tenants.items()
    }
    return {"label": label, "scenario": scenario, "tenants": filled}


def test_criteria():
    runs = [
        _run("alone", light={"p99_s": 0.1}),
        _run("flood", light={"p99_s": 0.1 * LATENCY_RATIO + 0.01}, flood={"refused": 0}),
        _run("flood (unqueued)", light={"p99_s": 5.0}, flood={}),
        _run("weights", heavy={"steady": 340}, lighter={"steady": 100}),
        _run("equal", **{f"e{i}": {"steady": 100 + i} for i in range(4)}),
        _run("priority", urgent={"p99_s": 0.2}, flood={}),
    ]
    assert [(c["criterion"].split(":")[0], c["met"]) for c in criteria(runs)] == [
        ("flood", False),  # its p99 past 3x alone's
        ("flood", True),  # nothing refused
        ("weights 3", True),  # 3.4: within 15% of 3
        ("equal", True),
        ("priority", True),
    ]
    assert criteria([_run("flood", light={}, flood={"refused": 3})])[1]["met"] is False


@pytest.mark.timeout(240)
def test_a_short_run_accounts_for_every_request(tmp_path):
    path = tmp_path / "fairness.json"
    arguments = ["--fairness", "--quick", "--fairness-scenarios", "alone", "flood"]
    arguments += ["--fairness-seconds", "1.5", "--fairness-implementation", "py"]
    assert bench.main([*arguments, "--json", str(path)]) in (0, 1)
    result = json.loads(path.read_text())
    assert not result["failures"]
    runs = {run["label"]: run for run in result["fairness"]["runs"]}
    assert list(runs) == ["alone", "flood", "flood (unqueued)"]
    for run in runs.values():
        for name, tenant in run["tenants"].items():
            assert tenant["sent"] == tenant["answered"] + tenant["refused"] + tenant["failed"]
            assert tenant["sent"] == len(run["records"][name]) > 0
    flood = runs["flood"]
    refused = sum(t["refused"] for t in flood["tenants"].values())
    # Where nothing waits at the coordinator, a full fleet refuses (BUSY); where it
    # queues, nothing is refused below its limit.
    assert refused > 0 if not flood["queue"] else refused == 0
    assert runs["flood (unqueued)"]["tenants"]["flood"]["refused"] == 0


def test_bad_fairness_options_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit:
        bench.main(["--fairness", "--fairness-seconds", "0"])
    assert exit.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "--fairness-engines, -seconds, -step and -tokens must be positive" in line
