"""Smoke test of ``coordkit bench --failover --quick``: it runs on both implementations,
kills the coordinator (or an engine) with requests in flight, and reports that none
was lost.

The figures (the time to the first reply, the added p99) are reported, never
asserted (docs/design.md: benchmarks, not tests); the counts are: no request
may be lost or get anything but its real final.
"""

from __future__ import annotations

import json

import pytest

from coordkit.tools import bench
from coordkit.tools.bench import failover
from tests.support.implementations import unavailable


def run_quick(tmp_path, impl, mode: str) -> dict:
    path = tmp_path / "failover.json"
    argv = ["--failover", "--quick", "--variants", impl.name, "--failover-modes", mode]
    assert bench.main([*argv, "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert not result["failures"]
    (row,) = result["failover"]["summary"]
    assert (row["mode"], row["variant"], row["repetitions"]) == (mode, impl.name, 1)
    assert row["requests"] > 0 and row["crossed"] > 0  # the kill found requests in flight
    for count in ("lost", "failed", "wrong", "started_twice"):
        assert row[count] == 0, (count, result["failover"]["runs"][0]["errors"])
    assert row["failed"] == sum(row["failed_by"].values())
    if mode != "engine":  # a reply came after the new coordinator listened, after the kill
        assert row["kill_to_first_reply_s"] >= row["kill_to_serving_s"] > 0
    return row


def test_a_restart_loses_nothing(tmp_path, impl):
    row = run_quick(tmp_path, impl, "restart")
    assert row["restart_delay_s"] == 0.5


def test_a_standby_takeover_loses_nothing(tmp_path, impl):
    if failover.ha_missing():
        unavailable(failover.MISSING_HA)
    row = run_quick(tmp_path, impl, "standby")
    assert row["ttl_s"] == 2  # --quick's


def test_bad_failover_options_get_one_line(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--failover", "--kill-after", "0"])
    assert "--kill-after and --ha-ttl must be positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--failover", "--variants", "floor"])
    assert "--failover runs c and py" in capsys.readouterr().err


def test_an_engine_killed_loses_nothing(tmp_path, impl):
    """An engine SIGKILLed under the load: what it had not started runs elsewhere, what it
    had streamed goes on elsewhere from its tokens, every token checked."""
    row = run_quick(tmp_path, impl, "engine")
    assert "restart_delay_s" not in row and "ttl_s" not in row


def test_the_standby_without_etcd_gets_one_line(capsys, monkeypatch):
    """Asked for by name, refused in one line; by default, skipped with one."""
    monkeypatch.setattr(failover, "ha_missing", lambda: failover.MISSING_HA)
    with pytest.raises(SystemExit):
        bench.main(["--failover", "--failover-modes", "standby"])
    assert f"coordkit bench: {failover.MISSING_HA}" in capsys.readouterr().err
    args = bench._parse(["--failover"])
    assert args.failover_modes == ["restart", "engine"]
    assert f"skipping the standby: {failover.MISSING_HA}" in capsys.readouterr().err
